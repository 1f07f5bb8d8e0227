"""What the verl plugin registers, in one place. Called once per process while verl imports."""

from __future__ import annotations

from hilore_verl.integration import config_check, cpu_support
from hilore_verl.integration.cpu_platform import register_cpu_platform


def register_all() -> list[str]:
    """Register hilore-verl's extensions with verl; returns what was registered, for `doctor`."""
    register_cpu_platform()
    return ["platform:cpu", *cpu_support.install(), *config_check.install()]
