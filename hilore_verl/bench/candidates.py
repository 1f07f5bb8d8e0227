"""The plans the cost model ranks next to HiLoRe's choice, run beside it in a budget's paired rounds: the
chosen plan is the best only if none of them is measured faster (planner/ranking.py ranks them).

Each candidate runs through the same method (the engine's session, its skip and hooks) under a
controller that plans exactly that plan at every micro-batch, so its rounds differ from the chosen
plan's in the plan alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hilore_verl.planner import Controller
from hilore_verl.planner.ranking import ranked_plans
from hilore_verl.planner.search import PlanSearch
from hilore_verl.runtime import UnitPlan


@dataclass
class FixedPlan(Controller):
    """A controller whose every micro-batch gets `fixed` (its memory model and metrics as any other's)."""
    fixed: dict[str, UnitPlan] = field(default_factory=dict)

    def __post_init__(self):
        super().__post_init__()
        self.search = _Fixed(self)

    def _keeps_all(self, tokens: int, row: int) -> bool:
        return False  # its plan, even where keeping every unit would fit


class _Fixed(PlanSearch):
    """The search of a `FixedPlan`: its plan, whatever the micro-batch."""

    def choose(self, l2: float, tokens: int, allowance: float, row: int | None = None) -> tuple[dict[str, UnitPlan], bool]:
        return dict(self.c.fixed), False


def candidate_controllers(chosen: Controller, count: int, tokens: int) -> list[FixedPlan]:
    """Up to `count` runner-ups of the plan `chosen` gave its last micro-batch (at `tokens`, that micro-batch's
    exposure and risk allowance), plus keep / recompute's plan: one fixed-plan controller each."""
    last = chosen.history[-1]
    plans = ranked_plans(chosen, tokens, count + 1, chosen.exposure(0), last.risk_allowance)
    return [FixedPlan(chosen.runtime, chosen.costs, chosen.risk, chosen.budget, static_bytes=chosen.static_bytes,
                      gradient_bytes=chosen.gradient_bytes,
                      risk_budget=chosen.risk_budget, token_bucket=chosen.token_bucket, measure_baseline=False,
                      fixed=plan) for plan in plans if plan != last.plan][:count + 1]
