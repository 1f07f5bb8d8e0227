"""How a figure measured at the probe grows to a micro-batch: its shares that grow with tokens squared, or
not at all, fitted from the same figure at two probe sizes (planner/profiling.py runs them; costs.py's
`CostTable.grow` applies them). With r = small tokens / large tokens and a figure f measured at both:

    quadratic:  f_small / f_large = (1 - q) r + q r^2                (attention over a packed row)
    fixed:      f_small / f_large = a + (1 - a) r                    (per-call overhead)
"""

from __future__ import annotations

import math


def quadratic_share(small: float, large: float, r: float) -> float:
    """Share q of a figure at the larger probe that grows with tokens squared, from the figure at both
    probes (`r` = small tokens / large tokens): small / large = (1 - q) r + q r^2, q clipped to [0, 1]
    (a fixed part, e.g. per-call overhead, reads as q < 0: `fixed_share` prices it)."""
    if large <= 0 or not 0 < r < 1:
        return 0.0
    return min(max((r - small / large) / (r - r * r), 0.0), 1.0)


def fixed_share(small: float, large: float, r: float, noise: float = 0.0) -> float:
    """Share a of a figure at the larger probe that does not grow with tokens (per-call overhead: a
    GPU's launches, or the host's module calls, which bound a small probe), from the figure at both
    probes: small / large = a + (1 - a) r, where the figure grew less than linearly (r < small /
    large) by more than `noise` (the ratio's relative uncertainty). A figure that did not grow at all
    (small / large >= 1) is all fixed: a = 1. Otherwise 0, priced linearly as without a second
    probe: growth at least linear is the quadratic share's, and growth that noise cannot tell from
    linear is not measured. (Pricing a fixed cost linearly would scale a tiny probe's call overhead
    with the tokens of a micro-batch many times its size.)"""
    if large <= 0 or not 0 < r < 1:
        return 0.0
    ratio = small / large
    if not r < ratio * (1 - noise):
        return 0.0
    return min((ratio - r) / (1 - r), 1.0)


def group_times(group: dict[str, str], runs: list[dict[str, float]]) -> dict[str, tuple[float, float]]:
    """Per group (`group`: unit -> group), over `runs` (unit -> time, one per probe) of its units' summed
    times: (the fastest, the spread (slowest - fastest) / fastest), inf where a unit did not run."""
    totals: dict[str, list[float]] = {}
    for timed in runs:
        per: dict[str, float] = {}
        for name, g in group.items():
            per[g] = per.get(g, 0.0) + timed.get(name, math.inf)
        for g, t in per.items():
            totals.setdefault(g, []).append(t)
    out = {}
    for g, ts in totals.items():
        lo, hi = min(ts), max(ts)
        out[g] = (lo, (hi - lo) / lo if 0 < lo and math.isfinite(hi) else math.inf)
    return out


__all__ = ["fixed_share", "group_times", "quadratic_share"]
