"""hilore-verl: keep, compress or recompute each recovery unit's saved activations in verl's actor update.

    rt = hilore_verl.attach(model)          # every unit starts on "keep"
    rt.set_plan({"layers.3": "recompute", "layers.4.mlp.proj": "int8"})
    rt.stats(); rt.detach()

Importing this package never imports verl; `hilore_verl.integration` is the only part that does.
"""

from hilore_verl.runtime import Mode, Plan, Runtime, RuntimeConfig, UnitPlan, attach

__version__ = "0.1.0.dev0"

__all__ = ["Mode", "Plan", "Runtime", "RuntimeConfig", "UnitPlan", "__version__", "attach"]
