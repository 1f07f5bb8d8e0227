"""Multiple-choice knapsack: one option per unit, minimise time, memory <= budget, risk <= budget.

Risk adds in quadrature (independent errors): the constraint is sum_u risk_u^2 <= risk_budget^2.

- Small problems (at most EXACT_LIMIT combinations): every combination is checked: exact.
- Otherwise: dynamic programming over a memory grid (512 steps of the largest possible plan) for
  time + lam * risk^2, with lam found by bisection as the smallest price on risk whose plan fits
  the risk budget (lam = 0 first: often the risk budget does not bind). Memory costs are rounded
  *up* to the grid, so a returned plan never exceeds the memory budget; it is optimal for the
  rounded problem at that lam (the price can leave some risk budget unspent).

Ties go to the earlier option (keep, recompute, then lossy ones): the same inputs give the same
plan on every rank.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np


@dataclass(frozen=True)
class Option:
    plan: Any  # what the unit gets with this option (the planner's: a runtime UnitPlan)
    memory: float  # bytes held until backward (plus its transient share)
    time: float  # seconds this option costs over keeping (recompute forward, codec, transfer)
    risk: float = 0.0  # predicted gradient deviation


@dataclass
class Solution:
    choices: list[int]  # option index per unit
    time: float
    memory: float
    risk: float


class Infeasible(ValueError):
    pass


EXACT_LIMIT = 20000


def _steps(value: float, step: float) -> int:
    return math.ceil(value / step - 1e-9) if value > 0 else 0


def _exact(options, memory_budget, risk2_budget) -> list[int] | None:
    best, best_key = None, None
    for combo in itertools.product(*[range(len(o)) for o in options]):
        chosen = [options[u][k] for u, k in enumerate(combo)]
        if sum(o.memory for o in chosen) > memory_budget or sum(o.risk ** 2 for o in chosen) > risk2_budget * (1 + 1e-12):
            continue
        key = (sum(o.time for o in chosen), combo)  # lexicographic tie-break: earlier options first
        if best_key is None or key < best_key:
            best, best_key = list(combo), key
    return best


def _dp(options, memory_budget, lam, bins) -> list[int] | None:
    """Least time + lam * risk^2 within the memory budget. The grid step depends on the options only
    (not the budget), so a larger budget only adds states: more memory never gives a slower plan."""
    ceiling = sum(max(o.memory for o in opts) for opts in options)
    step = max(ceiling, 1.0) / bins
    M = min(int(min(memory_budget, ceiling) / step + 1e-9), bins) + 1
    best = np.zeros(M)
    picks = np.empty((len(options), M), dtype=np.int8)
    for u, opts in enumerate(options):
        new = np.full(M, np.inf)
        pick = picks[u]
        pick.fill(-1)
        for k, opt in enumerate(opts):
            dm = _steps(opt.memory, step)
            if dm >= M:
                continue
            cand = best[: M - dm] + (opt.time + lam * opt.risk ** 2)
            target = new[dm:]
            better = cand < target
            np.copyto(target, cand, where=better)
            pick[dm:][better] = k
        best = new
    if not np.isfinite(best[-1]):
        return None
    choices, m = [], M - 1
    for u in range(len(options) - 1, -1, -1):
        k = int(picks[u, m])
        choices.append(k)
        m -= _steps(options[u][k].memory, step)
    return choices[::-1]


def _risk2(options, choices) -> float:
    return sum(options[u][k].risk ** 2 for u, k in enumerate(choices))


def _price_risk(options, memory_budget, risk2_budget, bins) -> list[int] | None:
    """Smallest price on risk^2 (bisection in log space) whose plan fits the risk budget."""
    hi = 1.0
    while True:
        plan = _dp(options, memory_budget, hi, bins)
        if plan is None or _risk2(options, plan) <= risk2_budget:
            break
        if hi > 1e300:
            return None
        hi *= 1e3
    lo = hi / 1e3 if hi > 1.0 else 0.0
    for _ in range(12):
        mid = math.sqrt(lo * hi) if lo > 0 else hi / 32
        trial = _dp(options, memory_budget, mid, bins)
        if trial is not None and _risk2(options, trial) <= risk2_budget:
            hi, plan = mid, trial
        else:
            lo = mid
    return plan


def solve(options: Sequence[Sequence[Option]], memory_budget: float, risk_budget: float,
          memory_bins: int = 512) -> Solution:
    """options[u] = the choices of unit u. Raises Infeasible when no combination fits."""
    if not options:
        return Solution([], 0.0, 0.0, 0.0)
    if not (memory_budget >= 0 and risk_budget >= 0):
        raise ValueError(f"budgets must be numbers >= 0; got memory {memory_budget}, risk {risk_budget}")
    risk2_budget = risk_budget ** 2
    # an option whose own risk exceeds the budget can never be part of a plan
    index = [[k for k, o in enumerate(opts) if o.risk ** 2 <= risk2_budget] for opts in options]
    if any(not ks for ks in index):
        raise Infeasible("a unit has no option within the risk budget")
    allowed = [[options[u][k] for k in ks] for u, ks in enumerate(index)]
    min_memory = sum(min(o.memory for o in opts) for opts in allowed)
    if min_memory > memory_budget:
        raise Infeasible(f"even the smallest plan needs {min_memory:.0f} bytes; the budget is {memory_budget:.0f}")
    if math.prod(len(o) for o in allowed) <= EXACT_LIMIT:
        choices = _exact(allowed, memory_budget, risk2_budget)
    else:
        choices = _dp(allowed, memory_budget, 0.0, memory_bins)
        if choices is not None and _risk2(allowed, choices) > risk2_budget:
            choices = _price_risk(allowed, memory_budget, risk2_budget, memory_bins)
    if choices is None:  # the grid rounds costs up; the smallest plan may still fit exactly
        smallest = [min(range(len(opts)), key=lambda k: (opts[k].memory, opts[k].risk, k)) for opts in allowed]
        if _risk2(allowed, smallest) <= risk2_budget:
            choices = smallest
    if choices is None:
        raise Infeasible("no plan fits both the memory and the risk budget")
    choices = [index[u][k] for u, k in enumerate(choices)]
    chosen = [options[u][k] for u, k in enumerate(choices)]
    return Solution(choices, sum(o.time for o in chosen), sum(o.memory for o in chosen),
                    math.sqrt(sum(o.risk ** 2 for o in chosen)))
