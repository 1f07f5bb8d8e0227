"""How long each stage of the check may run: estimates that follow what the environment stage measured.

A stage's estimate on a GPU is its measuring work plus the compiles it triggers, priced at what this
machine showed:

    estimate = work_s + compiles x inductor_compile_s + launches x triton_first_launch_s

(`inductor_compile_s`: one cold `torch.compile` of a small function, forward and backward;
`triton_first_launch_s`: the first codec launch, which compiles its kernel; both figures of the
environment stage, read from OUT/stage_environment.json, so that `--only STAGE` uses the last run's).
The whole check has TOTAL_S; each stage, when it starts, gets

    limit = min(left, max(left x estimate / estimates_left, min(2 x estimate, left - (estimates_left - estimate))))

its share of the time left when time is short, up to twice its estimate when there is slack, and never
the time the stages after it are estimated to need. A stage that finishes early leaves its time to the
ones after it. `--device cpu --tiny` uses fixed limits (the CPU rehearsal; no GPU compile to measure).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

TOTAL_S = 420.0  # the whole check on a GPU: 7 minutes, so a second run fits in a 15-minute lease
DEFAULT_COMPILE_S = 20.0  # a cold Inductor compile, before one was measured on this machine
DEFAULT_LAUNCH_S = 1.0  # a Triton kernel's first launch (its compile)


@dataclass(frozen=True)
class StageCost:
    work_s: float
    """Seconds of measuring on a GPU, compiles aside."""
    compiles: int
    """Cold Inductor compiles the stage runs (FlexAttention forward + backward, its block mask, ...)."""
    launches: int
    """Triton kernel variants the stage compiles on their first launch."""
    tiny_s: float
    """The stage's limit with --device cpu --tiny."""


COSTS = {"environment": StageCost(10, 1, 1, 120),
         "codecs": StageCost(30, 0, 40, 180),
         "runtime": StageCost(30, 0, 10, 180),
         "shared_prompt": StageCost(10, 2, 0, 120),
         "model": StageCost(150, 3, 0, 480),
         "profile": StageCost(25, 0, 0, 120)}


def compile_figures(out: str) -> tuple[float, float, str]:
    """(inductor compile s, Triton first launch s, where they come from) for this machine."""
    path = os.path.join(out, "stage_environment.json")
    try:
        with open(path) as f:
            figures = json.load(f)["figures"]
        compile_s, launch_s = float(figures["inductor_compile_s"]), float(figures["triton_first_launch_s"])
    except (OSError, ValueError, KeyError, TypeError):
        return DEFAULT_COMPILE_S, DEFAULT_LAUNCH_S, "defaults (no environment stage measured here)"
    return compile_s, launch_s, "measured by the environment stage"


def estimate(name: str, compile_s: float, launch_s: float, tiny: bool) -> float:
    cost = COSTS[name]
    if tiny:
        return cost.tiny_s
    return cost.work_s + cost.compiles * compile_s + cost.launches * launch_s


def limit(name: str, stages_left: list[str], left: float, out: str, tiny: bool) -> float:
    """Seconds stage `name` (the first of `stages_left`) may run with `left` seconds of the check left."""
    compile_s, launch_s, _ = compile_figures(out)
    estimates = {s: estimate(s, compile_s, launch_s, tiny) for s in stages_left}
    own, rest = estimates[name], sum(estimates.values())
    if tiny:
        return min(left, own)
    return max(0.0, min(left, max(left * own / rest, min(2 * own, left - (rest - own)))))
