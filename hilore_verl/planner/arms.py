"""Measured, not only modelled: the solver's plans against the exact baseline the runtime runs hands-off.

The controller prefers a hands-off baseline (the model's own checkpointing, or every unit kept) when
the cost model says the solver's plan gains less than the runtime's overhead. That overhead is
measured once, on the probe (`CostTable.runtime_overhead_s`), and on small or host-bound
micro-batches it is noisy; the runtime's per-call costs (codec launches, a compile for a new shape)
are not in it at all. So where a baseline fits the budget and the solver's plan differs from it, the
controller also measures the two in training: timed mini-batches alternate between the solver's plans
("plan" arm) and the baseline ("baseline" arm) in the order plan, baseline, baseline, plan, ... (so
that neither arm always gets a step's first or second mini-batch). The first mini-batch each arm runs in
a trial is not a sample: it allocates what the arm's plans hold for the first time (on the 2-core CPU a
plan's first mini-batch after profiling took 1.25x its later ones, the baseline's 1.09x). Consecutive
samples pair up, one of each arm, and each pair gives r = plan's time / baseline's. After at least TRIALS pairs, the 95%
interval of the mean r (Student's t, intervals.py) decides:

    the interval below 1        the plans are faster: they run
    the interval above 1        the baseline is faster: it runs
    neither, MAX_TRIALS pairs   no measured gain: the baseline runs (exact, and the runtime's hooks off)
    neither, fewer pairs        another pair

A choice of the plans needs evidence; a median of three samples each did not give it (on the 2-core
CPU, steps spread by ~4%: a trial once read the plans 4% faster where 29 paired bench rounds measured
them 5% slower, docs/benchmarks/bench_cpu.md). After RECHECK_EVERY mini-batches on the choice both
are timed again (plans follow exposures and token counts). A mini-batch's time is its measured
seconds over the cost model's seconds for GC's plan on the same micro-batches (the controller's): a
size that counts the attention's quadratic part and the fixed per-call parts, so mini-batches of
different sizes compare (per trained token, a small mini-batch's fixed part made it look slow). While
the baseline is the choice, the controller plans it without running the solver (planner/search.py).
Both arms are updates the controller may make: the baseline is exact, the plans within the risk
budget. The session times each mini-batch (device clock, the slowest rank's, so every rank takes the
same arm); a mini-batch whose plans all equal their baselines, the first (profiling), or one retried
after a fault is not a sample.

    arms = ArmTrial()
    arms.record(relative_seconds)      # the last mini-batch's time over its size, or None; picks this one's arm
    arms.arm                           # "plan" or "baseline"
    arms.informative = True            # a micro-batch of this mini-batch had a choice
"""

from __future__ import annotations

import logging
import math
import statistics
from dataclasses import dataclass, field

from hilore_verl.intervals import mean_ci

logger = logging.getLogger(__name__)

TRIALS = 3  # pairs (one timed mini-batch of each arm) at least before choosing
MAX_TRIALS = 8  # pairs at most: still no measured gain, the baseline runs
RECHECK_EVERY = 200  # mini-batches on the chosen arm before timing both again
ARMS = ("plan", "baseline")
ORDER = ("plan", "baseline", "baseline", "plan")  # the arm of the k-th sample: ORDER[k % 4]


@dataclass
class ArmTrial:
    trials: int = TRIALS
    max_trials: int = MAX_TRIALS
    recheck_every: int = RECHECK_EVERY
    arm: str = "plan"  # the arm the current mini-batch runs
    chosen: str | None = None  # the measured winner, until the next recheck
    informative: bool = False  # the current mini-batch had a micro-batch whose plan differs from its baseline
    samples: dict[str, list[float]] = field(default_factory=lambda: {a: [] for a in ARMS})
    warmed: set = field(default_factory=set)  # arms whose first mini-batch of this trial ran (not a sample)
    since_choice: int = 0

    def record(self, relative_seconds: float | None) -> None:
        """The last mini-batch's measured seconds over its size (None: not timed); then this mini-batch's arm."""
        if self.chosen is None and relative_seconds is not None and relative_seconds > 0 and self.informative:
            if self.arm in self.warmed:
                self.samples[self.arm].append(relative_seconds)
            else:  # the arm's first mini-batch of the trial: a warm-up, and the arm runs again
                self.warmed.add(self.arm)
        self.informative = False
        if self.chosen is not None:
            self.since_choice += 1
            if self.since_choice < self.recheck_every:
                return
            self.chosen, self.samples, self.warmed = None, {a: [] for a in ARMS}, set()
        verdict = self._verdict()
        if verdict is None:  # the next sample's arm
            self.arm = ORDER[sum(len(s) for s in self.samples.values()) % len(ORDER)]
            return
        self.chosen = self.arm = verdict
        self.since_choice = 0
        mean, low, high = mean_ci(self.pairs())
        logger.warning("hilore-verl: measured over %d pairs of mini-batches, the solver's plans take %.3fx the exact "
                       "baseline's time [95%%: %.3f, %.3f]: running the %s for the next %d mini-batches",
                       len(self.pairs()), mean, low, high,
                       "solver's plans" if verdict == "plan" else "baseline (hands-off)", self.recheck_every)

    def pairs(self) -> list[float]:
        """Per pair of samples (one of each arm, taken back to back), the plans' time over the baseline's."""
        return [p / b for p, b in zip(self.samples["plan"], self.samples["baseline"])]

    def _verdict(self) -> str | None:
        """The arm the pairs so far choose (the module's docstring), or None: another pair."""
        pairs = self.pairs()
        if len(pairs) < self.trials or len(self.samples["plan"]) != len(self.samples["baseline"]):
            return None  # too few pairs, or one half-way
        _, low, high = mean_ci(pairs)
        if high < 1:
            return "plan"
        if low > 1 or len(pairs) >= self.max_trials or math.isnan(high):
            return "baseline"
        return None

    def hold(self, arm: str) -> None:
        """Run `arm` as if a trial had chosen it (a process that repeats a row already measured elsewhere)."""
        if arm not in ARMS:
            raise ValueError(f"arm: got {arm!r}; valid: {', '.join(ARMS)}")
        self.chosen = self.arm = arm
        self.since_choice = 0

    def ratio(self) -> float | None:
        """The plans' mean time over the baseline's, pair by pair, once a pair was timed (the trial's samples:
        none are added while a choice holds)."""
        pairs = self.pairs()
        return statistics.fmean(pairs) if pairs else None

    def metrics(self) -> dict[str, float]:
        out = {"hilore/arm/baseline": float(self.arm == "baseline")}
        ratio = self.ratio()
        if ratio is not None:
            out["hilore/arm/plan_over_baseline"] = ratio
        return out


__all__ = ["ArmTrial", "MAX_TRIALS", "RECHECK_EVERY", "TRIALS"]
