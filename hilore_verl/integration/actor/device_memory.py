"""Memory a rank may use for the actor update, measured when the actor trains (budget mode `auto`).

Measured at the engine's first `train_batch`, that is after a colocated rollout engine has released
its memory and verl has loaded the actor's parameters and optimizer state back:
  - an accelerator (CUDA, NPU): free device memory + what this process's caching allocator already
    holds (the actor's static state is in it, and so is cached memory the update can reuse);
  - CPU: the host's available memory (`MemAvailable`) shared evenly among this host's ranks, +
    this process's resident memory.
The minimum over the data-parallel group, so every rank plans from the same budget.

The device measured is the one the rank computes on (`compute_device`), not where a parameter lives:
under FSDP2's parameter offload the parameters are on the host while activations are on the GPU.
"""

from __future__ import annotations

import socket

import torch
import torch.distributed as dist

from hilore_verl.measure import host_memory
from hilore_verl.integration.actor.collectives import all_reduce_on_host, host_group


def compute_device() -> torch.device:
    """The device this rank computes on: verl's platform device at its current index (the CPU on the
    CPU platform, also where `VERL_PLATFORM=cpu` runs a GPU host on its CPUs)."""
    from verl.utils.device import get_device_name

    name = get_device_name()
    if name == "cpu":
        return torch.device("cpu")
    return torch.device(name, torch.get_device_module(name).current_device())


_host_available_bytes = host_memory.available_bytes  # a name of its own here: tests stand in for it


def _resident_bytes() -> float:
    return float(host_memory.resident_bytes())


def _ranks_on_this_host(group) -> int:
    if not dist.is_initialized():
        return 1
    names = [None] * dist.get_world_size(group)
    dist.all_gather_object(names, socket.gethostname(), group=host_group(group))
    return max(1, names.count(socket.gethostname()))


def available_bytes(device: torch.device | None = None, group=None) -> float:
    """Bytes this rank may use at its peak (static state included), the minimum over `group`'s ranks.

    `device`: the compute device (default `compute_device()`). A host device given on a rank that
    computes on an accelerator is read as an offloaded parameter's device: the accelerator is measured."""
    compute = compute_device()
    if device is None or (device.type == "cpu" and compute.type != "cpu"):
        device = compute
    if device.type != "cpu":
        dm = torch.get_device_module(device.type)
        free, _ = dm.mem_get_info(device)
        value = float(free + dm.memory_reserved(device))
    else:
        value = _host_available_bytes() / _ranks_on_this_host(group) + _resident_bytes()
    if dist.is_initialized():
        t = torch.tensor([value], dtype=torch.float64)
        all_reduce_on_host(t, "min", group)
        value = float(t.item())
    return value
