"""The data-parallel reductions a HiLoRe session needs (host.Collectives), over torch.distributed.

Every collective HiLoRe issues during training is here or in the engine that owns the group:
the planner, the runtime and the session only call these methods.

HiLoRe's reductions are a few host values (byte counts, log-sensitivities, the audit's sums). They
run on a gloo group of their own over the data-parallel ranks (`host_group`), not on verl's group:
that one may have no CPU backend (NCCL alone, as a device mesh's groups are), and a CPU tensor on it
fails.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import threading
from typing import Sequence

import torch
import torch.distributed as dist

logger = logging.getLogger("hilore_verl")
STOP_KEY = "hilore/stop"  # set in the job's store by a rank that stops training; its value says why
WATCH_EVERY_S = 0.5  # how often each rank's monitor reads the store for STOP_KEY
CLOSE_WAIT_S = 5.0  # at exit, how long to wait for the monitor's last store read to return
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
    exact enough) on its gloo twin, a separate gloo group on which failing ranks agree before a retry,
    and the stop of a step that cannot be retried (the job's store, a monitor per rank)."""

    def __init__(self, group, fault_timeout_s: float):
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.host_group = host_group(group)
        # used only to agree on a fault; its timeout bounds the wait for peers that did not fail.
        # Not the host group: a failing rank's flag must never pair with a peer's reduction.
        self.fault_group = _gloo_group_over(dist.group.WORLD if group is None else group,
                                            timeout=datetime.timedelta(seconds=fault_timeout_s))
        self.fault_timeout_s = fault_timeout_s
        self.rank = dist.get_rank()
        self.store = _store()  # the job's store, kept: an abort takes the default group and its handle along
        self.stop_reason: str | None = None  # why training stopped (this rank's, or a peer's), once known
        self._monitor: threading.Thread | None = None
        self._closing = threading.Event()  # set at exit (`close`); the monitor sleeps on it

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

    def agree_on_failure(self) -> str | None:
        """Called by a rank that failed, once its own state is reset: None when every rank failed and the
        ranks issued the same number of collectives on every group they share (each rank is here, and no
        collective of the failed attempt is left unpaired): the retry may start. Else why not; the stop
        is then published and this process's groups aborted, so that a peer blocked in a collective
        gets an error at once instead of hanging, and raises StepFailed too (`stopped_by_peer`).

        A rank that failed alone finds its peers inside the step's collectives, not here: after the
        fault group's timeout it stops. A retry must not start then, nor where counts differ: its
        collectives would pair with the peers' unrelated ones (same shapes, other layers) and could
        corrupt the update silently."""
        if self.stopped_by_peer() is not None:
            return self.stopped_by_peer()
        rank = self.rank
        rows: list = [None] * dist.get_world_size(self.fault_group)
        try:
            dist.all_gather_object(rows, (rank, issued_collectives(exclude=self.fault_group)), group=self.fault_group)
        except RuntimeError:  # timed out: a peer is not failing
            reason = (f"rank {rank} failed and its peers did not reach the agreement within "
                      f"hilore.fault_timeout_s={self.fault_timeout_s:g} s")
        else:
            reason = unpaired(rows)
        if reason is not None:
            self.stop(reason)
        return reason

    def stop(self, reason: str) -> None:
        """Tell every rank that training stops (the job's store), and abort this process's groups."""
        self.stop_reason = self.stop_reason or f"rank {self.rank}: {reason}"
        try:
            if self.store is not None:
                self.store.set(STOP_KEY, self.stop_reason)
        except RuntimeError:  # the store is gone with its host rank: its peers' collectives fail anyway
            pass
        _abort()

    def stopped_by_peer(self) -> str | None:
        """Why a rank stopped training, where one did (its STOP_KEY); None otherwise."""
        if self.stop_reason is not None:
            return self.stop_reason
        try:
            if self.store is None or not self.store.check([STOP_KEY]):
                return None
            self.stop_reason = self.store.get(STOP_KEY).decode()
        except RuntimeError:  # the job's store is gone: the rank that hosts it has ended
            self.stop_reason = "the rank hosting the job's store, which ended"
        return self.stop_reason

    def watch(self) -> None:
        """Start this rank's monitor (once): a daemon thread that reads STOP_KEY every WATCH_EVERY_S and,
        when a rank has stopped, aborts this process's groups, so that a collective waiting for that
        rank raises here instead of hanging (NCCL's kernels wait on the device until their
        communicator is aborted; gloo's also end when the peer's sockets close). The monitor ends
        before the interpreter does (`close`, at exit)."""
        if self._monitor is None and self.store is not None:
            self._monitor = threading.Thread(target=self._watch, name="hilore-stop-monitor", daemon=True)
            self._monitor.start()
            atexit.register(self.close)

    def close(self) -> None:
        """Stop the monitor and wait for it. A daemon thread still inside a store read when the interpreter
        finalises aborts the process (C++ terminate, SIGABRT: measured on 10 of 10 two-rank exits
        with a thread reading the store in a loop), so a rank that trained to the end would die at exit."""
        self._closing.set()
        if self._monitor is not None:
            self._monitor.join(CLOSE_WAIT_S)

    def _watch(self) -> None:
        try:
            while not self.store.check([STOP_KEY]):
                if self._closing.wait(WATCH_EVERY_S):
                    return
            self.stop_reason = self.stop_reason or self.store.get(STOP_KEY).decode()
        except Exception:  # the store is gone: the job is ending
            return
        logger.error("hilore-verl: training stopped by %s; aborting this rank's process groups", self.stop_reason)
        _abort()


def issued_collectives(exclude=None) -> dict[str, int]:
    """Per process group this rank belongs to (by its name, the same on every rank): the collectives
    issued on it so far (torch's sequence number)."""
    world = dist.distributed_c10d._world
    counts = {}
    for group, name in world.pg_names.items():
        if group is exclude or group is None:
            continue
        try:
            counts[name] = int(group._get_sequence_number_for_group())
        except (RuntimeError, AttributeError):  # a backend without sequence numbers: not compared
            continue
    return counts


def unpaired(rows: list) -> str | None:
    """Every rank's (rank, issued_collectives()): None when ranks that share a group issued as many
    collectives on it, else the first group where they did not."""
    seen: dict[str, tuple[int, int]] = {}
    for rank, counts in rows:
        for name, count in counts.items():
            first = seen.setdefault(name, (rank, count))
            if first[1] != count:
                return (f"the ranks failed at different points (group {name}: rank {first[0]} issued {first[1]} "
                        f"collectives, rank {rank} {count})")
    return None


def _store():
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError):
        return None


def _abort() -> None:
    """Abort every process group of this process: collectives waiting in them raise."""
    try:
        dist.distributed_c10d._abort_process_group()
    except Exception as err:  # already aborted or destroyed
        logger.warning("hilore-verl: aborting the process groups: %s", err)


def collectives_for(group, fault_timeout_s: float):
    """DataParallel over `group` when torch.distributed is initialised, else one process."""
    from hilore_verl.training.host import SingleProcess

    if not (dist.is_available() and dist.is_initialized()):
        return SingleProcess()
    return DataParallel(group, fault_timeout_s)


__all__ = ["DataParallel", "all_reduce_on_host", "collectives_for", "host_group"]
