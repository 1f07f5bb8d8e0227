"""Tiny causal LMs from configs: every family builds, runs with sdpa, and is reproducible from its seed."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from hilore_verl.tiny.models import FAMILIES, attention_of, build_tiny_model, save_tiny_model, tiny_config


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_builds_and_runs(family, tmp_path):
    model = build_tiny_model(family, seed=0)
    assert model.config._attn_implementation == attention_of(family)
    assert not model.config.tie_word_embeddings
    ids = torch.randint(0, 512, (2, 9))
    logits = model(ids, use_cache=False).logits
    assert logits.shape == (2, 9, 512) and torch.isfinite(logits).all()
    assert torch.equal(logits, build_tiny_model(family, seed=0)(ids, use_cache=False).logits)
    loaded = AutoModelForCausalLM.from_pretrained(save_tiny_model(tmp_path / family, family, seed=0),
                                                  attn_implementation=attention_of(family))
    assert torch.equal(logits, loaded(ids, use_cache=False).logits)


def test_overrides_and_unknown_family():
    assert tiny_config("llama", num_hidden_layers=5).num_hidden_layers == 5
    with pytest.raises(ValueError, match="unknown model family 'gpt9'"):
        tiny_config("gpt9")


def test_seed_changes_the_weights():
    a, b = build_tiny_model("qwen2", seed=0), build_tiny_model("qwen2", seed=1)
    assert not torch.equal(a.lm_head.weight, b.lm_head.weight)
