"""Paired rounds until the intervals resolve a target, or until a time cap.

A paired set is a list of keys (methods, or a planner at one sweep budget) stepped once each per
round, the order rotated; the first `warmup` rounds are run and not timed (the first round after
other work ran 25-70% slower than the rest on the CPU: its steps touch memory the others released).
Then each key not yet `settled` (a planner whose measured trial of its plans against the hands-off
baseline has not chosen, planner/arms.py) is stepped, untimed, until it is or `settle_max` steps ran:
the timed rounds measure the plans a run keeps, not the trial's alternation between two arms.
After every timed round the set's widest interval is taken: for every key but
the baseline (GC), the 95% interval of its throughput over the baseline's (paired ratios,
stats.py), its half-width relative to the ratio; without a baseline in the set, each key's own
throughput interval relative to its mean. The rounds stop when

- the widest half-width is at most `target` and at least `min_rounds` rounds ran (target reached), or
- at least `min_rounds` rounds ran and another round, at the mean round time so far, would end past
  the set's time cap (cap hit: the interval reached is reported, with `reached` false), or
- `fixed` rounds ran, when a fixed count is asked for (no target, no cap).

A set stopped short of its target says what it would have needed, from what it measured: the widest
key's per-round values (paired ratios, or throughputs) spread with coefficient of variation cv, so the
interval's relative half-width after n rounds is t(0.975, n - 1) * cv / sqrt(n); the least n that
brings it within the target, and n times the mean round's seconds (`rounds_needed`, `seconds_needed`).
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Hashable

from hilore_verl.measure.intervals import mean_ci, t975
from hilore_verl.planner.arms import LONG_TRIALS

LOG_EVERY_S = 10.0  # a progress line per round for the first rounds, then at most one per this many seconds


@dataclass(frozen=True)
class StopRule:
    target: float = 0.02
    """The widest 95% half-width allowed, relative to the ratio (0.02: +-2%)."""
    min_rounds: int = 3
    time_cap_s: float = 900.0
    """Seconds of timed rounds for the methods' set; what it leaves goes to the sweep (`sweep_cap`). On the
    2-core CPU the default methods' rounds spread by 3.7-6.2% (sd); +-2% took 16-37 rounds of ~11 s
    (docs/benchmarks/bench_cpu.md, 2026-12-07 (third))."""
    fixed: int | None = None
    """Exactly this many rounds per set: no target, no cap."""
    warmup: int = 1
    """Untimed rounds before a set's timed ones."""
    settle_max: int = 2 * (2 * LONG_TRIALS + 2) + 2
    """Untimed steps per key at most, after the warm-up, until the key is settled (`run_rounds`): the measured
    trial's longest (two stages of LONG_TRIALS pairs and each arm's warm-up, planner/arms.py) and the first
    plans' two steps."""
    sweep_time_cap_s: float = 300.0
    """Seconds of timed rounds shared by the sweep's budgets, with what the methods' set left (`sweep_cap`)."""

    def __post_init__(self):
        if not self.target >= 0 or self.min_rounds < 1 or not self.time_cap_s > 0 or not self.sweep_time_cap_s > 0 or self.warmup < 0 or self.settle_max < 0 or (
                self.fixed is not None and self.fixed < 1):
            raise ValueError(f"bad stop rule {self}")


@dataclass
class RoundSet:
    label: str
    times: dict[Hashable, list[float]]
    rounds: int = 0
    half_width: float = math.nan
    """The widest relative half-width after the last round (nan before two rounds)."""
    widest: Hashable = None
    reached: bool = False
    """Whether `half_width` is within the target, whatever stopped the rounds."""
    stopped_by: str = ""  # "target", "time cap" or "fixed"
    elapsed_s: float = 0.0
    cap_s: float | None = None
    """The set's time cap (None: a fixed count of rounds)."""
    settle_steps: dict = field(default_factory=dict)
    """Untimed steps a key ran after the warm-up until it settled (keys that needed none: absent)."""
    round_cv: float = math.nan
    """The widest key's per-round coefficient of variation (of its paired ratio, or of its throughput)."""
    rounds_needed: int | None = None
    """Rounds the target would have taken at that spread (None: reached, or a fixed count)."""
    seconds_needed: float | None = None
    """`rounds_needed` at the mean round's seconds so far."""

    def to_dict(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if k != "times"}
        d["widest"] = key_name(self.widest) if self.widest is not None else None
        d["settle_steps"] = {key_name(k): v for k, v in self.settle_steps.items()}
        return d


def rotated(keys: list, round_index: int) -> list:
    """The order of the round: the list rotated by the round's index (each key starts once in turn)."""
    if not keys:
        return []
    k = round_index % len(keys)
    return keys[k:] + keys[:k]


def key_name(key: Hashable) -> str:
    return f"{key[0]}@{key[1]}" if isinstance(key, tuple) else str(key)


def _weighed(times: dict[Hashable, list[float]], baseline: Hashable = "gc") -> dict[Hashable, list[float]]:
    """Per key, the per-round values its interval is of: its paired throughput ratio to the baseline's,
    or (no baseline in the set) its own throughput; the baseline itself has none."""
    out = {}
    for key, values in times.items():
        if baseline in times and key != baseline:
            out[key] = [b / v for b, v in zip(times[baseline], values)]
        elif baseline not in times or len(times) == 1:
            out[key] = [1 / s for s in values]
    return out


def half_widths(times: dict[Hashable, list[float]], baseline: Hashable = "gc") -> dict[Hashable, float]:
    """Per key, its interval's half-width relative to its middle (see the module's docstring)."""
    out = {}
    for key, values in _weighed(times, baseline).items():
        mean, low, high = mean_ci(values)
        out[key] = (high - low) / 2 / mean if len(values) > 1 else math.nan
    return out


def rounds_needed(cv: float, target: float, limit: int = 100_000) -> int | None:
    """The least n with t(0.975, n - 1) * cv / sqrt(n) <= target (None: not within `limit`, or no spread known)."""
    if math.isnan(cv) or target <= 0:
        return None
    n = max(2, math.ceil((1.96 * cv / target) ** 2))  # t(0.975, n - 1) >= 1.96: no fewer than this
    while t975(n - 1) * cv / math.sqrt(n) > target:
        n += 1
    return n if n <= limit else None


def widest(times: dict[Hashable, list[float]], baseline: Hashable = "gc") -> tuple[float, Hashable]:
    widths = half_widths(times, baseline)
    if not widths:
        return math.nan, None
    key = max(widths, key=lambda k: math.inf if math.isnan(widths[k]) else widths[k])
    return widths[key], key


def sweep_cap(rule: StopRule, methods_elapsed_s: float, sweep_elapsed_s: float, sets_left: int) -> float:
    """The next sweep set's cap: the sweep's seconds (its own cap, plus what the methods' set left of
    `time_cap_s` when it stopped at the target) less what its earlier sets took, shared equally by the
    sets still to run. A set that stops early leaves its rest to the later ones; the rounds of the whole
    run stay within `time_cap_s + sweep_time_cap_s`."""
    left = rule.sweep_time_cap_s + max(rule.time_cap_s - methods_elapsed_s, 0.0) - sweep_elapsed_s
    return max(left, 0.0) / sets_left if sets_left > 0 else 0.0


def _stderr(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def run_rounds(label: str, keys: list, step: Callable[[Hashable], float], rule: StopRule, cap_s: float,
               baseline: Hashable = "gc", log: Callable[[str], None] = _stderr,
               clock: Callable[[], float] = time.perf_counter,
               settled: Callable[[Hashable], bool] = lambda key: True) -> RoundSet:
    """Round after round of `step(key)` (seconds of one timed step) over `keys` until `rule` stops them."""
    result = RoundSet(label, {k: [] for k in keys}, cap_s=None if rule.fixed is not None else cap_s)
    for r in range(rule.warmup if keys else 0):
        for key in rotated(list(keys), r):
            step(key)
    for key in keys:
        for _ in range(rule.settle_max):
            if settled(key):
                break
            step(key)
            result.settle_steps[key] = result.settle_steps.get(key, 0) + 1
    start, logged = clock(), 0.0
    while keys:
        for key in rotated(list(keys), result.rounds):
            result.times[key].append(step(key))
        result.rounds += 1
        result.elapsed_s = clock() - start
        result.half_width, result.widest = widest(result.times, baseline)
        result.reached = result.half_width <= rule.target  # False while nan
        width = "-" if math.isnan(result.half_width) else f"+-{100 * result.half_width:.1f}% ({key_name(result.widest)})"
        if result.rounds <= rule.min_rounds or result.elapsed_s - logged >= LOG_EVERY_S:
            logged = result.elapsed_s
            log(f"{label}: round {result.rounds}, widest 95% half-width {width}, {result.elapsed_s:.0f} s"
                + ("" if rule.fixed is not None else f" of {cap_s:.0f} s"))
        if rule.fixed is not None:
            if result.rounds >= rule.fixed:
                result.stopped_by = "fixed"
                break
            continue
        if result.rounds < rule.min_rounds:
            continue
        if result.reached:
            result.stopped_by = "target"
            break
        if result.elapsed_s * (result.rounds + 1) / result.rounds > cap_s:
            result.stopped_by = "time cap"
            break
    _needed(result, baseline, rule)
    if result.stopped_by == "target":
        log(f"{label}: target +-{100 * rule.target:g}% reached after {result.rounds} rounds: {width}")
    elif result.stopped_by == "time cap":
        needed = (f"{result.rounds_needed} rounds, about {result.seconds_needed:.0f} s" if result.rounds_needed
                  else "more rounds than are reasonable")
        log(f"{label}: time cap {cap_s:.0f} s hit after {result.rounds} rounds before the target "
            f"+-{100 * rule.target:g}%; interval reached {width}; its rounds spread by {100 * result.round_cv:.1f}% "
            f"(sd / mean), so the target would take {needed}")
    return result


def _needed(result: RoundSet, baseline: Hashable, rule: StopRule) -> None:
    """The widest key's spread, and what the target would take at it (module docstring)."""
    values = _weighed(result.times, baseline).get(result.widest) if result.widest is not None else None
    if not values or len(values) < 2:
        return
    result.round_cv = statistics.stdev(values) / statistics.fmean(values)
    if rule.fixed is None and not result.reached:
        result.rounds_needed = rounds_needed(result.round_cv, rule.target)
        if result.rounds_needed is not None:
            result.seconds_needed = result.rounds_needed * result.elapsed_s / result.rounds


__all__ = ["RoundSet", "StopRule", "half_widths", "key_name", "rotated", "rounds_needed", "run_rounds", "sweep_cap", "widest"]
