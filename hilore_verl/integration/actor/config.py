"""The recipe switch: verl's FSDP actor config with a `hilore:` section, chosen by hydra `_target_`.

A recipe sets, once:

    actor_rollout_ref:
      actor:
        _target_: hilore_verl.integration.HiLoReActorConfig
        strategy: fsdp2
        hilore: {enable: false, budget: {mode: gc_ratio, value: null}}  # null: the mode's default, 1.10

and `actor_rollout_ref.actor.hilore.enable=true` turns HiLoRe on. verl converts the actor section
with `omega_conf_to_dataclass` in the driver (`validate_config`) and again inside each actor worker,
so the checks below run at start-up, before any model is built, and the engine choice is made in
every worker on every node where the package is installed (no environment variable).

How the engine is chosen: verl's `TrainingWorker` builds `EngineRegistry.new(model_type,
backend=engine_config.strategy, ...)`. With HiLoRe on, the actor's engine config becomes a
`HiLoReEngineConfig` whose registry key is `BACKEND`, under which `HiLoReFSDPEngine` is registered;
the engine builds FSDP2 from an identical copy whose strategy is `fsdp2`. With HiLoRe off, nothing
is replaced: verl's own engine config, verl's own engine.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any

from hilore_verl.training.config import HiLoReConfig
from verl.workers.config import FSDPActorConfig, FSDPEngineConfig

logger = logging.getLogger("hilore_verl")


@dataclass
class HiLoReEngineConfig(FSDPEngineConfig):
    """verl's FSDP engine config plus the validated `hilore:` section; what HiLoReFSDPEngine reads."""

    hilore: HiLoReConfig = field(default_factory=HiLoReConfig)

    def as_fsdp2(self) -> "HiLoReEngineConfig":
        """The same settings with strategy `fsdp2`: what verl's FSDP build code expects to see."""
        return dataclasses.replace(self, strategy="fsdp2")


@dataclass
class HiLoReActorConfig(FSDPActorConfig):
    """verl's FSDP actor config with a `hilore:` section (see docs/config.md for every key)."""

    hilore: Any = field(default_factory=dict)

    def __post_init__(self):
        section = self.hilore if isinstance(self.hilore, HiLoReConfig) else HiLoReConfig.from_dict(self.hilore)
        object.__setattr__(self, "hilore", section)
        if section.enable and self.strategy != "fsdp2":
            kind = {"fsdp": "FSDP1", "megatron": "Megatron"}.get(self.strategy, self.strategy)
            raise ValueError(f"hilore.enable=true needs actor_rollout_ref.actor.strategy=fsdp2; got "
                             f"strategy={self.strategy} ({kind}), which HiLoRe does not support")
        super().__post_init__()
        if not section.enable:
            return
        # verl's engine reads fsdp_config's size; the actor's own (deprecated) key is copied into it above
        sp = self.fsdp_config.ulysses_sequence_parallel_size
        if sp > 1:
            key = ("actor_rollout_ref.actor." + ("" if self.ulysses_sequence_parallel_size > 1 else "fsdp_config.")
                   + "ulysses_sequence_parallel_size")
            raise ValueError(f"hilore.enable=true with {key}={sp} is not supported: Ulysses' all-to-alls run inside "
                             "the attention units, and recomputing a unit would run them again out of step with the "
                             "other ranks; set it to 1 (or hilore.enable=false)")
        from hilore_verl.integration.actor.engine import BACKEND  # importing the engine registers it with verl

        values = {f.name: getattr(self.fsdp_config, f.name) for f in dataclasses.fields(FSDPEngineConfig) if f.init}
        engine = HiLoReEngineConfig(**values, hilore=section)
        object.__setattr__(engine, "strategy", BACKEND)  # the registry key; the engine builds FSDP2
        object.__setattr__(self, "engine", engine)

    def validate(self, n_gpus: int, train_batch_size: int, model_config: dict | None = None):
        super().validate(n_gpus, train_batch_size, model_config)
        if not self.hilore.enable or not model_config:
            return
        if model_config.get("enable_activation_offload", False):
            raise ValueError("hilore.enable=true and actor_rollout_ref.model.enable_activation_offload=true manage "
                             "the same activations: set actor_rollout_ref.model.enable_activation_offload=false")
        if model_config.get("use_liger", False):
            raise ValueError("hilore.enable=true with actor_rollout_ref.model.use_liger=true is not supported: Liger "
                             "replaces the norms, MLP activations and the head's loss with fused GPU kernels whose "
                             "saved tensors HiLoRe has not been checked against; set use_liger=false")
        from hilore_verl.integration.actor.map_check import check_unit_map

        check_unit_map(model_config)  # a model no unit map fits: refused here, not in every worker after Ray
        if model_config.get("enable_gradient_checkpointing", False):
            logger.warning("hilore-verl: HiLoRe takes over gradient checkpointing of the decoder layers it manages "
                           "(actor_rollout_ref.model.enable_gradient_checkpointing=true stays as verl's fallback "
                           "for anything it does not manage)")

