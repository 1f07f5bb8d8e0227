"""The recovery-unit runtime: keep, compress or recompute each unit's saved activations as a Plan says.

May import kernels, model and validation; never planner, training or verl (it decides nothing).
"""

from hilore_verl.runtime.plan import KEEP, RECOMPUTE, Mode, Plan, UnitPlan
from hilore_verl.runtime.config import RuntimeConfig
from hilore_verl.runtime.runtime import Runtime, attach
from hilore_verl.runtime.stats import RuntimeStats, UnitStats

__all__ = ["KEEP", "RECOMPUTE", "Mode", "Plan", "Runtime", "RuntimeConfig", "RuntimeStats", "UnitPlan", "UnitStats", "attach"]
