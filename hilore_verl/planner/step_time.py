"""The cost model's step time against the clock: measured / modelled seconds of the timed mini-batches.

The cost table prices a forward + backward from probes of a few hundred tokens (profiling.py), grown
to each micro-batch as its units' forward times grow (costs.py: `pass_seconds`). That growth is a
model: on the CPU bench, 8.8x from probe to micro-batch, it predicted 0.60-0.80 of the measured step,
the same error for every plan of one profile (docs/benchmarks/bench_cpu.md). So the growth is also
measured where it runs: each timed mini-batch (the session's device clock, the slowest rank's; not the
first, which profiles, nor a retried one) gives r = its seconds / the modelled seconds of the plans
its micro-batches ran, and the controller's predicted step time is the model's times the median r of
the last WINDOW. The median follows a changed workload within WINDOW / 2 mini-batches and ignores a
single slow one. The measured time includes what the model leaves out (the optimizer step, the loss
outside the units), so the scale counts them as a share of the step.

Only `Controller.predicted_step_seconds` reads the scale (reports, the runner-up ranking, which a
common factor does not reorder); the solver compares plans by the model's own relative prices.

    scale = StepTimeScale()
    scale.planned(seconds)    # each micro-batch's modelled seconds, as planned
    scale.measured(seconds)   # the last mini-batch's measured seconds, or None (not timed)
    scale.value               # measured / modelled, 1.0 before any timed mini-batch
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

WINDOW = 5  # timed mini-batches whose median ratio is the scale


@dataclass
class StepTimeScale:
    window: int = WINDOW
    value: float = 1.0
    ratios: list[float] = field(default_factory=list)  # the last `window` measured / modelled
    modelled_s: float = 0.0  # the current mini-batch's micro-batches, as planned

    def planned(self, seconds: float) -> None:
        """One micro-batch's modelled seconds under the plan it runs."""
        self.modelled_s += seconds

    def measured(self, seconds: float | None) -> None:
        """The last mini-batch's measured seconds (None: not timed); then a new mini-batch starts."""
        if seconds is not None and seconds > 0 and self.modelled_s > 0:
            self.ratios = (self.ratios + [seconds / self.modelled_s])[-self.window:]
            self.value = statistics.median(self.ratios)
        self.modelled_s = 0.0


__all__ = ["StepTimeScale", "WINDOW"]
