"""Planner: cost and memory model, budgeted solver, per-mini-batch controller.

May import runtime, loss, model, measure, kernels and validation; never training, integration or verl.
"""

from hilore_verl.planner.budget import BudgetConfig
from hilore_verl.planner.controller import Controller
from hilore_verl.planner.costs import CostTable, Tokens, UnitProfile
from hilore_verl.planner.profiling import profile
from hilore_verl.planner.solver import Infeasible, Option, Solution, solve

__all__ = ["BudgetConfig", "Controller", "CostTable", "Infeasible", "Option", "Solution", "Tokens", "UnitProfile",
           "profile", "solve"]
