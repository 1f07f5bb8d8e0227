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

import torch
import torch.nn as nn

from hilore_verl.training import staged_copy
from hilore_verl.training.staged_copy import StagedCopy

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
    """Host copies of what an optimizer step changes besides the gradients: the shards of the
    optimizer's parameters and its state (moments, step counters), in pageable host buffers of exactly
    their size, kept from one step to the next.

    `take()` is called when the mini-batch starts, before its first forward. Tensors on an accelerator
    are copied by `StagedCopy` (staged_copy.py): through a ring of two 128 MiB pinned slots, on a side
    stream behind the work already queued (the last optimizer step), by a worker thread, while the
    mini-batch's forward and backward passes run; pinned memory stays 256 MiB whatever the model's size.
    `before_step()` waits until every device copy is queued and makes the current stream wait for them
    on the device, so the step cannot change a tensor before it is copied. `restore()` (a fault inside
    the step) waits until every copy has landed, writes them back into the same tensors, and removes
    state the step created (Adam's first step). Host tensors are copied inline in `take()` (`staged=True`:
    through the same pipeline, as on an accelerator).

    Gradients are not copied: the step scales them in place, and a retry runs the mini-batch again,
    which gives them again bitwise (session.py)."""

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, staged: bool | None = None,
                 staging: StagedCopy | None = None):
        self.module = module
        self.optimizer = optimizer
        self.staged = staged
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._copy = staging or StagedCopy()
        self._pending = False  # a staged copy was started by the last take()
        self.params: list = []
        self.state: dict = {}

    def _hold(self, key: tuple, t: torch.Tensor, pairs: list) -> torch.Tensor:
        """The host buffer `t` is copied into (inline for a host tensor, else staged through `pairs`)."""
        src = _local(t).detach()
        buf = self._buffers.get(key)
        if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
            buf = self._buffers[key] = torch.empty(src.shape, dtype=src.dtype)
        if staged_copy.device_module(src.device) is None and not self.staged:
            buf.copy_(src)
        else:
            pairs.append((src.contiguous(), buf))
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
        """Start the copies (when the mini-batch starts, before its first forward); returns self."""
        pairs: list = []
        params = self._parameters()
        self.params = [(p, self._hold(("p", i), p, pairs)) for i, p in enumerate(params)]
        index = {p: i for i, p in enumerate(params)}
        self.state = {p: {k: self._hold(("s", index.get(p, id(p)), k), v, pairs) if isinstance(v, torch.Tensor)
                          else copy.deepcopy(v) for k, v in s.items()}
                      for p, s in self.optimizer.state.items()}
        self._pending = bool(pairs)
        if pairs:
            self._copy.start(pairs)
        return self

    def before_step(self) -> None:
        """Right before the optimizer step: every copy queued (host), the current stream waits for them."""
        if self._pending:
            self._copy.wait_device()

    @property
    def nbytes(self) -> int:
        """Pageable host bytes of the copies: 12 per parameter with fp32 Adam (parameter, two moments)."""
        return sum(t.numel() * t.element_size() for t in self._buffers.values())

    @property
    def pinned_bytes(self) -> int:
        """Page-locked host bytes: the staging ring's, on an accelerator (0 before the first staged copy)."""
        return self._copy.pinned_bytes

    @property
    def staging_bytes(self) -> int:
        """The staging ring's bytes, pinned or not: SLOTS x SLOT_BYTES once a copy was staged."""
        return self._copy.ring_bytes

    @torch.no_grad()
    def restore(self) -> None:
        """After a fault inside the step: parameters and optimizer state as `take()` found them."""
        if self._pending:
            self._copy.finish()  # every copy has landed in the host buffers
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
