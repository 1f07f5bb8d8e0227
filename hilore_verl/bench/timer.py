"""The bench's timer: one timed step of a key (a method, or a planner at a budget, or one of HiLoRe's
runner-up plans), with what the planned keys' controllers predicted and chose at each step.

    timer = Timer(built, variants, batch)     # built: name -> Method; variants: (planner, budget, ...) -> Controller
    seconds = timer.step(key)                 # one step of `key` (bench/rounds.py times them in paired rounds)
    timer.settled(key), timer.timed(key, times), timer.trial(key)
"""

from __future__ import annotations

import statistics

from hilore_verl.bench import methods as M
from hilore_verl.planner import Controller
from hilore_verl.runtime import UnitPlan


def spelled(plan: dict[str, UnitPlan]) -> dict[str, str]:
    """A plan as the report writes it: each unit's plan spelled (`str(UnitPlan)`)."""
    return {unit: str(p) for unit, p in plan.items()}


class Timer:
    """One timed step of a key: a method, or (planner, budget, ...) run by its own session on the planner's
    model with that key's controller, so each key's timing feeds its own controller's measured trial
    (planner/arms.py) and its own measured-peak feedback. Each planned step records the session's own host
    seconds and the cost model's step time for the plan it ran."""

    def __init__(self, built: dict[str, M.Method], variants: dict[tuple, Controller], batch):
        self.built, self.variants, self.batch = built, variants, batch  # `add` adds to `variants`
        self.sessions = {key: built[key[0]].session_with(c) for key, c in variants.items()}
        self.trained = {n: m.trained_tokens(batch) for n, m in built.items() if m.controller is not None}
        self.computed = {n: m.layer_tokens(batch) for n, m in built.items() if m.controller is not None}
        self.session_s: dict = {k: [] for k in [*built, *variants]}
        self.predicted: dict = {k: [] for k in [*built, *variants]}
        self.modelled: dict = {k: [] for k in [*built, *variants]}  # the same without the measured scale
        self.plans: dict = {k: [] for k in [*built, *variants]}  # each step's last plan, spelled
        self.informative: dict = {k: [] for k in [*built, *variants]}  # each step: had a plan but the baseline

    def controller(self, key) -> Controller | None:
        return self.variants[key] if isinstance(key, tuple) else self.built[key].controller

    def settled(self, key) -> bool:
        """Whether later identical steps of `key` run its last step's plans: no planner, its measured trial
        decided (planner/arms.py), or none runs (its last two steps had no plan other than the baseline: the
        first plans can differ from later ones, e.g. before the risk model is calibrated) and none began (a
        trial under way whose plans tightened for a while, the measured-peak feedback's, goes on later)."""
        c = self.controller(key)
        if c is None or c.arms.chosen is not None:
            return True
        begun = c.arms.stage == "exact" or c.arms.warmed or any(c.arms.samples.values())
        return not begun and len(self.informative[key]) >= 2 and not any(self.informative[key][-2:])

    def timed(self, key, times: list[float]) -> dict:
        """A planned key's figures over its timed rounds (the last len(times) steps it ran): the cost model's
        mean step time (with the measured scale, and the probes' model alone), the session's share of the
        step, how many different plans ran."""
        n = len(times)
        return {"predicted_step_s": statistics.fmean(self.predicted[key][-n:]),
                "modelled_step_s": statistics.fmean(self.modelled[key][-n:]),
                "controller_share": sum(self.session_s[key][-n:]) / sum(times),
                "distinct_plans": len(set(self.plans[key][-n:]))}

    def trial(self, key) -> dict:
        """The measured trial's outcome for a row: what it chose (arms.LABELS; "undecided": still timing both when the
        settle steps ran out, so the timed rounds mixed them; "no trial": no plan other than the baseline)."""
        c = self.controller(key)
        if c is None:
            return {}
        arm = c.arms.label if c.arms.chosen else "undecided" if c.arms.informative else "no trial"
        return {"arm": arm,
                "plan_over_baseline": c.arms.ratio()}

    def add(self, key: tuple, controller: Controller) -> None:
        """Another (planner, budget, ...) key, stepped with `controller`."""
        self.variants[key] = controller
        self.sessions[key] = self.built[key[0]].session_with(controller)
        self.session_s[key], self.predicted[key], self.modelled[key], self.plans[key] = [], [], [], []
        self.informative[key] = []

    def step(self, key) -> float:
        name = key[0] if isinstance(key, tuple) else key
        method = self.built[name]
        if not isinstance(key, tuple):
            return self._record(key, method, method.step(self.batch))
        own, method.session = method.session, self.sessions[key]
        try:
            return self._record(key, method, method.step(self.batch))
        finally:
            method.session = own

    def _record(self, key, method: M.Method, seconds: float) -> float:
        c = method.controller
        if c is not None:
            self.session_s[key].append(method.session_s[-1])
            plan, tokens = c.history[-1].plan, self.computed[method.name]
            self.predicted[key].append(c.predicted_step_seconds(plan, tokens))
            self.modelled[key].append(c.predicted_step_seconds(plan, tokens, measured=False))
            self.plans[key].append(tuple(sorted(spelled(c.history[-1].plan).items())))
            self.informative[key].append(c.arms.informative)
        return seconds


__all__ = ["Timer", "spelled"]
