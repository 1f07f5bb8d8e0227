"""Everything that touches verl lives under this package; nothing else in hilore_verl imports verl.

Importing it checks the installed verl and torch against the supported ranges first, so an
unsupported combination fails here with the ranges named, not deep inside verl.
"""

from hilore_verl.versions import SUPPORTED, UnsupportedVersionError, require_supported_versions

require_supported_versions()

__all__ = ["SUPPORTED", "UnsupportedVersionError", "require_supported_versions"]


def __getattr__(name):
    # The recipe's `_target_: hilore_verl.integration.HiLoReActorConfig`, imported on first use only:
    # the verl plugin imports this package while verl itself is still importing.
    if name in ("HiLoReActorConfig", "HiLoReEngineConfig"):
        from hilore_verl.integration import actor_config

        return getattr(actor_config, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
