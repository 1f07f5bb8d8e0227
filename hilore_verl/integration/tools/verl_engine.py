"""Build verl's own FSDP engine and feed it mini-batches the way verl's trainer does.

`build_fsdp_engine` constructs `FSDPEngineWithLMHead` directly (verl's `EngineRegistry` knows the
FSDP engine only for cuda and npu); `to_engine_batch` applies verl's left-right -> no-padding
conversion and the non-tensor fields that `TrainingWorker` and the PPO trainer set; `ppo_loss_fn`
binds verl's `ppo_loss` to an actor config, as `ActorRolloutRefWorker` does.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable

import torch

import hilore_verl.integration  # noqa: F401  (version check, before any verl import below)
from verl.trainer.config import CheckpointConfig
from verl.utils import tensordict_utils as tu
from verl.workers.config import FSDPActorConfig, FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
from verl.workers.config.actor import PolicyLossConfig
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
from verl.workers.utils.losses import ppo_loss
from verl.workers.utils.padding import left_right_2_no_padding

# Fields of a verl actor-update batch (verl's padded layout) that the engine and ppo_loss read.
BATCH_FIELDS = ("input_ids", "attention_mask", "position_ids", "prompts", "responses", "response_mask",
                "old_log_probs", "advantages", "ref_log_prob", "rollout_is_weights")

FP32_MIXED_PRECISION = {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}


def build_fsdp_engine(
    model_path: str,
    *,
    strategy: str = "fsdp2",
    use_remove_padding: bool = True,
    micro_batch_size_per_gpu: int = 2,
    gradient_checkpointing: bool = False,
    mixed_precision: dict[str, str] | None = FP32_MIXED_PRECISION,
    lr: float = 1e-6,
    clip_grad: float = 1.0,
    total_training_steps: int = 10,
    defer_gradient_sync: bool = True,
    engine_cls: type = FSDPEngineWithLMHead,
    model_options: dict | None = None,
    **engine_kwargs,
) -> FSDPEngineWithLMHead:
    """An initialised verl FSDP engine for a Hugging Face model directory (needs torch.distributed).

    `mixed_precision=None` keeps verl's default (bf16 parameters, fp32 reduce). `defer_gradient_sync`:
    verl's `use_no_sync_for_gradient_accumulation` (reduce gradients once, in the last micro-batch's
    backward). `engine_cls`:
    verl's engine or a subclass (HiLoReFSDPEngine, which takes `hilore=` and `actor_config=`).
    `model_options`: further fields of verl's HFModelConfig (e.g. `lora_rank`, `target_modules`).
    """
    model_config = HFModelConfig(
        path=model_path,
        load_tokenizer=False,
        use_remove_padding=use_remove_padding,
        enable_gradient_checkpointing=gradient_checkpointing,
        override_config={"attn_implementation": "sdpa"},
        **(model_options or {}),
    )
    engine_config = FSDPEngineConfig(
        forward_only=False,
        strategy=strategy,
        fsdp_size=-1,
        use_dynamic_bsz=False,
        micro_batch_size_per_gpu=micro_batch_size_per_gpu,
        mixed_precision=mixed_precision,
        use_torch_compile=False,
        use_no_sync_for_gradient_accumulation=defer_gradient_sync,
    )
    optimizer_config = FSDPOptimizerConfig(lr=lr, clip_grad=clip_grad, total_training_steps=total_training_steps)
    engine = engine_cls(
        model_config=model_config,
        engine_config=engine_config,
        optimizer_config=optimizer_config,
        checkpoint_config=CheckpointConfig(),
        **engine_kwargs,
    )
    engine.initialize()
    return engine


def actor_config(**overrides: Any) -> FSDPActorConfig:
    """verl's FSDP actor config with the fields ppo_loss reads; `overrides` as in the recipe YAML."""
    fields: dict[str, Any] = dict(strategy="fsdp2", rollout_n=1, ppo_mini_batch_size=1, use_dynamic_bsz=False,
                                  ppo_micro_batch_size_per_gpu=1)
    fields.update(overrides)
    if isinstance(fields.get("policy_loss"), dict):  # as a recipe YAML gives it
        fields["policy_loss"] = PolicyLossConfig(**fields["policy_loss"])
    return FSDPActorConfig(**fields)


def ppo_loss_fn(config: FSDPActorConfig) -> Callable:
    """verl's actor loss bound to `config`, exactly as the actor worker binds it."""
    return partial(ppo_loss, config=config)


def to_engine_batch(
    batch: dict[str, torch.Tensor],
    *,
    use_remove_padding: bool = True,
    micro_batch_size_per_gpu: int = 2,
    global_batch_size: int | None = None,
    temperature: float = 1.0,
    calculate_entropy: bool = False,
    max_token_len_per_gpu: int | None = None,
):
    """A padded mini-batch (see hilore_verl.tiny.workload) as the TensorDict verl's engine.train_batch takes.

    `global_batch_size`: sequences in the mini-batch over all data-parallel ranks (ppo_loss
    normalises sequence-mean modes by it); defaults to this batch's size. `max_token_len_per_gpu`:
    dynamic batch sizes (micro-batches of at most that many tokens) instead of fixed ones.
    """
    fields = {k: v for k, v in batch.items() if k in BATCH_FIELDS}
    bsz = fields["input_ids"].shape[0]
    td = tu.get_tensordict(fields)
    td = left_right_2_no_padding(td)
    tu.assign_non_tensor(
        td,
        use_remove_padding=use_remove_padding,
        use_dynamic_bsz=max_token_len_per_gpu is not None,
        micro_batch_size_per_gpu=micro_batch_size_per_gpu,
        use_fused_kernels=False,
        temperature=temperature,
        calculate_entropy=calculate_entropy,
        global_batch_size=global_batch_size if global_batch_size is not None else bsz,
    )
    if max_token_len_per_gpu is not None:
        tu.assign_non_tensor(td, max_token_len_per_gpu=max_token_len_per_gpu)
    return td
