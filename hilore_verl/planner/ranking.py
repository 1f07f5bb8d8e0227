"""The plans the cost model ranks next to its choice: what a bench measures beside the chosen plan, so
that "the planner's choice is the best" is a measured statement, not the model's own.

Runner-ups by exclusion: for each unit, the best plan that does not give it the option the chosen plan
gives it (one solve per unit, each the optimum of its restricted problem), then keep / recompute's own
choice (no lossy option). Ranked by the cost model's step time; the chosen plan first: the solver's, or
a hands-off exact plan that fits and is priced no slower (the runtime's hooks included), as training
would run it (`PlanSearch.choose`).
"""

from __future__ import annotations

from hilore_verl.planner.controller import Controller
from hilore_verl.planner.solver import Infeasible
from hilore_verl.runtime.plan import UnitPlan


def ranked_plans(controller: Controller, tokens: int, count: int = 4, exposure_l2: float = 0.0,
                 allowance: float = 0.0) -> list[dict[str, UnitPlan]]:
    """Up to `count` distinct plans that fit the budget at `tokens`: the solver's, then its runner-ups by
    predicted step time (`Controller.predicted_step_seconds`), and the exact (keep / recompute) plan if
    it is not among them (so at most count + 1)."""
    chosen = controller.search.plan_for(tokens, exposure_l2, allowance)
    limit = controller.limit(tokens)
    seconds = lambda p: controller.predicted_step_seconds(p, tokens)  # noqa: E731
    for baseline in controller.hands_off_plans():  # run without the hooks where that is no slower (as in training)
        if controller.predicted_peak(baseline, tokens) <= limit and seconds(baseline) <= seconds(chosen):
            chosen = baseline
    found = {_key(chosen): chosen}
    for unit, option in chosen.items():
        try:
            plan = controller.search.plan_for(tokens, exposure_l2, allowance, exclude=(unit, option))
        except Infeasible:
            continue
        if controller.predicted_peak(plan, tokens) <= limit:
            found.setdefault(_key(plan), plan)
    ranked = [chosen] + sorted((p for k, p in found.items() if k != _key(chosen)), key=seconds)
    ranked = ranked[:count]
    exact = controller.search.plan_for(tokens, exposure_l2, 0.0)
    if _key(exact) not in {_key(p) for p in ranked}:
        ranked.append(exact)
    return ranked


def _key(plan: dict[str, UnitPlan]) -> tuple:
    return tuple(sorted(plan.items()))
