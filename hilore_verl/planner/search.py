"""Plan search: how the controller finds one micro-batch's plan under its memory model. The solver
(planner/solver.py) prices units one by one, so it runs again with each layer's region bytes as a
surcharge on recomputing that layer's units while the memory model says its plan does not fit; the
exact plans that bound the search (GC's, every unit recomputed) compete where they fit, and under a
gc_ratio budget GC's hands-off plan always (`Controller.gc_always_fits`); local search
(planner/refine.py) improves each plan that fits, and the fastest wins. Then the choice of arm: the
solver's plan, or the cheapest hands-off exact plan where the runtime's measured overhead (or the
measured trial, planner/arms.py) says it is no slower, and in the trial's second stage the solver's
best exact plan where it measures faster than the compressing one. `Controller` (planner/controller.py) holds one
`PlanSearch` and hands it itself: the search plans with its memory model, cost table, risk model and arms,
and changes none of them.
"""

from __future__ import annotations

import dataclasses

from hilore_verl.planner.costs import layer_of
from hilore_verl.planner.refine import refine
from hilore_verl.planner.solver import Infeasible, solve
from hilore_verl.runtime import RECOMPUTE, UnitPlan

MAX_RESOLVES = 8  # solves of one micro-batch's plan, each within the last one's overshoot less


class PlanSearch:
    """The plan search of a `Controller` `c`: it reads the controller's `costs`, `risk`, `runtime`, `arms`,
    `measure_baseline`, `memory_factor` and memory model (`predicted_peak`, `limit`, `activation_budget`,
    `gc_plan`, `gc_always_fits`, `hands_off_plans`, `all_units`, `as_run`)."""

    def __init__(self, controller):
        self.c = controller

    def plan_for(self, tokens: int, exposure_l2: float = 0.0, allowance: float = 0.0,
                 exclude: tuple[str, UnitPlan] | None = None, row: int | None = None) -> dict[str, UnitPlan]:
        """The plan for one micro-batch of `tokens` tokens (`row`: its ordinary packed row's, controller.py's
        docstring), without handing it to a runtime (what-if planning; allowance 0 or no risk model:
        keep / recompute only). `exclude`: (unit, option) the plan may not use (the best plan without
        it: the runner-up, planner/ranking.py)."""
        return self._solve(exposure_l2, tokens, allowance, exclude, row)

    def choose(self, l2: float, tokens: int, allowance: float, row: int | None = None) -> tuple[dict[str, UnitPlan], bool]:
        """(plan, whether the arm chose it): what the measured trial's arm runs (planner/arms.py: the
        solver's plan, its best exact plan, or the cheapest exact plan the runtime runs hands-off, every
        unit kept or HF checkpointing as the model had it, that fits). Without a trial, or outside it, the
        solver's plan, or that hands-off plan where the solver's gains less over it than the runtime's
        measured overhead per micro-batch (`CostTable.runtime_overhead_s`; 0, none measured or within the
        probe's noise, leaves the choice to the trial)."""
        arms = self.c.arms
        trial = self.c.runtime is not None and self.c.measure_baseline
        if trial and arms.chosen == "baseline" and arms.stage == "hands_off":
            # measured faster until the next recheck (planner/arms.py): no solve needed, where one fits
            chosen = self._fitting_baseline(tokens, row)
            if chosen is not None:
                return chosen, True
        if trial and arms.label == "exact" and arms.stage == "hands_off" and arms.chosen is not None:
            exact = self._exact(l2, tokens, row)  # measured fastest: no compressing solve needed
            if exact is not None:
                return self._hands_off_or(exact, tokens, row)
        plan = self._solve(l2, tokens, allowance, row=row)
        if self.c.runtime is None:  # what-if planning: nothing runs
            return plan, False
        lossy = not all(p.exact for p in plan.values())
        arms.lossy |= lossy
        if trial and (arms.stage == "exact" or arms.contender == "exact"):
            exact = self._exact(l2, tokens, row) if lossy else plan
            if exact is None:  # no exact plan fits this budget: nothing to compare
                return plan, False
            if arms.stage == "exact":  # the solver's plan against its exact plan
                return (exact if arms.arm == "baseline" else plan), lossy
            plan = exact  # the exact plans won the stage "exact": they face the hands-off baseline
        return self._hands_off_or(plan, tokens, row)

    def _exact(self, l2: float, tokens: int, row: int | None) -> dict[str, UnitPlan] | None:
        """The solver's best exact plan (keep / recompute only), or None where none fits."""
        try:
            return self._solve(l2, tokens, 0.0, row=row, exact=True)
        except Infeasible:
            return None

    def _hands_off_or(self, plan: dict[str, UnitPlan], tokens: int,
                      row: int | None) -> tuple[dict[str, UnitPlan], bool]:
        """`plan` or the fitting hands-off baseline: by the model (the runtime's overhead) or by the arm."""
        if plan in self.c.hands_off_plans():
            return plan, False
        baseline = self._fitting_baseline(tokens, row)
        if baseline is None:
            return plan, False
        overhead = self.c.costs.runtime_overhead_s  # 0: not measured (no hands-off plan on the probe), or noise
        if overhead > 0 and self.c.costs.seconds(baseline, tokens) <= self.c.costs.seconds(plan, tokens) + overhead:
            return baseline, False  # the model already says: the baseline
        if not self.c.measure_baseline:
            return plan, False
        return (baseline if self.c.arms.arm == "baseline" else plan), True

    def _fitting_baseline(self, tokens: int, row: int | None) -> dict[str, UnitPlan] | None:
        """The fastest hands-off plan that fits (GC's always under a gc_ratio budget), or None."""
        limit, gc = self.c.limit(tokens if row is None else row), self.c.gc_always_fits()
        fits = [b for b in self.c.hands_off_plans() if b == gc or self.c.predicted_peak(b, tokens) <= limit]
        return min(fits, key=lambda b: self.c.costs.seconds(b, tokens)) if fits else None

    def _solve(self, l2: float, tokens: int, allowance: float, exclude: tuple[str, UnitPlan] | None = None,
               row: int | None = None, exact: bool = False) -> dict[str, UnitPlan]:
        """The fastest plan that fits (the module's docstring); `exact`: keep / recompute only (a zero
        exposure makes compression free of risk, so an allowance of 0 alone does not rule it out)."""
        risk = None
        if self.c.risk is not None and self.c.risk.calibrated:  # priced with the codec as it will run
            risk = lambda unit, plan: self.c.risk.unit_risk(unit, self.c.as_run(plan), l2)  # noqa: E731
        costs = self.c.costs
        options = [[dataclasses.replace(o, memory=o.memory + costs.transient_charge(u, o.plan, tokens))
                    for o in costs.options(u, tokens, risk) if (u.name, o.plan) != exclude and (o.plan.exact or not exact)]
                   for u in costs.units]
        if risk is None:  # no risk model, or nothing calibrated yet: lossy modes are not allowed
            allowance = 0.0
        budget = self.c.activation_budget(tokens, row)
        limit = self.c.limit(tokens if row is None else row)
        # Units are priced one by one (a recomputed unit at what it holds itself); what a layer holds more
        # as one region (its inputs, the outputs it replays) only the memory model knows. So the solver
        # runs again while the model says its plan does not fit, each layer's region bytes of the last
        # plan spread over the layer's units as a surcharge on recomputing them (raised, never lowered:
        # the surcharges only grow, and the plans fit sooner or later); the exact plans that bound the
        # search (GC's, every unit recomputed) compete where they fit.
        fitting, surcharge, failure = [], {}, None
        for _ in range(MAX_RESOLVES):
            priced = [[dataclasses.replace(o, memory=o.memory + surcharge[u.name])
                       if o.plan == RECOMPUTE and u.name in surcharge else o for o in opts]
                      for u, opts in zip(self.c.costs.units, options)]
            try:
                solution = solve(priced, budget, allowance)
            except Infeasible as err:  # priced one by one, a whole recomputed layer can look too dear
                failure = err
                break
            plan = {u.name: options[i][k].plan for i, (u, k) in enumerate(zip(self.c.costs.units, solution.choices))}
            fits = self.c.predicted_peak(plan, tokens) <= limit
            if fits:
                if plan in fitting:
                    break
                fitting.append(plan)
            _, regions = self.c.costs.held_by_layer(plan, tokens)
            for layer, extra in regions.items():
                units = [u.name for u in self.c.costs.units if layer_of(u.name) == layer]
                recomputed = sum(plan[n] == RECOMPUTE for n in units)
                for n in units:  # a plan that fits prices its layers as they are; one that does not, dearer
                    share = extra / max(recomputed, 1)
                    surcharge[n] = share if fits else max(surcharge.get(n, 0.0), share)
        bounds = [self.c.gc_plan(), self.c.all_units(RECOMPUTE)]
        fitting += [p for p in bounds if self._allowed(p, exclude) and self.c.predicted_peak(p, tokens) <= limit]
        gc = self.c.gc_always_fits()
        if gc is not None and gc not in fitting and self._allowed(gc, exclude):
            fitting.append(gc)  # within a gc_ratio budget by definition (Controller.gc_always_fits), unrefined
        if not fitting:
            if exclude is not None or self.c.memory_factor >= 1.0:
                raise failure or Infeasible("no plan fits the memory budget")
            # tightened after a measured overshoot or an out-of-memory error below what any exact plan is
            # predicted to need: the least memory there is (start-up refuses a budget below both)
            return min(bounds, key=lambda p: self.c.predicted_peak(p, tokens))
        refined = [refine(self.c.costs, options, p, tokens, limit - self.c.predicted_peak(p, tokens), allowance ** 2)
                   for p in fitting if self.c.predicted_peak(p, tokens) <= limit]
        fitting = [p for p in refined if self.c.predicted_peak(p, tokens) <= limit] + fitting
        return min(fitting, key=lambda p: self.c.costs.seconds(p, tokens))  # the first of equals

    @staticmethod
    def _allowed(plan: dict[str, UnitPlan], exclude: tuple[str, UnitPlan] | None) -> bool:
        return exclude is None or plan.get(exclude[0]) != exclude[1]
