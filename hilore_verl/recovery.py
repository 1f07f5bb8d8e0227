"""Putting a failed training step back, so that a retry is exact or a failure leaves nothing half done.

verl's `train_batch` is: zero the gradients; forward + backward of every micro-batch (with
`use_no_sync_for_gradient_accumulation`, FSDP2 accumulates unsharded gradients and reduces them
in the last micro-batch's backward); `optimizer_step` (clip the gradients in place, then step).
What a fault in each part leaves behind, and what puts it back:

  forward / backward / gradient sync  FSDP2's per-iteration state (unsharded parameters, training
                                      states, pending collectives) and gradients: sharded `.grad` and
                                      the deferred unsharded accumulation, which `optimizer.zero_grad`
                                      does not see. `reset_after_failure` discards all of it;
                                      parameters and optimizer state were not touched.
  optimizer step (clip, step)         gradients scaled in place, some parameters and Adam moments
                                      updated, step counters advanced. Only a copy taken before the
                                      step (`StepSnapshot`) puts them back.
"""

from __future__ import annotations

import copy
import logging

import torch
import torch.nn as nn

logger = logging.getLogger("hilore_verl")


class StepFailed(RuntimeError):
    """A fault inside the optimizer step that could not be undone (no snapshot was taken)."""


def _fsdp_states(module: nn.Module):
    for m in module.modules():
        get_state = getattr(m, "_get_fsdp_state", None)
        if get_state is not None:
            yield m, get_state()


def _fsdp_params(state):
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # torch releases with one parameter group per state
        group = getattr(state, "_fsdp_param_group", None)
        groups = [group] if group is not None else []
    for group in groups:
        yield from group.fsdp_params


def reset_after_failure(module: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """After a forward or backward that raised: FSDP2's iteration state reset (collectives waited
    on, parameters resharded), gradient sync re-enabled, every gradient gone, including FSDP2's
    deferred unsharded accumulation. A plain (unsharded) module only loses its gradients."""
    states = list(_fsdp_states(module))
    if states:
        root = states[0][0]
        if hasattr(root, "reset_iter_state"):
            root.reset_iter_state()
        root.set_requires_gradient_sync(True)
    for _, state in states:
        for fsdp_param in _fsdp_params(state):
            fsdp_param.unsharded_accumulated_grad = None
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            if unsharded is not None:
                unsharded.grad = None
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=True)
    module.zero_grad(set_to_none=True)


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (sharing its storage), or the tensor itself."""
    return t._local_tensor if hasattr(t, "_local_tensor") else t


class StepSnapshot:
    """Host copies of what an optimizer step changes: this rank's parameter shards, their gradients
    (clipping scales them in place) and the optimizer state (moments, step counters). `take()` refreshes
    them before each step into host buffers kept from the last one (pinned on CUDA); `restore()` writes
    them back into the same tensors; state the step created (Adam's first step) is removed."""

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer):
        self.module = module
        self.optimizer = optimizer
        self._buffers: dict[tuple, torch.Tensor] = {}
        self.params: list = []
        self.grads: list = []
        self.state: dict = {}

    def _copy(self, key: tuple, t: torch.Tensor) -> torch.Tensor:
        src = _local(t).detach()
        buf = self._buffers.get(key)
        if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
            buf = self._buffers[key] = torch.empty(src.shape, dtype=src.dtype, pin_memory=src.is_cuda)
        buf.copy_(src, non_blocking=src.is_cuda)
        return buf

    @torch.no_grad()
    def take(self) -> "StepSnapshot":
        params = list(self.module.parameters())
        self.params = [(p, self._copy(("p", i), p)) for i, p in enumerate(params)]
        self.grads = [(p, None if p.grad is None else self._copy(("g", i), p.grad)) for i, p in enumerate(params)]
        index = {p: i for i, p in enumerate(params)}
        self.state = {p: {k: self._copy(("s", index.get(p, id(p)), k), v) if isinstance(v, torch.Tensor)
                          else copy.deepcopy(v) for k, v in s.items()}
                      for p, s in self.optimizer.state.items()}
        if any(p.is_cuda for p in params):
            torch.cuda.synchronize()  # the copies are non-blocking into pinned buffers
        return self

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._buffers.values())

    @torch.no_grad()
    def restore(self) -> None:
        for p, saved in self.params:
            _local(p).copy_(saved)
        for p, saved in self.grads:
            if saved is None:
                p.grad = None
            elif p.grad is None:
                raise StepFailed("hilore-verl: a gradient vanished during the failed optimizer step; cannot restore it")
            else:
                _local(p.grad).copy_(saved)
        state = self.optimizer.state
        for p in [p for p in state if p not in self.state]:
            del state[p]
        for p, saved in self.state.items():
            current = state[p]
            for k in [k for k in current if k not in saved]:
                del current[k]
            for k, v in saved.items():
                if isinstance(v, torch.Tensor) and isinstance(current.get(k), torch.Tensor):
                    _local(current[k]).copy_(v)
                else:
                    current[k] = copy.deepcopy(v)


class StepStart:
    """What an exact retry must start from besides the model: the CPU and CUDA random generators
    (dropout draws the same masks again) and the runtime's forward count (stochastic rounding
    draws the same seeds again)."""

    def __init__(self, runtime):
        self.runtime = runtime
        self.forwards = runtime.forwards
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)
        self.runtime.forwards = self.forwards
