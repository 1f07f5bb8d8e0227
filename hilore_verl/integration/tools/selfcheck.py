"""What `doctor` asks of verl: the plugin loaded, the platform verl picked, and a tiny verl FSDP2 engine
built here and trained one step (the proof that verl runs)."""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

import hilore_verl.integration  # noqa: F401  (version check first)
from hilore_verl.integration.tools.launch import free_port
from hilore_verl.tiny.models import save_tiny_model
from hilore_verl.tiny.workload import GRPOWorkload, make_grpo_batch


def import_verl() -> None:
    """Import verl, which loads its plugins' entry points (hilore-verl's records what happened in
    `hilore_verl.plugin.STATUS`)."""
    import verl  # noqa: F401


def platform_in_use() -> str:
    """The platform verl's auto-detection picked, in words."""
    from verl.plugin.platform import get_platform

    from hilore_verl.integration.cpu_host.platform import PlatformCPU

    current = get_platform()
    if isinstance(current, PlatformCPU):
        return "cpu (hilore-verl's CPU platform: gloo collectives, no accelerator)"
    return f"{current.device_name} ({type(current).__name__}, vendor {current.vendor_name})"

@dataclass
class EngineCheck:
    ok: bool
    detail: str
    seconds: float


def engine_selfcheck() -> EngineCheck:
    """One GRPO train step (verl's ppo_loss) of a 2-layer Qwen2 through FSDPEngineWithLMHead, fsdp2, 1 rank."""
    from verl.utils.device import get_device_name, get_nccl_backend

    from hilore_verl.integration.tools.verl_engine import actor_config, build_fsdp_engine, ppo_loss_fn, to_engine_batch

    t0 = time.perf_counter()
    own_group = not dist.is_initialized()
    if own_group:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("LOCAL_RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        dist.init_process_group(get_nccl_backend(), rank=0, world_size=1)
    try:
        with tempfile.TemporaryDirectory(prefix="hilore-doctor-") as model_dir:
            save_tiny_model(model_dir, "qwen2", seed=0)
            engine = build_fsdp_engine(model_dir, micro_batch_size_per_gpu=2)
            batch = make_grpo_batch(GRPOWorkload(num_groups=1, group_size=4), seed=0)
            td = to_engine_batch(batch, micro_batch_size_per_gpu=2)
            with engine.train_mode():
                out = engine.train_batch(td, loss_function=ppo_loss_fn(actor_config()))
            grad_norm = float(out["metrics"]["grad_norm"])
            module = type(engine.module).__name__
        if not torch.isfinite(torch.tensor(grad_norm)):
            return EngineCheck(False, f"train step gave a non-finite grad norm ({grad_norm})", time.perf_counter() - t0)
        detail = f"{module} on {get_device_name()}: one train step, grad norm {grad_norm:.4g}"
        return EngineCheck(True, detail, time.perf_counter() - t0)
    finally:
        if own_group:
            dist.destroy_process_group()
