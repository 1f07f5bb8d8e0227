"""A bad `hilore:` section stops verl's trainer with one line, before Ray starts.

verl's `main_ppo` validates its config on the driver (`verl.utils.config.validate_config`) before
`ray.init`; that converts the actor config, where `HiLoReActorConfig` checks the `hilore:` section
and raises a ValueError naming the key. Through hydra it would surface as an instantiation error
with a stack trace. Wrapped here (when verl imports the module), such an error prints as

    hilore-verl: bad config: hilore.risk_budget: got -1; valid: a finite number >= 0

on stderr and exits with status 2. Every other error is verl's, untouched.

Two host checks run there too, for what would otherwise fail late or not at all:

- `actor_rollout_ref.rollout.name=hf` (the plugin's CPU rollout) on a device other than the CPU;
- on a one-node CPU run with Ray's CPU count left to Ray (`ray_kwargs.ray_init.num_cpus: null`), fewer
  cores than Ray must hold: a placement bundle per rank, the transfer queue's controller and storage
  units, and one more to schedule the remaining actors. Ray would wait for them forever.

And one note, printed once without stopping: with the shared prompt on over several data-parallel ranks,
verl balances single sequences over the ranks (its v1 trainer always; the legacy one under
`trainer.balance_batch`, on by default), so each prompt's responses spread over them and the shared
prompt finds few prompts to compute once, unless `actor.use_prefix_grouper` is set: then whole groups
are balanced (group_balance.py for the v1 trainer; verl itself for the legacy one) (`shared_prompt_note`).
"""

from __future__ import annotations

import functools
import sys

from hilore_verl.integration.cpu_host.after_import import when_imported
from hilore_verl.integration.cpu_host.workers import HF_ROLLOUT_NAME


def hilore_error(err: BaseException) -> str | None:
    """The message of the hilore-verl config error behind `err` (through hydra's wrapping), if any."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, ValueError) and str(err).startswith("hilore"):
            return str(err).splitlines()[0]
        err = err.__cause__ or err.__context__
    return None


def host_error(config) -> str | None:
    """Why this host cannot run `config` (see the module docstring), or None."""
    import os

    trainer, rollout = config.trainer, config.actor_rollout_ref.rollout
    device = trainer.get("device", "cuda")
    if rollout.get("name") == HF_ROLLOUT_NAME and device != "cpu":
        return (f"actor_rollout_ref.rollout.name=hf is the CPU rollout (Hugging Face generate); with "
                f"trainer.device={device} use vllm or sglang")
    ray_cpus = config.get("ray_kwargs", {}).get("ray_init", {}).get("num_cpus")
    if device != "cpu" or trainer.nnodes != 1 or ray_cpus is not None:
        return None
    queue = config.get("transfer_queue", {})
    units = queue.get("backend", {}).get("SimpleStorage", {}).get("num_data_storage_units", 0)
    needed = trainer.n_gpus_per_node + (1 + units if queue.get("enable", False) else 0) + 1
    cores = os.cpu_count() or 1
    if cores < needed:
        return (f"Ray would count {cores} CPUs here and needs {needed} ({trainer.n_gpus_per_node} ranks, the "
                f"transfer queue, one to schedule the rest): set ray_kwargs.ray_init.num_cpus={max(needed, 16)} "
                f"(logical CPUs; recipes/grpo/tiny_cpu.yaml does)")
    return None


def shared_prompt_note(config) -> str | None:
    """Why the shared prompt will find few groups on one rank under `config` (the module docstring), or None."""
    actor, trainer = config.actor_rollout_ref.actor, config.trainer
    hilore = actor.get("hilore", None) or {}
    ranks = int(trainer.get("n_gpus_per_node", 1)) * int(trainer.get("nnodes", 1))
    if not (hilore.get("enable", False) and hilore.get("shared_prompt", True)) or ranks < 2:
        return None
    if actor.get("use_prefix_grouper", False) or int(config.actor_rollout_ref.rollout.get("n", 1)) < 2:
        return None
    legacy = not trainer.get("use_v1", True)
    if legacy and not trainer.get("balance_batch", True):
        return None
    return ("verl balances single sequences over the ranks, so each prompt's responses spread over them and the "
            "shared prompt computes few prompts once; set actor_rollout_ref.actor.use_prefix_grouper=true (whole "
            "groups are then balanced; the recipes in recipes/grpo do)"
            + (" or trainer.balance_batch=false" if legacy else ""))


def _wrap(module) -> None:
    validate = module.validate_config

    @functools.wraps(validate)
    def validate_config(*args, **kwargs):
        config = args[0] if args else kwargs.get("config")
        message = host_error(config) if config is not None else None
        if message is not None:
            print(f"hilore-verl: bad config: {message}", file=sys.stderr, flush=True)
            raise SystemExit(2)
        note = shared_prompt_note(config) if config is not None else None
        if note is not None:
            print(f"hilore-verl: note: {note}", file=sys.stderr, flush=True)
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
