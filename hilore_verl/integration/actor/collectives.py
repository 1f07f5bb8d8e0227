"""The data-parallel reductions a HiLoRe session needs (session.Collectives), over torch.distributed.

Every collective HiLoRe issues during training is here or in the engine that owns the group:
the planner, the runtime and the session only call these methods.

HiLoRe's reductions are a few host values (byte counts, log-sensitivities, the audit's sums). They
run on a gloo group of their own over the data-parallel ranks (`host_group`), not on verl's group:
that one may have no CPU backend (NCCL alone, as a device mesh's groups are), and a CPU tensor on it
fails.
"""

from __future__ import annotations

import datetime
from typing import Sequence

import torch
import torch.distributed as dist

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
_HOST_GROUPS: dict = {}  # (group, default group) -> its gloo twin; the default group keys a re-initialised world


def _gloo_group_over(group, **kwargs):
    """A new gloo group over `group`'s ranks. Collective over the default group: torch needs every rank
    to create every group, in the same order, so where `group` is one of several (disjoint
    data-parallel groups) the ranks first agree on the list of all of them."""
    world = dist.get_world_size()
    ranks = sorted(dist.get_process_group_ranks(group))
    if len(ranks) == world:
        return dist.new_group(backend="gloo", **kwargs)
    every: list = [None] * world
    dist.all_gather_object(every, ranks)
    mine = None
    for members in sorted({tuple(r) for r in every}):
        created = dist.new_group(ranks=list(members), backend="gloo", **kwargs)
        if dist.get_rank() in members:
            mine = created
    return mine


def host_group(group=None):
    """The gloo group over `group`'s ranks (None: the default group) on which HiLoRe reduces host
    tensors; created at the first call for that group. Every rank of the default group calls it at
    the same point (in the engine: at initialisation, when the session's collectives are built)."""
    group = dist.group.WORLD if group is None else group
    key = (group, dist.group.WORLD)
    if key not in _HOST_GROUPS:
        _HOST_GROUPS[key] = _gloo_group_over(group)
    return _HOST_GROUPS[key]


def all_reduce_on_host(t: torch.Tensor, op: str = "sum", group=None) -> None:
    """All-reduce `t` in place over `group`'s ranks, through host memory: a tensor on a device (the
    audit's sums on the GPU) is reduced as a host copy and copied back."""
    on_host = t.device.type == "cpu" and t.is_contiguous()
    host = t if on_host else t.detach().cpu().contiguous()  # a copy
    dist.all_reduce(host, op=_OPS[op], group=host_group(group))
    if not on_host:
        t.copy_(host)


class DataParallel:
    """All-reduces over the ranks of `group` (float64, so sums of byte counts and log-sensitivities stay
    exact enough) on its gloo twin, and a separate gloo group on which failing ranks agree before a
    retry."""

    def __init__(self, group, fault_timeout_s: float):
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.host_group = host_group(group)
        # used only to agree on a fault; its timeout bounds the wait for peers that did not fail.
        # Not the host group: a failing rank's flag must never pair with a peer's reduction.
        self.fault_group = _gloo_group_over(dist.group.WORLD if group is None else group,
                                            timeout=datetime.timedelta(seconds=fault_timeout_s))

    def reduce(self, values: Sequence[float], op: str = "sum") -> list[float]:
        t = torch.tensor([float(v) for v in values], dtype=torch.float64)
        if t.numel():
            dist.all_reduce(t, op=_OPS[op], group=self.host_group)
        return t.tolist()

    def gather(self, values: Sequence[float]) -> list[list[float]]:
        """Every rank's `values` (the same length on every rank), in rank order: one collective for
        reductions of several kinds, done locally."""
        t = torch.tensor([float(v) for v in values], dtype=torch.float64)
        rows = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.all_gather(rows, t, group=self.host_group)
        return [r.tolist() for r in rows]

    def sum_(self, t: torch.Tensor) -> None:
        all_reduce_on_host(t, "sum", self.group)

    def every_rank_failed(self) -> bool:
        """Called by a rank that failed: True when every rank failed at the same point (each is here too).
        A rank that failed alone finds its peers inside the step's collectives, not here; after the
        fault group's timeout it gets False. A retry must not start then: its collectives would pair
        with the peers' unrelated ones (same shapes, other layers) and could corrupt the update silently."""
        flag = torch.ones(1, dtype=torch.float64)
        try:
            dist.all_reduce(flag, group=self.fault_group)
        except RuntimeError:  # timed out: a peer is not failing
            return False
        return int(flag.item()) == dist.get_world_size(self.fault_group)


def collectives_for(group, fault_timeout_s: float):
    """DataParallel over `group` when torch.distributed is initialised, else one process."""
    from hilore_verl.session import SingleProcess

    if not (dist.is_available() and dist.is_initialized()):
        return SingleProcess()
    return DataParallel(group, fault_timeout_s)


__all__ = ["DataParallel", "all_reduce_on_host", "collectives_for", "host_group"]
