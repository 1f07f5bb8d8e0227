"""Small causal LMs built from configs with random weights: no download, runs anywhere.

Used by `doctor`, the tests and the CPU demo. Every family uses `attn_implementation="sdpa"`
(verl defaults to flash-attention 2, which needs a GPU), except GPT-OSS, whose attention sinks
transformers runs in its eager implementation only. MoE families get 4 experts, 2 per token.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import transformers
from transformers import AutoModelForCausalLM, PretrainedConfig

# family -> (config class name, the smallest shape that still exercises GQA, RoPE, an untied head and,
# where the family has them, dense and MoE layers side by side)
_MOE = {"num_experts_per_tok": 2, "moe_intermediate_size": 32}
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {"head_dim": 16}),
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", {"sliding_window": None}),
    "phi3": ("Phi3Config", {}),
    "olmo2": ("Olmo2Config", {}),
    "gemma2": ("Gemma2Config", {"head_dim": 16}),
    "gemma3": ("Gemma3TextConfig", {"head_dim": 16}),
    "qwen3_moe": ("Qwen3MoeConfig", {"head_dim": 16, "num_experts": 4, "mlp_only_layers": [0], **_MOE}),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None}),
    "deepseek_v3": ("DeepseekV3Config", {"num_key_value_heads": 4, "n_routed_experts": 4, "n_shared_experts": 1, "first_k_dense_replace": 1,
                                         "q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8,
                                         "qk_nope_head_dim": 8, "v_head_dim": 16, "n_group": 1, "topk_group": 1,
                                         **_MOE}),
    "gpt_oss": ("GptOssConfig", {"head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2,
                                 "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8}),
    "granitemoe": ("GraniteMoeConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
}
ATTENTION = {"gpt_oss": "eager"}  # families transformers runs without sdpa

DEFAULT_SHAPE: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    rms_norm_eps=1e-6,
    pad_token_id=0,  # within the vocabulary (some families' defaults are not)
    bos_token_id=1,
    eos_token_id=2,
)


def tiny_config(family: str = "qwen2", **overrides: Any) -> PretrainedConfig:
    """A config of the given family; `overrides` replace any field of the default shape."""
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; choose one of {sorted(FAMILIES)}")
    cls, family_fields = FAMILIES[family]
    fields = {**DEFAULT_SHAPE, **family_fields, **overrides}
    config = getattr(transformers, cls)(**fields)
    config._attn_implementation = attention_of(family)
    return config


def attention_of(family: str) -> str:
    return ATTENTION.get(family, "sdpa")


def build_tiny_model(family: str = "qwen2", seed: int = 0, dtype: torch.dtype = torch.float32, **overrides: Any):
    """A randomly initialised model; the same seed and config give the same weights."""
    config = tiny_config(family, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attention_of(family))
    return model.eval()


def save_tiny_model(path: str | os.PathLike, family: str = "qwen2", seed: int = 0, **overrides: Any) -> str:
    """Write a tiny model to `path` in Hugging Face format (what verl loads); returns the path."""
    path = os.fspath(path)
    build_tiny_model(family, seed=seed, **overrides).save_pretrained(path)
    return path
