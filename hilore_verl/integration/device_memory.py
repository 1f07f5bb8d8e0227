"""Memory a rank may use for the actor update, measured when the actor trains (budget mode `auto`).

Measured at the engine's first `train_batch`, that is after a colocated rollout engine has released
its memory and verl has loaded the actor's parameters and optimizer state back:
  - CUDA: free device memory + what this process's caching allocator already holds (the actor's
    static state is in it, and so is cached memory the update can reuse);
  - CPU: the host's available memory (`MemAvailable`) shared evenly among this host's ranks, +
    this process's resident memory.
The minimum over the data-parallel group, so every rank plans from the same budget.
"""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist


def _host_available_bytes() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024
    raise RuntimeError("hilore-verl: budget mode auto needs MemAvailable in /proc/meminfo on a CPU host")


def _resident_bytes() -> float:
    with open("/proc/self/statm") as f:
        return float(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _ranks_on_this_host(group) -> int:
    if not dist.is_initialized():
        return 1
    names = [None] * dist.get_world_size(group)
    dist.all_gather_object(names, socket.gethostname(), group=group)
    return max(1, names.count(socket.gethostname()))


def available_bytes(device: torch.device, group=None) -> float:
    """Bytes this rank may use at its peak (static state included), the minimum over `group`."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        value = float(free + torch.cuda.memory_reserved(device))
    else:
        value = _host_available_bytes() / _ranks_on_this_host(group) + _resident_bytes()
    if dist.is_initialized():
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
        value = float(t.item())
    return value
