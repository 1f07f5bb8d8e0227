"""The measured peak of one mini-batch, in the terms of the controller's memory model.

The memory model predicts `static + what the update holds` (planner/controller.py). What is measured:

    CUDA   torch.cuda.max_memory_reserved after reset_peak_memory_stats at the mini-batch's start: the
           caching allocator's segments, what the process holds on the device (static state included,
           so the figure is compared as it is). Not the allocated peak: a budget is device memory,
           and fragmentation (segments the allocator holds but cannot fit a request into) is what
           makes a job run out of memory at "enough" allocated bytes. Segments are rounded (to 2 MiB,
           20 MiB for requests of 1-10 MiB): an overshoot within `DEVICE_NOISE_BYTES` is not acted on;
    CPU    (Linux) the resident high-water mark, reset at the start (/proc/self/clear_refs <- 5), less
           the resident size then, plus the static bytes: what the mini-batch added on top of the
           state it started with. malloc may serve the update from memory it kept from an earlier
           one, so this can read low; it never reads the libraries and the interpreter.

The resident size also moves with what the update does not own (malloc's arenas, Python objects,
pages touched once): on the CPU an overshoot within `HOST_NOISE_BYTES` is not taken as the memory
model's error (`PeakMeter.noise_bytes`; `DEVICE_NOISE_BYTES` on CUDA). Measured here (glibc, torch
2.13): a fresh process's 24 MiB of float64 chunks read 24-27 MiB, and 64-67 MiB in about one run of
three when the chunks came from and went back to malloc's heap (its mmap threshold moves as blocks are
freed); the demo's model, one rank in-process, read 0.068-0.103 GiB from one mini-batch to the next
for a plan predicted at 0.059-0.062 GiB.

Where neither is available (another OS, /proc not writable, a high-water mark that does not rise by a
32 MiB mapping written page by page when the meter is made) `PeakMeter.available` is False with the
reason, and the session plans without the feedback (and says so once).
"""

from __future__ import annotations

import mmap

import torch

from hilore_verl.measure import host_memory

CLEAR_REFS = "/proc/self/clear_refs"
HOST_NOISE_BYTES = 64 * 2**20
DEVICE_NOISE_BYTES = 20 * 2**20  # the caching allocator's largest segment rounding
CHECK_BYTES = 32 * 2**20  # the mapping the host meter checks the mark with, once, when it is made


class PeakMeter:
    """`start()` before a mini-batch, `read(static_bytes)` after it: its peak in bytes, or None."""

    def __init__(self, cuda: bool | None = None):
        self.cuda = torch.cuda.is_available() and torch.cuda.is_initialized() if cuda is None else cuda
        self.why_not: str | None = None
        self.noise_bytes = float(DEVICE_NOISE_BYTES if self.cuda else HOST_NOISE_BYTES)
        self._start: float | None = None
        if not self.cuda:
            try:
                self.why_not = self.check_host_peak()
            except (OSError, RuntimeError) as err:
                self.why_not = f"the resident high-water mark cannot be reset or read here ({err})"

    @property
    def available(self) -> bool:
        return self.why_not is None

    def start(self) -> None:
        if not self.available:
            return
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
            return
        self.reset_host_peak()
        self._start = float(host_memory.resident_bytes())

    def read(self, static_bytes: float) -> float | None:
        """The peak since `start()` (None if it was not started or cannot be measured)."""
        if not self.available:
            return None
        if self.cuda:
            return float(torch.cuda.max_memory_reserved())
        if self._start is None:
            return None
        added = host_memory.peak_resident_bytes() - self._start
        self._start = None
        return static_bytes + max(added, 0.0)

    @classmethod
    def check_host_peak(cls) -> str | None:
        """Reset the mark, touch every page of a fresh anonymous mapping (no malloc in between), read the mark:
        None where it rose by the mapping, else why the mark cannot be used here."""
        cls.reset_host_peak()
        start = host_memory.resident_bytes()
        block = mmap.mmap(-1, CHECK_BYTES)
        try:
            block[::mmap.PAGESIZE] = b"\x01" * (CHECK_BYTES // mmap.PAGESIZE)  # one write a page
            added = host_memory.peak_resident_bytes() - start
        finally:
            block.close()
        if added < 0.9 * CHECK_BYTES:
            return (f"the resident high-water mark rose by {added / 2**20:.1f} MiB over a {CHECK_BYTES >> 20} MiB "
                    "mapping whose every page was written (the kernel does not keep it exactly here)")
        return None

    @staticmethod
    def reset_host_peak() -> None:
        with open(CLEAR_REFS, "w") as f:
            f.write("5")
