"""Small causal LMs built from configs with random weights: no download, runs anywhere.

Used by `doctor`, the tests and the CPU demo. Every family uses `attn_implementation="sdpa"`
(verl defaults to flash-attention 2, which needs a GPU).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, PretrainedConfig, Qwen2Config, Qwen3Config

# family -> (config class, the smallest shape that still exercises GQA, RoPE and an untied head)
FAMILIES: dict[str, tuple[type[PretrainedConfig], dict[str, Any]]] = {
    "qwen2": (Qwen2Config, {}),
    "qwen3": (Qwen3Config, {"head_dim": 16}),
    "llama": (LlamaConfig, {}),
    "mistral": (MistralConfig, {"sliding_window": None}),
}

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
)


def tiny_config(family: str = "qwen2", **overrides: Any) -> PretrainedConfig:
    """A config of the given family; `overrides` replace any field of the default shape."""
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; choose one of {sorted(FAMILIES)}")
    cls, family_fields = FAMILIES[family]
    fields = {**DEFAULT_SHAPE, **family_fields, **overrides}
    config = cls(**fields)
    config._attn_implementation = "sdpa"
    return config


def build_tiny_model(family: str = "qwen2", seed: int = 0, dtype: torch.dtype = torch.float32, **overrides: Any):
    """A randomly initialised model; the same seed and config give the same weights."""
    config = tiny_config(family, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def save_tiny_model(path: str | os.PathLike, family: str = "qwen2", seed: int = 0, **overrides: Any) -> str:
    """Write a tiny model to `path` in Hugging Face format (what verl loads); returns the path."""
    path = os.fspath(path)
    build_tiny_model(family, seed=seed, **overrides).save_pretrained(path)
    return path
