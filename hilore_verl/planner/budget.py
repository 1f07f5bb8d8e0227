"""Memory budget: `gc_ratio` (default 1.10 x the full-recompute peak), `gib` (absolute) or `auto`."""

from __future__ import annotations

import math
from dataclasses import dataclass

MODES = ("gc_ratio", "gib", "auto")
GIB = 2**30


@dataclass(frozen=True)
class BudgetConfig:
    mode: str = "gc_ratio"
    """gc_ratio: value x the peak of full recompute (the GC baseline); gib: value GiB; auto: free
    device memory at start-up less `value` GiB of headroom."""
    value: float = 1.10
    """A finite number (int or float, not bool): >= 1 for gc_ratio, > 0 for gib, >= 0 for auto."""

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"unknown budget mode {self.mode!r}; valid: {', '.join(MODES)} "
                             "(e.g. {mode: gc_ratio, value: 1.10} or {mode: gib, value: 40})")
        if isinstance(self.value, bool) or not isinstance(self.value, (int, float)):
            raise ValueError(f"budget value must be a number, got {self.value!r}; e.g. gc_ratio 1.10, gib 40, auto 2")
        try:
            finite = math.isfinite(float(self.value))
        except OverflowError:  # an int no float can hold
            finite = False
        if not finite or self.value < 0 or (self.mode != "auto" and self.value == 0):
            raise ValueError(f"budget value must be > 0 (>= 0 for auto's headroom) and finite, got {self.value}")
        if self.mode == "gc_ratio" and self.value < 1:
            raise ValueError(f"budget value {self.value} is a gc_ratio below 1: below what full recompute needs "
                             "(GC's own peak); use 1.0 or more")

    def resolve(self, gc_peak_bytes: float, free_bytes: float | None = None) -> float:
        """The budget in bytes, given GC's predicted peak (and free device memory for auto)."""
        if self.mode == "gc_ratio":
            return self.value * gc_peak_bytes
        if self.mode == "gib":
            return self.value * GIB
        if free_bytes is None:
            raise ValueError("budget mode auto needs the free device memory")
        return free_bytes - self.value * GIB
