"""What `attach` changes on a model, and how it is undone: module hooks, forward wrappers, and HF
gradient checkpointing switched off on the managed decoder layers."""

from __future__ import annotations

import logging
from typing import Callable, Iterable

import torch.nn as nn

logger = logging.getLogger("hilore_verl")


class Installed:
    """Hook handles, replaced `forward` attributes and checkpointing flags, removed in reverse by `remove()`."""

    def __init__(self):
        self.handles: list = []
        self.forward_attrs: list[tuple[nn.Module, Callable | None]] = []
        self.gc_state: list[tuple[nn.Module, bool, Callable | None]] = []

    def hook_root(self, model: nn.Module, pre: Callable, post: Callable) -> None:
        self.handles.append(model.register_forward_pre_hook(pre))
        self.handles.append(model.register_forward_hook(post, always_call=True))

    def hook_units(self, modules: Iterable[nn.Module], pre: Callable, post: Callable,
                   wrap: Callable[[nn.Module, Callable], Callable]) -> None:
        """Pre / post hooks (the post hook runs even when the forward raises) and a `forward` wrapper."""
        for module in modules:
            self.handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
            self.handles.append(module.register_forward_hook(post, with_kwargs=True, always_call=True))
            self.forward_attrs.append((module, module.__dict__.get("forward")))
            module.forward = wrap(module, module.forward)

    def hook_blocks(self, blocks: Iterable[nn.Module], pre: Callable, post: Callable) -> None:
        """Pre / post hooks on decoder blocks, where a region that recomputes a whole block starts and ends."""
        for block in blocks:
            self.handles.append(block.register_forward_pre_hook(pre, with_kwargs=True))
            self.handles.append(block.register_forward_hook(post, with_kwargs=True, always_call=True))

    def take_over_gradient_checkpointing(self, blocks: Iterable[nn.Module]) -> None:
        """HF checkpointing would hide a managed layer's saved tensors from the runtime: switch it off there."""
        layers = [b for b in {id(b): b for b in blocks if getattr(b, "gradient_checkpointing", False)}.values()]
        for module in layers:
            self.gc_state.append((module, True, module.__dict__.get("_gradient_checkpointing_func")))
            module.gradient_checkpointing = False
        if layers:
            logger.warning("hilore-verl: turned off Hugging Face gradient checkpointing on %d decoder layers; "
                           "the runtime now decides per unit what is kept, compressed or recomputed", len(layers))

    def checkpointing(self, on: bool) -> bool:
        """HF checkpointing on the taken-over layers back on (a plan that is exactly it) or off again;
        False when there is none to turn on (the model came without it)."""
        for module, _, _ in self.gc_state:
            module.gradient_checkpointing = on
        return bool(self.gc_state)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        for module, previous in reversed(self.forward_attrs):
            if previous is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = previous
        self.forward_attrs.clear()
        for module, enabled, func in self.gc_state:
            module.gradient_checkpointing = enabled
            if func is not None:
                module._gradient_checkpointing_func = func
        self.gc_state.clear()
