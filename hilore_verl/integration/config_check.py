"""A bad `hilore:` section stops verl's trainer with one line, before Ray starts.

verl's `main_ppo` validates its config on the driver (`verl.utils.config.validate_config`) before
`ray.init`; that converts the actor config, where `HiLoReActorConfig` checks the `hilore:` section
and raises a ValueError naming the key. Through hydra it would surface as an instantiation error
with a stack trace. Wrapped here (when verl imports the module), such an error prints as

    hilore-verl: bad config: hilore.risk_budget: got -1; valid: a finite number >= 0

on stderr and exits with status 2. Every other error is verl's, untouched.
"""

from __future__ import annotations

import functools
import sys

from hilore_verl.integration.after_import import when_imported


def hilore_error(err: BaseException) -> str | None:
    """The message of the hilore-verl config error behind `err` (through hydra's wrapping), if any."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, ValueError) and str(err).startswith("hilore"):
            return str(err).splitlines()[0]
        err = err.__cause__ or err.__context__
    return None


def _wrap(module) -> None:
    validate = module.validate_config

    @functools.wraps(validate)
    def validate_config(*args, **kwargs):
        try:
            return validate(*args, **kwargs)
        except Exception as err:
            message = hilore_error(err)
            if message is None:
                raise
            print(f"hilore-verl: bad config: {message}", file=sys.stderr, flush=True)
            raise SystemExit(2) from None

    module.validate_config = validate_config


def install() -> list[str]:
    when_imported("verl.utils.config", _wrap)
    return ["config:one-line-errors"]
