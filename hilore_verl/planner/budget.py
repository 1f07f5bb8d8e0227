"""Memory budget: `gc_ratio` (default 1.10 x the full-recompute peak), `gib` (absolute) or `auto`."""

from __future__ import annotations

from dataclasses import dataclass

from hilore_verl.validation import checks

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
            raise ValueError(f"budget.mode: unknown mode {self.mode!r}; valid: {', '.join(MODES)} "
                             "(e.g. {mode: gc_ratio, value: 1.10} or {mode: gib, value: 40})")
        valid = {"gc_ratio": ">= 1 (GC's peak x value)", "gib": "> 0 (GiB)", "auto": ">= 0 (GiB of headroom)"}
        checks.number("budget.value", self.value, f"{valid[self.mode]} for mode {self.mode}",
                      lambda v: v > 0 or (self.mode == "auto" and v == 0))
        if self.mode == "gc_ratio" and self.value < 1:
            raise ValueError(f"budget.value: {self.value} is a gc_ratio below 1: below what full recompute needs "
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
