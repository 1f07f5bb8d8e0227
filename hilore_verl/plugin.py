"""verl's entry point (group "verl.plugins"): verl imports this module in every process that imports verl.

verl swallows a plugin's import error at debug level, so this module never raises: it records
what happened in `STATUS` and warns on stderr when registration failed, so the failure is seen.
It imports no verl module itself; `hilore_verl.integration` does the work.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, field

logger = logging.getLogger("hilore_verl")


@dataclass
class PluginStatus:
    loaded: bool = False
    registered: list[str] = field(default_factory=list)
    error: str | None = None


STATUS = PluginStatus()


def load() -> PluginStatus:
    """Register with verl once; later calls return the first outcome."""
    if STATUS.loaded or STATUS.error is not None:
        return STATUS
    try:
        # The submodule, not the package attribute: verl may be importing us while
        # hilore_verl.integration itself is still being imported (it imports verl).
        from hilore_verl.integration.registration import register_all

        STATUS.registered = register_all()
        STATUS.loaded = True
    except Exception as exc:  # noqa: BLE001 - reported below, never swallowed
        STATUS.error = f"{type(exc).__name__}: {exc}"
        warnings.warn(f"hilore-verl: the verl plugin did not load: {STATUS.error}", RuntimeWarning, stacklevel=2)
        logger.error("hilore-verl: the verl plugin did not load: %s", STATUS.error)
    return STATUS


load()
