"""Inductor's compile workers, shared by the ranks of a node instead of multiplied by them.

Each process that compiles (the shared prompt's FlexAttention kernel on CUDA, the CPU codec's compiled
reference) starts Inductor's pool of compile workers, by default one per CPU of the machine (at most
32). Eight ranks per node would start eight such pools: 8 x 32 processes competing for the CPUs the
data loaders and the rollout also need. At the engine's start each rank limits its pool to its share of
the CPUs it may run on:

    compile_threads = max(1, cpus / local ranks)

`TORCHINDUCTOR_COMPILE_THREADS` set by the user wins (and is left alone).
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("hilore_verl")
ENV = "TORCHINDUCTOR_COMPILE_THREADS"


def local_ranks() -> int:
    """Ranks on this node: verl's workers carry LOCAL_WORLD_SIZE (torchrun too); else 1."""
    for name in ("LOCAL_WORLD_SIZE", "RAY_LOCAL_WORLD_SIZE"):
        value = os.environ.get(name, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return 1


def limit_compile_workers(ranks: int | None = None) -> int | None:
    """Set Inductor's compile workers for this process to its share of the CPUs; returns the number set
    (None where the user's TORCHINDUCTOR_COMPILE_THREADS stands)."""
    if os.environ.get(ENV):
        return None
    import torch._inductor.config as inductor

    ranks = local_ranks() if ranks is None else ranks
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    share = max(1, cpus // max(ranks, 1))
    if inductor.compile_threads > share:
        logger.info("hilore-verl: Inductor's compile workers %d -> %d (%d CPUs, %d ranks on this node)",
                    inductor.compile_threads, share, cpus, ranks)
        inductor.compile_threads = share
    return inductor.compile_threads


__all__ = ["limit_compile_workers", "local_ranks"]
