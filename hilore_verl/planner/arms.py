"""Measured, not only modelled: the solver's plans against the exact plans it could run instead.

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

Two stages. The first ("hands_off") compares the solver's plans with the hands-off baseline. Where they
win and some of them compress, a second ("exact") compares them, the same way, with the solver's best
exact plans (keep / recompute only, through the runtime) as the baseline arm: compression must also beat
spending the same headroom on keeping units (on the 2-core CPU at 1.25x and 1.5x GC's peak the int8
plans won against GC's plan and lost to keep / recompute: 0.988x and 1.059x GC's throughput against
1.039x and 1.099x, docs/benchmarks/bench_cpu.md). `label` names what runs: "plan" (the solver's),
"baseline" (hands-off) or "exact" (the exact plans, the second stage's baseline).

A choice of the plans needs evidence; a median of three samples each did not give it (on the 2-core
CPU, steps spread by ~4%: a trial once read the plans 4% faster where 29 paired bench rounds measured
them 5% slower, docs/benchmarks/bench_cpu.md). After RECHECK_EVERY mini-batches on the choice both
are timed again, from the first stage (plans follow exposures and token counts). A mini-batch's time is its measured
seconds over the cost model's seconds for GC's plan on the same micro-batches (the controller's): a
size that counts the attention's quadratic part and the fixed per-call parts, so mini-batches of
different sizes compare (per trained token, a small mini-batch's fixed part made it look slow). While
the baseline is the choice, the controller plans it without running the solver (planner/search.py).
Every arm is an update the controller may make: the baselines are exact, the plans within the risk
budget. The session times each mini-batch (device clock, the slowest rank's, so every rank takes the
same arm); a mini-batch whose plans all equal their baselines, the first (profiling), or one retried
after a fault is not a sample.

    arms = ArmTrial()
    arms.record(relative_seconds)      # the last mini-batch's time over its size, or None; picks this one's arm
    arms.arm, arms.stage               # "plan" or "baseline"; "hands_off" or "exact" (what "baseline" is)
    arms.informative = True            # a micro-batch of this mini-batch had a choice
    arms.lossy = True                  # ... and the plan it ran compressed
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
STAGES = ("hands_off", "exact")  # the baseline arm of the first stage and of the second
LABELS = ("plan", "baseline", "exact")  # what runs: the solver's plans, hands-off, the exact plans


@dataclass
class ArmTrial:
    trials: int = TRIALS
    max_trials: int = MAX_TRIALS
    recheck_every: int = RECHECK_EVERY
    arm: str = "plan"  # the arm the current mini-batch runs
    chosen: str | None = None  # the measured winner, until the next recheck
    stage: str = "hands_off"  # what the baseline arm runs (STAGES)
    informative: bool = False  # the current mini-batch had a micro-batch whose plan differs from its baseline
    lossy: bool = False  # a plan-arm mini-batch of this stage ran a compressing plan with a choice
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
            self._restart("hands_off")
        verdict = self._verdict()
        if verdict is None:  # the next sample's arm
            self.arm = ORDER[sum(len(s) for s in self.samples.values()) % len(ORDER)]
            return
        mean, low, high = mean_ci(self.pairs())
        second = verdict == "plan" and self.stage == "hands_off" and self.lossy
        what = ("solver's plans" if verdict == "plan" else
                "baseline (hands-off)" if self.stage == "hands_off" else "exact plans (keep / recompute)")
        logger.warning("hilore-verl: measured over %d pairs of mini-batches, the solver's plans take %.3fx the %s's "
                       "time [95%%: %.3f, %.3f]: %s", len(self.pairs()), mean,
                       "hands-off baseline" if self.stage == "hands_off" else "exact plans", low, high,
                       "now timing them against the exact plans (they compress)" if second else
                       f"running the {what} for the next {self.recheck_every} mini-batches")
        if second:
            self._restart("exact")
            return
        self.chosen = self.arm = verdict
        self.since_choice = 0

    def _restart(self, stage: str) -> None:
        """A new trial stage: no samples, no arm warmed, the first sample's arm next."""
        self.chosen, self.samples, self.warmed = None, {a: [] for a in ARMS}, set()
        self.stage, self.lossy, self.arm = stage, False, ORDER[0]

    @property
    def label(self) -> str:
        """What the current mini-batch runs (LABELS): the solver's plans, hands-off, or the exact plans."""
        return "plan" if self.arm == "plan" else "baseline" if self.stage == "hands_off" else "exact"

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

    def hold(self, label: str) -> None:
        """Run what `label` names (LABELS) as if a trial had chosen it (a process that repeats a row already
        measured elsewhere)."""
        if label not in LABELS:
            raise ValueError(f"arm: got {label!r}; valid: {', '.join(LABELS)}")
        self.stage = "exact" if label == "exact" else "hands_off"
        self.chosen = self.arm = "plan" if label == "plan" else "baseline"
        self.since_choice = 0

    def ratio(self) -> float | None:
        """The plans' mean time over the baseline's, pair by pair, once a pair was timed (the trial's samples:
        none are added while a choice holds)."""
        pairs = self.pairs()
        return statistics.fmean(pairs) if pairs else None

    def metrics(self) -> dict[str, float]:
        out = {"hilore/arm/baseline": float(self.label == "baseline"), "hilore/arm/exact": float(self.label == "exact")}
        ratio = self.ratio()
        if ratio is not None:
            out["hilore/arm/plan_over_baseline"] = ratio
        return out


__all__ = ["ArmTrial", "LABELS", "MAX_TRIALS", "RECHECK_EVERY", "STAGES", "TRIALS"]
