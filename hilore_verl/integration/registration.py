"""What the verl plugin registers, in one place. Called once per process while verl imports."""

from __future__ import annotations

import sys

from hilore_verl.integration.actor import config_check, group_balance
from hilore_verl.integration.cpu_host import packed_attention, workers
from hilore_verl.integration.tools import ab_peak

CPU_PLATFORM_MODULE = "hilore_verl.integration.cpu_host.platform"


def register_all() -> list[str]:
    """Register hilore-verl's extensions with verl; returns what was registered, for `doctor`."""
    module = sys.modules.get(CPU_PLATFORM_MODULE)
    if module is not None and not hasattr(module, "register_cpu_platform"):
        # The module's own verl import (its first lines) is what loads the plugin: the platform is not
        # defined yet. The module registers it as its import ends, before anything asks verl for one.
        module.REGISTER_ON_IMPORT = True
    else:
        from hilore_verl.integration.cpu_host.platform import register_cpu_platform

        register_cpu_platform()
    return ["platform:cpu", f"attention:{packed_attention.register()}", *workers.install(), *config_check.install(),
            *group_balance.install(), *ab_peak.install()]
