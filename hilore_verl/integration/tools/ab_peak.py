"""Peak memory measured alike in an A/B against stock verl (recipes/grpo/gpu_ab_0.5b.sh).

With HiLoRe on, its memory feedback resets the device's peak counter as each mini-batch starts
(peak_memory.PeakMeter), so verl's `perf/max_memory_allocated_gb`, read after each `train_batch`, is that
mini-batch's peak; stock verl never resets it, and the same metric is the process's peak since it started
(log-prob passes and the colocated rollout included). With `HILORE_VERL_PEAK_PER_MINI_BATCH=1` in the
environment of every worker, verl's own engine resets the counter at the same point (as its `train_batch`
starts), so both arms report one mini-batch's peak. Without it (the default) nothing of verl is touched.
"""

from __future__ import annotations

import functools
import os

from hilore_verl.integration.cpu_host.after_import import when_imported

ENV = "HILORE_VERL_PEAK_PER_MINI_BATCH"
ENGINE_MODULE = "verl.workers.engine.base"


def install() -> list[str]:
    if os.environ.get(ENV, "") != "1":
        return []
    when_imported(ENGINE_MODULE, _wrap)
    return ["engine:peak-per-mini-batch"]


def _wrap(module) -> None:
    """verl's `BaseEngine.train_batch` (HiLoRe's engine overrides it and resets the counter itself)."""
    engine = module.BaseEngine
    original = engine.train_batch
    if getattr(original, "resets_peak", False):
        return

    @functools.wraps(original)
    def train_batch(self, data, loss_function):
        from verl.utils.device import get_torch_device

        get_torch_device().reset_peak_memory_stats()
        return original(self, data, loss_function)

    train_batch.resets_peak = True
    engine.train_batch = train_batch
