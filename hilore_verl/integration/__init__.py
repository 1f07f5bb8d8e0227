"""Everything that touches verl lives under this package; nothing else in hilore_verl imports verl.

Three parts, by audience:

- `actor/`     the verl engine adapter: HiLoRe inside verl's FSDP actor (the recipe's config class, the
               engine, verl's loss as coefficients, the shared-prompt forward, checks run before Ray). The
               only code that needs HiLoRe and verl together.
- `cpu_host/`  verl on a host without an accelerator (a CPU platform, worker adaptations, an HF rollout
               backend). Active whenever the plugin loads, with HiLoRe on or off; it tracks verl's
               internals, not HiLoRe's, and imports nothing from `actor/`.
- `tools/`     for tests, the bench, the demo and `doctor`: verl's stock engine built directly, N gloo ranks
               in fresh processes, the demo's two `main_ppo` runs, a one-step self check.

`registration.py` is the one place that says what the verl plugin registers (`hilore_verl/plugin.py`).

Importing it checks the installed verl and torch against the supported ranges first, so an
unsupported combination fails here with the ranges named, not deep inside verl.

The only package that imports verl; may import every core package (tiny for tools/ only).
"""

from hilore_verl.validation.versions import SUPPORTED, UnsupportedVersionError, require_supported_versions

require_supported_versions()

__all__ = ["SUPPORTED", "UnsupportedVersionError", "require_supported_versions"]


def __getattr__(name):
    # The recipe's `_target_: hilore_verl.integration.HiLoReActorConfig`, imported on first use only:
    # the verl plugin imports this package while verl itself is still importing.
    if name in ("HiLoReActorConfig", "HiLoReEngineConfig"):
        from hilore_verl.integration.actor import config

        return getattr(config, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
