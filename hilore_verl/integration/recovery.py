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


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    return _local(t).detach().to("cpu", copy=True)


class StepSnapshot:
    """Host copies of what an optimizer step changes: this rank's parameter shards, their gradients
    (clipping scales them in place) and the optimizer state (moments, step counters). `restore()`
    writes them back into the same tensors; state the step created (Adam's first step) is removed."""

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        with torch.no_grad():
            self.params = [(p, _host_copy(p)) for p in module.parameters()]
            self.grads = [(p, None if p.grad is None else _host_copy(p.grad)) for p, _ in self.params]
            self.state = {p: {k: _host_copy(v) if isinstance(v, torch.Tensor) else copy.deepcopy(v)
                              for k, v in s.items()}
                          for p, s in optimizer.state.items()}
        self.nbytes = sum(t.numel() * t.element_size() for _, t in self.params)
        self.nbytes += sum(t.numel() * t.element_size() for _, t in self.grads if t is not None)
        self.nbytes += sum(v.numel() * v.element_size() for s in self.state.values() for v in s.values()
                           if isinstance(v, torch.Tensor))

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
