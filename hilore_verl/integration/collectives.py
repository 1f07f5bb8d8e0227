"""The data-parallel reductions a HiLoRe session needs (session.Collectives), over torch.distributed.

Every collective HiLoRe issues during training is here or in the engine that owns the group:
the planner, the runtime and the session only call these methods.
"""

from __future__ import annotations

import datetime
from typing import Sequence

import torch
import torch.distributed as dist

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


class DataParallel:
    """All-reduces over `group` (float64, so sums of byte counts and log-sensitivities stay exact
    enough), and a separate gloo group on which failing ranks agree before a retry."""

    def __init__(self, group, fault_timeout_s: float):
        self.group = group
        self.world_size = dist.get_world_size(group)
        # used only to agree on a fault; its timeout bounds the wait for peers that did not fail
        self.fault_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=fault_timeout_s))

    def reduce(self, values: Sequence[float], op: str = "sum") -> list[float]:
        t = torch.tensor([float(v) for v in values], dtype=torch.float64)
        if t.numel():
            dist.all_reduce(t, op=_OPS[op], group=self.group)
        return t.tolist()

    def sum_(self, t: torch.Tensor) -> None:
        dist.all_reduce(t, group=self.group)

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


__all__ = ["DataParallel", "collectives_for"]
