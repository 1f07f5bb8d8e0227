"""Run a function on N gloo ranks in fresh processes and collect what each rank returns (tests, demo, bench).

    results = run_on_ranks(fn, world_size=2, args=(...))   # results[rank] = fn(rank, world_size, *args)

`fn` must be importable (a module-level function). Each rank runs in a spawned process with
one OpenMP thread, with torch.distributed initialised (gloo) before `fn` and torn down after.
An exception in `fn` on any rank fails the call with `RankFailed` carrying that rank's traceback.
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, fn: Callable, world_size: int, port: int, out_dir: str, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    import verl  # noqa: F401  (loads the hilore plugin, so the CPU platform is in place before verl.workers)

    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        try:
            result = fn(rank, world_size, *args)
        except BaseException:
            # the root cause: written before the other ranks notice (they then fail in a collective)
            with open(os.path.join(out_dir, f"rank{rank}.error"), "w") as f:
                f.write(traceback.format_exc())
            raise
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        if dist.is_initialized():  # not where training stopped and aborted the groups (every rank did)
            dist.barrier()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _kill_ranks(processes, join_s: float = 30) -> None:
    """SIGKILL every rank process still running, then reap them all (each waited for up to `join_s`)."""
    for process in processes:
        if process.is_alive():
            process.kill()
    for process in processes:
        process.join(join_s)


class RankFailed(RuntimeError):
    """`fn` raised on a rank; the message holds that rank's traceback."""


def run_on_ranks(fn: Callable, world_size: int = 2, args: tuple = (), timeout_s: float = 600) -> list[Any]:
    """fn(rank, world_size, *args) on every rank; returns the per-rank results in rank order."""
    env_before = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the spawned ranks
    try:
        with tempfile.TemporaryDirectory(prefix="hilore-ranks-") as out_dir:
            ctx = mp.start_processes(_rank_main, args=(fn, world_size, free_port(), out_dir, args),
                                     nprocs=world_size, join=False, start_method="spawn")
            deadline = time.monotonic() + timeout_s
            try:
                try:
                    while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):  # raises if a rank failed
                        if time.monotonic() >= deadline:  # the ranks are killed below
                            raise TimeoutError(f"{fn.__name__} did not finish on {world_size} ranks within "
                                               f"{timeout_s} s")
                except (mp.ProcessRaisedException, mp.ProcessExitedException) as err:
                    for r in range(world_size):  # report the rank whose fn raised, not one that lost its peer
                        path = os.path.join(out_dir, f"rank{r}.error")
                        if os.path.exists(path):
                            with open(path) as f:
                                raise RankFailed(f"{fn.__name__} failed on rank {r}:\n{f.read()}") from err
                    raise
            except BaseException:
                # whatever ended the wait (the deadline, a failed rank, KeyboardInterrupt, a test's timeout):
                # no rank process outlives the call
                _kill_ranks(ctx.processes)
                raise
            return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]
    finally:
        if env_before is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = env_before
