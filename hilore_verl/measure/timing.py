"""Time that means device time: the one clock every profiling measurement goes through.

On CUDA a host timer around launched work measures launches, not kernels; marks are CUDA events,
read once the work is done, recorded on the stream the work runs on (a side stream for the offload's
copies). On other devices (the CPU) a mark synchronizes the device's module first (a no-op where
work is synchronous), then reads `perf_counter`.

A call's time at small sizes is its fixed part (a kernel launch: microseconds), not its bandwidth:
`fit_bandwidth` times it at two sizes and separates the two, t(n) = t0 + n / bw.
"""

from __future__ import annotations

import contextlib
import math
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

    def mark(self, stream: Any = None) -> Any:
        """`stream`: the stream the mark is recorded on (CUDA; None: the current one)."""
        if self.events:
            event = self.module.Event(enable_timing=True)
            event.record(stream)
            return event
        self.synchronize()
        return time.perf_counter()

    def seconds(self, start: Any, end: Any) -> float:
        if self.events:
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        return end - start

    def time(self, fn: Callable[[], Any], repeats: int = 1, stream: Any = None) -> float:
        """Seconds per call of `fn` (after one warm-up call), device work included. `stream`: `fn` runs
        and is marked on it (a side stream, ordered after the work queued before), as the runtime's
        offload copies run; None: the current stream."""
        context = contextlib.nullcontext()
        if stream is not None:
            stream.wait_stream(self.module.current_stream())
            context = self.module.stream(stream)
        with context:
            fn()
            start = self.mark(stream)
            for _ in range(repeats):
                fn()
            end = self.mark(stream)
        return self.seconds(start, end) / repeats


def fit_bandwidth(seconds: Callable[[int], float], nbytes: int, parts: int = 4) -> tuple[float, float]:
    """(bytes per second, fixed seconds per call) of an operation that takes t(n) = t0 + n / bw, from
    `seconds(n)` at `nbytes` and at `nbytes // parts`: bytes over the time of one call would read a
    launch-bound call's overhead as low bandwidth. A fit that is not physical (the larger call no
    slower, or t0 < 0: noise, or cache effects at the smaller size) falls back to t0 = 0 and the
    larger call's throughput, nbytes / t(nbytes)."""
    small = nbytes // parts
    large_s, small_s = seconds(nbytes), seconds(small) if 0 < small < nbytes else math.inf
    if small_s < large_s:
        bw = (nbytes - small) / (large_s - small_s)
        t0 = large_s - nbytes / bw
        if t0 >= 0:
            return bw, t0
    return nbytes / max(large_s, 1e-12), 0.0
