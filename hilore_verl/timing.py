"""Time that means device time: the one clock every profiling measurement goes through.

On CUDA a host timer around launched work measures launches, not kernels; marks are CUDA events,
read once the work is done. On other devices (the CPU) a mark synchronizes the device's module
first (a no-op where work is synchronous), then reads `perf_counter`.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch


class DeviceClock:
    """`mark()` a point in the device's work; `seconds(a, b)` between two marks (waits for b)."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.module = torch.get_device_module(self.device.type) if self.device.type != "cpu" else torch.cpu
        self.events = self.device.type == "cuda"

    def synchronize(self) -> None:
        if self.events:
            self.module.synchronize(self.device)
        else:
            self.module.synchronize()

    def mark(self) -> Any:
        if self.events:
            event = self.module.Event(enable_timing=True)
            event.record()
            return event
        self.synchronize()
        return time.perf_counter()

    def seconds(self, start: Any, end: Any) -> float:
        if self.events:
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        return end - start

    def time(self, fn: Callable[[], Any], repeats: int = 1) -> float:
        """Seconds per call of `fn` (after one warm-up call), device work included."""
        fn()
        start = self.mark()
        for _ in range(repeats):
            fn()
        return self.seconds(start, self.mark()) / repeats
