"""Measured, not only modelled: the solver's plans against the exact baseline the runtime runs hands-off.

The controller prefers a hands-off baseline (the model's own checkpointing, or every unit kept) when
the cost model says the solver's plan gains less than the runtime's overhead. That overhead is
measured once, on the probe (`CostTable.runtime_overhead_s`), and on small or host-bound
micro-batches it is noisy; the runtime's per-call costs (codec launches, a compile for a new shape)
are not in it at all. So where a baseline fits the budget and the solver's plan differs from it, the
controller also measures the two in training: timed mini-batches alternate between the solver's plans
("plan" arm) and the baseline ("baseline" arm) in the order plan, baseline, baseline, plan, ... (so
that neither arm always gets a step's first or second mini-batch) until each has TRIALS, then the arm
with the lower median time runs, and after RECHECK_EVERY mini-batches both are timed again (plans
follow exposures and token counts). A mini-batch's time is its measured seconds over the cost
model's seconds for GC's plan on the same micro-batches (the controller's): a size that counts the
attention's quadratic part and the fixed per-call parts, so mini-batches of different sizes compare
(per trained token, a small mini-batch's fixed part made it look slow). While the baseline is the choice, the controller
plans it without running the solver (planner/search.py). Both arms are updates the controller may make: the
baseline is exact, the plans within the risk budget. The session times each mini-batch (device
clock, the slowest rank's, so every rank takes the same arm); a mini-batch whose plans all equal
their baselines, the first (profiling), or one retried after a fault is not a sample.

    arms = ArmTrial()
    arms.record(relative_seconds)      # the last mini-batch's time over its size, or None; picks this one's arm
    arms.arm                           # "plan" or "baseline"
    arms.informative = True            # a micro-batch of this mini-batch had a choice
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

TRIALS = 3  # timed mini-batches per arm before choosing
RECHECK_EVERY = 200  # mini-batches on the chosen arm before timing both again
ARMS = ("plan", "baseline")
ORDER = ("plan", "baseline", "baseline", "plan")  # the arm of the k-th sample: ORDER[k % 4]


@dataclass
class ArmTrial:
    trials: int = TRIALS
    recheck_every: int = RECHECK_EVERY
    arm: str = "plan"  # the arm the current mini-batch runs
    chosen: str | None = None  # the measured winner, until the next recheck
    informative: bool = False  # the current mini-batch had a micro-batch whose plan differs from its baseline
    samples: dict[str, list[float]] = field(default_factory=lambda: {a: [] for a in ARMS})
    since_choice: int = 0

    def record(self, relative_seconds: float | None) -> None:
        """The last mini-batch's measured seconds over its size (None: not timed); then this mini-batch's arm."""
        if self.chosen is None and relative_seconds is not None and relative_seconds > 0 and self.informative:
            self.samples[self.arm].append(relative_seconds)
        self.informative = False
        if self.chosen is not None:
            self.since_choice += 1
            if self.since_choice < self.recheck_every:
                return
            self.chosen, self.samples = None, {a: [] for a in ARMS}
        taken = sum(len(s) for s in self.samples.values())
        if taken < 2 * self.trials:
            self.arm = ORDER[taken % len(ORDER)]
            if len(self.samples[self.arm]) >= self.trials:  # an odd count: the other arm's turn
                self.arm = next(a for a in ARMS if a != self.arm)
            return
        medians = {a: statistics.median(self.samples[a]) for a in ARMS}
        self.chosen = self.arm = min(ARMS, key=lambda a: medians[a])  # ties: the solver's plans
        self.since_choice = 0
        logger.warning("hilore-verl: measured over %d mini-batches each, the solver's plans take %.3g and the exact "
                       "baseline %.3g of the modelled time of GC's plan: running the %s for the next %d mini-batches",
                       self.trials, medians["plan"], medians["baseline"],
                       "solver's plans" if self.chosen == "plan" else "baseline (hands-off)", self.recheck_every)

    def hold(self, arm: str) -> None:
        """Run `arm` as if a trial had chosen it (a process that repeats a row already measured elsewhere)."""
        if arm not in ARMS:
            raise ValueError(f"arm: got {arm!r}; valid: {', '.join(ARMS)}")
        self.chosen = self.arm = arm
        self.since_choice = 0

    def ratio(self) -> float | None:
        """The plans' median relative time over the baseline's, once both were timed (the trial's samples:
        none are added while a choice holds)."""
        if not all(self.samples[a] for a in ARMS):
            return None
        return statistics.median(self.samples["plan"]) / statistics.median(self.samples["baseline"])

    def metrics(self) -> dict[str, float]:
        out = {"hilore/arm/baseline": float(self.arm == "baseline")}
        ratio = self.ratio()
        if ratio is not None:
            out["hilore/arm/plan_over_baseline"] = ratio
        return out


__all__ = ["ArmTrial", "RECHECK_EVERY", "TRIALS"]
