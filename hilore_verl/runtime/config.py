"""The runtime's own settings (`hilore_verl.attach(model, RuntimeConfig(...))`; the `hilore:` section's
`min_bytes` and `seed` reach it through config.py)."""

from __future__ import annotations

from dataclasses import dataclass

from hilore_verl.validation import checks


@dataclass(frozen=True)
class RuntimeConfig:
    min_bytes: int = 16384
    """Saved tensors smaller than this are always kept as they are (their bookkeeping would cost more)."""
    seed: int = 0
    """Base seed of stochastic rounding; each compressed tensor's seed also depends on the forward count
    and its position, so a run is reproducible from this seed."""

    def __post_init__(self):
        checks.integer("RuntimeConfig.min_bytes", self.min_bytes, ">= 0", lambda v: v >= 0)
        checks.integer("RuntimeConfig.seed", self.seed)


__all__ = ["RuntimeConfig"]
