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
                                      updated, step counters advanced. Parameters and optimizer state
                                      are put back from a copy taken when the mini-batch started
                                      (`StepSnapshot`; nothing else changes them before the step); the
                                      gradients are dropped and a retry runs the mini-batch again.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch
import torch.nn as nn

logger = logging.getLogger("hilore_verl")


class StepFailed(RuntimeError):
    """A fault inside the optimizer step that could not be undone (no snapshot was taken)."""


def _device_module(device: torch.device):
    """The accelerator module (torch.cuda, torch.npu, ...) whose streams copy a tensor on `device`;
    None for the host, where copies are made inline."""
    return None if device.type == "cpu" else torch.get_device_module(device.type)


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
    """Host copies of what an optimizer step changes besides the gradients: the shards of the
    optimizer's parameters and its state (moments, step counters), in host buffers kept from one step
    to the next (pinned for an accelerator).

    `take()` is called when the mini-batch starts, before its first forward: on an accelerator the
    copies are queued on a side stream behind the work already queued (the last optimizer step),
    and run while the mini-batch's forward and backward passes do; an event marks their end.
    `before_step()` makes the current stream wait for that event on the device, so the step cannot
    change a tensor before it is copied; the host never waits. `restore()` (a fault inside the
    step) waits for the copies on the host, writes them back into the same tensors, and removes state
    the step created (Adam's first step). On the host every copy is made inline in `take()`.

    Gradients are not copied: the step scales them in place, and a retry runs the mini-batch again,
    which gives them again bitwise (session.py)."""

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer):
        self.module = module
        self.optimizer = optimizer
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._streams: dict[torch.device, Any] = {}  # a side stream per accelerator device, kept
        self._queued: dict[torch.device, Any] = {}  # devices with copies queued by this take(): their module
        self._events: list = []  # (device module, device, event) marking the end of those copies
        self.params: list = []
        self.state: dict = {}

    def _copy(self, key: tuple, t: torch.Tensor) -> torch.Tensor:
        src = _local(t).detach()
        buf = self._buffers.get(key)
        if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
            buf = self._buffers[key] = torch.empty(src.shape, dtype=src.dtype, pin_memory=src.device.type != "cpu")
        dm = _device_module(src.device)
        if dm is None:
            buf.copy_(src)
            return buf
        stream = self._streams.get(src.device)
        if stream is None:
            stream = self._streams[src.device] = dm.Stream(src.device)
        if src.device not in self._queued:  # behind the work already queued, which wrote the tensors
            stream.wait_stream(dm.current_stream(src.device))
            self._queued[src.device] = dm
        with dm.stream(stream):
            buf.copy_(src, non_blocking=True)
        if src.device.type != "cpu":
            src.record_stream(stream)  # the allocator does not reuse its memory before the copy has run
        return buf

    def _parameters(self) -> list:
        """The parameters the optimizer steps, each once (frozen ones never change)."""
        params, seen = [], set()
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in seen:
                    seen.add(id(p))
                    params.append(p)
        return params

    @torch.no_grad()
    def take(self) -> "StepSnapshot":
        """Queue the copies (when the mini-batch starts, before its first forward); returns self."""
        self._queued = {}
        params = self._parameters()
        self.params = [(p, self._copy(("p", i), p)) for i, p in enumerate(params)]
        index = {p: i for i, p in enumerate(params)}
        self.state = {p: {k: self._copy(("s", index.get(p, id(p)), k), v) if isinstance(v, torch.Tensor)
                          else copy.deepcopy(v) for k, v in s.items()}
                      for p, s in self.optimizer.state.items()}
        self._events = []
        for device, dm in self._queued.items():
            event = dm.Event()
            event.record(self._streams[device])
            self._events.append((dm, device, event))
        return self

    def before_step(self) -> None:
        """Right before the optimizer step: the current stream waits for the copies, on the device."""
        for dm, device, event in self._events:
            dm.current_stream(device).wait_event(event)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._buffers.values())

    @torch.no_grad()
    def restore(self) -> None:
        """After a fault inside the step: parameters and optimizer state as `take()` found them."""
        for _, _, event in self._events:
            event.synchronize()  # the copies have landed in the host buffers
        for p, saved in self.params:
            _local(p).copy_(saved)
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
