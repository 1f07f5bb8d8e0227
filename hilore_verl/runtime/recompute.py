"""Re-running a recorded unit call in backward: selective recompute with replayed child outputs.

The call runs again from its held inputs, under the RNG and autocast state it first ran with.
Child unit-module calls whose outputs were held (their unit is not recomputed) are not run again:
their wrapper returns the held output. What the call's own code saves is captured by order; the
inputs of its child calls and its outputs are captured by position. Only what a pending handle
still needs is kept.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn

from hilore_verl.runtime.records import CallRecord, map_tree, tensor_leaves

CACHE_KWARGS = ("past_key_values", "past_key_value")


@dataclass
class HeldInput:
    """A tensor a later recompute needs: held by its producer's mode, plus its requires_grad."""
    value: Any  # tensor, Compressed, Offloaded or Dropped
    requires_grad: bool


class Replay:
    """State of one recompute: the call being re-run and what it captures."""

    def __init__(self, target: CallRecord):
        self.target = target
        self.frames: list[tuple[Any, Any]] = []  # (module or function, held output to replay or None)
        self.own: dict[int, torch.Tensor] = {}
        self.own_count = 0
        self.child_count = 0
        self.child_inputs: dict[tuple, torch.Tensor] = {}

    def pre(self, module, args, kwargs) -> None:
        held = None
        if len(self.frames) == 1 and self.frames[0][0] is self.target.module:  # a direct child call
            j = self.child_count
            self.child_count += 1
            for path, t in tensor_leaves((args, kwargs)):
                self.child_inputs[("child_in", j, path)] = t.detach()
            held = self.target.children[j]
        self.frames.append((module, held))

    def post(self) -> None:
        self.frames.pop()

    def pack(self, t: torch.Tensor) -> "_NotForBackward":
        """Capture a save of the re-run. The re-run's own graph is never differentiated (its outputs
        are detached), so its nodes get a placeholder: holding `t` there would tie an output to its
        own grad_fn through C++ (a cycle Python's collector cannot see) and leak every re-run."""
        if len(self.frames) == 1:  # the target's own code: the n-th save, as in forward
            self.own[self.own_count] = t.detach() if t.requires_grad else t
            self.own_count += 1
        return _NOT_FOR_BACKWARD

    def replayed_output(self, module) -> Any:
        """The held output to return instead of running `module`, or None to run it."""
        if self.frames and self.frames[-1][0] is module and self.frames[-1][1] is not None:
            return materialize(self.frames[-1][1])
        return None


class _NotForBackward:
    """What a re-run's graph holds instead of its saved tensors."""

    __slots__ = ()

    def get(self):
        raise RuntimeError("hilore-verl: a recompute's internal graph was differentiated; it is not meant to be")


_NOT_FOR_BACKWARD = _NotForBackward()


def rerun(record: CallRecord, replay: Replay, pack: Callable, unpack: Callable) -> dict:
    """Run `record`'s call again; returns locator -> regenerated tensor for the pending handles."""
    args, kwargs = materialize(record.inputs)
    for key in CACHE_KWARGS:  # recompute must never touch an inference cache
        if kwargs.get(key) is not None:
            kwargs[key] = None
    if "use_cache" in kwargs:
        kwargs["use_cache"] = False
    with ExitStack() as stack:
        devices = [d for d in record.rng if d != "cpu"]
        stack.enter_context(torch.random.fork_rng(devices=devices, device_type="cuda" if devices else "cpu"))
        torch.set_rng_state(record.rng["cpu"])
        for d in devices:
            torch.cuda.set_rng_state(record.rng[d], d)
        for device_type, enabled, dtype in record.autocast:
            stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled))
        stack.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, unpack))
        stack.enter_context(torch.enable_grad())
        if not isinstance(record.module, nn.Module):  # a function run through Runtime.call: no module hooks
            replay.frames.append((record.module, None))
        output = record.module(*args, **kwargs)
    regen: dict[tuple, torch.Tensor] = {("own", n): t for n, t in replay.own.items()}
    regen.update({("out", path): t.detach() for path, t in tensor_leaves(output)})
    regen.update(replay.child_inputs)
    return {loc: t for loc, t in regen.items() if loc in record.pending}


def materialize(held_tree):
    """Tensors back from what `HeldInput`s hold, detached, with their original requires_grad."""
    return map_tree(held_tree, _materialize_one, lambda x: isinstance(x, HeldInput))


def _materialize_one(held: HeldInput) -> torch.Tensor:
    value = held.value
    t = (value if isinstance(value, torch.Tensor) else value.get()).detach()
    return t.requires_grad_(held.requires_grad) if held.requires_grad else t


def rng_state(inputs) -> dict:
    """CPU generator state, and each CUDA device's the inputs live on."""
    state = {"cpu": torch.get_rng_state()}
    for _, t in tensor_leaves(inputs):
        if t.is_cuda and t.device.index not in state:
            state[t.device.index] = torch.cuda.get_rng_state(t.device)
    return state


def autocast_state() -> list[tuple[str, bool, torch.dtype]]:
    return [(d, True, torch.get_autocast_dtype(d)) for d in ("cpu", "cuda") if torch.is_autocast_enabled(d)]
