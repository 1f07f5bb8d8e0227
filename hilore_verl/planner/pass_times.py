"""Two pass times the profile measures whole (profiling.py), not per unit: what the runtime's hooks add
to a pass, and the pass with every unit kept.

    overhead, hands_off = runtime_overhead(runtime, run, clock)   # HF checkpointing's plan, hooked vs not
    table.keep_pass_s = keep_pass_seconds(table, tokens, measured, under)
"""

from __future__ import annotations

import math
from typing import Callable

from hilore_verl.planner.costs import CostTable
from hilore_verl.runtime import KEEP, Runtime, UnitPlan
from hilore_verl.measure.timing import DeviceClock


def keep_pass_seconds(table: CostTable, tokens: int, measured: float, under: dict[str, UnitPlan]) -> float:
    """The pass with every unit kept: `measured`, the seconds of a pass under the GC plan `under` (hands-off
    where HF checkpointing ran it), less the table's price of that plan's recompute."""
    return max(measured - table.seconds({u.name: under.get(u.name, KEEP) for u in table.units}, tokens), 0.0)


def runtime_overhead(runtime: Runtime, run: Callable[[], None], clock: DeviceClock) -> tuple[float, float]:
    """(seconds a pass of HF checkpointing's plan takes through the runtime's hooks, as training runs a
    plan (no byte accounting), over the same plan run hands-off, the hands-off pass's seconds), the fastest
    of two each, interleaved; (0, 0) when the model had no checkpointing to compare."""
    plan = runtime.checkpoint_plan()
    if plan is None:
        return 0.0, 0.0
    best = {True: math.inf, False: math.inf}
    for _ in range(2):
        for hooked in (True, False):
            runtime.set_plan(plan, measure=False, hands_off=not hooked)
            start = clock.mark()
            run()
            best[hooked] = min(best[hooked], clock.seconds(start, clock.mark()))
    return max(best[True] - best[False], 0.0), best[False]


__all__ = ["keep_pass_seconds", "runtime_overhead"]
