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

    the interval below 1                   the plans are faster: they run
    the interval above 1                   the baseline is faster: it runs
    neither, MAX_TRIALS pairs, mean >= 1   no sign of a gain: the baseline runs (exact, the runtime's hooks off)
    neither, LONG_TRIALS pairs             no measured gain: the baseline runs
    neither, fewer pairs                   another pair

Where the mean says the plans may be faster, the trial goes on past MAX_TRIALS to LONG_TRIALS pairs: on
the 2-core CPU a pair's ratio spreads by ~4-5% (sd), so 8 pairs bound the mean within ~+-3.8% and a 3-4%
gain went unseen in one run and seen in the next (bench_cpu.md); 16 pairs resolve ~+-2.4%. Looking at the
interval after every pair makes a chance "faster" likelier than the 2.5% of one look; such a choice
costs speed only (every arm is an update the controller may make) and is timed again at the recheck.

Compressing plans meet the exact ones first. Where the solver's plans compress (a lossy unit in a
micro-batch of the stage "hands_off" just begun), the trial first runs the stage "exact": the solver's
plans against its best exact plans (keep / recompute only, through the runtime), the same way; its
winner (the exact plans where undecided) then faces the hands-off baseline in the stage "hands_off".
Compression must beat spending the same headroom on kept units, and whichever wins must beat the
plain model (on the 2-core CPU at 1.25x and 1.5x GC's peak the int8 plans beat GC's plan, or tied it,
where keep / recompute plans were faster than both: bench_cpu.md). `label` names what runs: "plan"
(the solver's), "exact" (its exact plans) or "baseline" (hands-off).

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
    arms.label                         # what this mini-batch runs: "plan", "exact" or "baseline"
    arms.informative = True            # a micro-batch of this mini-batch had a choice
    arms.lossy = True                  # a micro-batch's solver plan compressed
"""

from __future__ import annotations

import logging
import math
import statistics
from dataclasses import dataclass, field

from hilore_verl.measure.intervals import mean_ci

logger = logging.getLogger(__name__)

TRIALS = 3  # pairs (one timed mini-batch of each arm) at least before choosing
MAX_TRIALS = 8  # pairs at most where the mean shows no gain: the baseline runs
LONG_TRIALS = 16  # pairs at most where the mean shows a gain the interval does not yet
RECHECK_EVERY = 200  # mini-batches on the chosen arm before timing both again
ARMS = ("plan", "baseline")
ORDER = ("plan", "baseline", "baseline", "plan")  # the arm of the k-th sample: ORDER[k % 4]
STAGES = ("exact", "hands_off")  # the solver's plans against its exact plans, then the winner against hands-off
LABELS = ("plan", "exact", "baseline")  # what runs: the solver's plans, its exact plans, hands-off


@dataclass
class ArmTrial:
    trials: int = TRIALS
    max_trials: int = MAX_TRIALS
    long_trials: int = LONG_TRIALS
    recheck_every: int = RECHECK_EVERY
    arm: str = "plan"  # the arm the current mini-batch runs
    chosen: str | None = None  # the measured winner, until the next recheck
    stage: str = "hands_off"  # STAGES: what the arms run (`label`)
    contender: str = "plan"  # in the stage "hands_off": what the plan arm runs ("plan" or "exact")
    exact_done: bool = False  # the stage "exact" ran in this trial
    informative: bool = False  # the current mini-batch had a micro-batch whose plan differs from its baseline
    lossy: bool = False  # the current mini-batch had a micro-batch whose solver plan compressed
    samples: dict[str, list[float]] = field(default_factory=lambda: {a: [] for a in ARMS})
    warmed: set = field(default_factory=set)  # arms whose first mini-batch of this stage ran (not a sample)
    since_choice: int = 0

    def record(self, relative_seconds: float | None) -> None:
        """The last mini-batch's measured seconds over its size (None: not timed); then this mini-batch's arm."""
        if self.chosen is None and relative_seconds is not None and relative_seconds > 0 and self.informative:
            if self.arm in self.warmed:
                self.samples[self.arm].append(relative_seconds)
            else:  # the arm's first mini-batch of the stage: a warm-up, and the arm runs again
                self.warmed.add(self.arm)
        lossy, self.informative, self.lossy = self.lossy, False, False
        if self.chosen is not None:
            self.since_choice += 1
            if self.since_choice < self.recheck_every:
                return
            self._restart("hands_off", "plan", exact_done=False)
        if self.stage == "hands_off" and self.contender == "plan" and lossy and not self.exact_done:
            self._restart("exact", "plan", exact_done=True)  # compressing plans: against the exact ones first
            return
        verdict = self._verdict()
        if verdict is None:  # the next sample's arm
            self.arm = ORDER[sum(len(s) for s in self.samples.values()) % len(ORDER)]
            return
        mean, low, high = mean_ci(self.pairs())
        ran = {"plan": "solver's plans", "exact": "exact plans (keep / recompute)", "baseline": "hands-off baseline"}
        first, second = ("plan", "exact") if self.stage == "exact" else (self.contender, "baseline")
        winner = first if verdict == "plan" else second
        logger.warning("hilore-verl: measured over %d pairs of mini-batches, the %s take %.3fx the %s's time "
                       "[95%%: %.3f, %.3f]: %s", len(self.pairs()), ran[first], mean, ran[second], low, high,
                       f"now timing the {ran[winner]} against the hands-off baseline" if self.stage == "exact"
                       else f"running the {ran[winner]} for the next {self.recheck_every} mini-batches")
        if self.stage == "exact":
            self._restart("hands_off", winner, exact_done=True)
            return
        self.chosen = self.arm = verdict
        self.since_choice = 0

    def _restart(self, stage: str, contender: str, exact_done: bool) -> None:
        """A new stage: no samples, no arm warmed, the first sample's arm next."""
        self.chosen, self.samples, self.warmed = None, {a: [] for a in ARMS}, set()
        self.stage, self.contender, self.exact_done, self.arm = stage, contender, exact_done, ORDER[0]

    @property
    def label(self) -> str:
        """What the current mini-batch runs (LABELS)."""
        if self.stage == "exact":
            return "plan" if self.arm == "plan" else "exact"
        return self.contender if self.arm == "plan" else "baseline"

    def pairs(self) -> list[float]:
        """Per pair of samples (one of each arm, taken back to back), the plans' time over the baseline's."""
        return [p / b for p, b in zip(self.samples["plan"], self.samples["baseline"])]

    def _verdict(self) -> str | None:
        """The arm the pairs so far choose (the module's docstring), or None: another pair."""
        pairs = self.pairs()
        if len(pairs) < self.trials or len(self.samples["plan"]) != len(self.samples["baseline"]):
            return None  # too few pairs, or one half-way
        mean, low, high = mean_ci(pairs)
        if high < 1:
            return "plan"
        if low > 1 or math.isnan(high) or len(pairs) >= self.long_trials or (len(pairs) >= self.max_trials
                                                                            and mean >= 1):
            return "baseline"
        return None

    def hold(self, label: str) -> None:
        """Run what `label` names (LABELS) as if a trial had chosen it (a process that repeats a row already
        measured elsewhere)."""
        if label not in LABELS:
            raise ValueError(f"arm: got {label!r}; valid: {', '.join(LABELS)}")
        self._restart("hands_off", "plan" if label == "plan" else "exact", exact_done=True)
        self.chosen = self.arm = "baseline" if label == "baseline" else "plan"
        self.since_choice = 0

    def ratio(self) -> float | None:
        """The plan arm's mean time over the baseline arm's, pair by pair, in the current stage (the last
        stage's once a choice holds: none are added then), once a pair was timed."""
        pairs = self.pairs()
        return statistics.fmean(pairs) if pairs else None

    def metrics(self) -> dict[str, float]:
        out = {"hilore/arm/baseline": float(self.label == "baseline"), "hilore/arm/exact": float(self.label == "exact")}
        ratio = self.ratio()
        if ratio is not None:
            out["hilore/arm/plan_over_baseline"] = ratio
        return out


__all__ = ["ArmTrial", "LABELS", "LONG_TRIALS", "MAX_TRIALS", "RECHECK_EVERY", "STAGES", "TRIALS"]
