"""verl's own activation offload as a benchmark baseline (CUDA only; verl requires FSDP-wrapped layers).

Wraps each decoder layer and the model with FSDP2 in a one-rank process group (what verl's engine
does on one GPU), keeps HF gradient checkpointing as set, and calls verl's
`enable_activation_offloading(model, "fsdp2", enable_ckpt)`, which groups saved activations per
layer and copies them to host memory on a side stream.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import hilore_verl.integration  # noqa: F401  (version check)
from hilore_verl.integration.tools.launch import free_port
from verl.utils.activation_offload import enable_activation_offloading


def enable_verl_activation_offload(model: torch.nn.Module) -> None:
    if not torch.cuda.is_available():
        raise RuntimeError("verl's activation offload needs a CUDA device")
    from torch.distributed.fsdp import fully_shard

    if not dist.is_initialized():  # a one-rank group on a free port (another job may hold any fixed one)
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        dist.init_process_group("nccl", rank=0, world_size=1)
    for layer in model.get_decoder().layers:
        fully_shard(layer)
    fully_shard(model)
    enable_activation_offloading(model, "fsdp2", enable_ckpt=getattr(model, "is_gradient_checkpointing", False))
