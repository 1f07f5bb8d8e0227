"""`hilore-verl bench`: HiLoRe against every baseline a user would pick, on one GRPO actor update.

A tool on top: may import integration (verl's own offload baseline), training, planner and the core packages.
"""

from hilore_verl.bench.methods import METHODS
from hilore_verl.bench.run import run_bench
from hilore_verl.bench.actor_update import BenchConfig

__all__ = ["METHODS", "BenchConfig", "run_bench"]
