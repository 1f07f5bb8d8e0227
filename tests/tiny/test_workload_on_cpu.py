"""Synthetic GRPO mini-batches: verl's padded layout, zero-advantage groups, long tails, packing."""

import pytest
import torch

from hilore_verl.tiny.workload import GRPOWorkload, grpo_advantages, make_grpo_batch, pack, shard

W = GRPOWorkload(num_groups=8, group_size=8, max_prompt_len=20, max_response_len=64, zero_advantage_share=0.625)


def test_layout_and_masks():
    b = make_grpo_batch(W, seed=3)
    B, P, R = 64, 20, 64
    assert b["input_ids"].shape == b["attention_mask"].shape == b["position_ids"].shape == (B, P + R)
    assert b["responses"].shape == b["response_mask"].shape == b["advantages"].shape == (B, R)
    am, rm = b["attention_mask"], b["response_mask"]
    assert torch.equal(am[:, P:], rm)
    # left-padded prompts: once valid, valid to the end of the prompt; right-padded responses
    assert (am[:, :P].diff(dim=1) >= 0).all() and (rm.diff(dim=1) <= 0).all() and (rm[:, 0] == 1).all()
    assert (b["input_ids"][am == 0] == 0).all()
    valid_pos = b["position_ids"][am.bool()]
    assert valid_pos.min() == 0 and (b["position_ids"].max(dim=1).values == am.sum(1) - 1).all()
    for key in ("advantages", "old_log_probs"):
        assert (b[key][rm == 0] == 0).all()
    assert (b["old_log_probs"] <= 0).all()
    # responses of one group share one prompt
    prompts = b["prompts"].view(8, 8, P)
    assert (prompts == prompts[:, :1]).all()


def test_zero_advantage_groups_are_exactly_zero_and_the_rest_are_not():
    b = make_grpo_batch(W, seed=4)
    adv = b["advantages"][:, 0].view(8, 8)
    zero = b["zero_advantage_group"]
    assert zero.sum().item() == 5  # round(0.625 * 8)
    assert (adv[zero] == 0).all()
    assert (adv[~zero] != 0).any(dim=1).all()
    assert torch.allclose(adv[~zero].mean(dim=1), torch.zeros(3), atol=1e-6)
    assert make_grpo_batch(GRPOWorkload(num_groups=4, zero_advantage_share=0.0), 0)["zero_advantage_group"].sum() == 0


def test_response_lengths_are_long_tailed_and_deterministic():
    b = make_grpo_batch(W, seed=5)
    lengths = b["response_mask"].sum(1).float()
    assert lengths.max() > 2 * lengths.median()
    assert torch.equal(b["input_ids"], make_grpo_batch(W, seed=5)["input_ids"])
    assert not torch.equal(b["input_ids"], make_grpo_batch(W, seed=6)["input_ids"])


def test_grpo_advantages_formula():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    adv = grpo_advantages(r, group_size=4)
    expected = (r[:4] - 0.5) / (r[:4].std() + 1e-6)
    assert torch.allclose(adv[:4], expected) and (adv[4:] == 0).all()


def test_pack_matches_the_attention_mask():
    b = make_grpo_batch(W, seed=7)
    p = pack(b)
    lengths = b["attention_mask"].sum(1)
    assert p["input_ids"].shape == (1, lengths.sum().item())
    assert torch.equal(p["cu_seqlens"].diff().long(), lengths)
    for i in (0, 17, 63):
        start, end = p["cu_seqlens"][i].item(), p["cu_seqlens"][i + 1].item()
        assert torch.equal(p["input_ids"][0, start:end], b["input_ids"][i][b["attention_mask"][i].bool()])
        assert torch.equal(p["position_ids"][0, start:end], torch.arange(end - start))


def test_shard_splits_sequences_evenly():
    b = make_grpo_batch(W, seed=8)
    parts = [shard(b, r, 4) for r in range(4)]
    assert torch.equal(torch.cat([p["input_ids"] for p in parts]), b["input_ids"])
    assert torch.equal(parts[2]["zero_advantage_group"], b["zero_advantage_group"])
    with pytest.raises(ValueError, match="do not split evenly"):
        shard(b, 0, 3)


def test_bad_workloads_are_refused():
    with pytest.raises(ValueError):
        GRPOWorkload(min_response_len=0)
    with pytest.raises(ValueError):
        GRPOWorkload(zero_advantage_share=1.5)


def test_engine_batch_round_trips_through_verls_padding():
    from hilore_verl.integration.tools.verl_engine import to_engine_batch
    from verl.workers.utils.padding import no_padding_2_padding

    b = make_grpo_batch(W, seed=9)
    td = to_engine_batch(b, micro_batch_size_per_gpu=4)
    assert td["input_ids"].is_nested and td["global_batch_size"] == 64
    # verl's own inverse restores the response-aligned fields
    logp = torch.nested.nested_tensor_from_jagged(
        torch.cat([torch.roll(row[m.bool()], -1) for row, m in zip(b["input_ids"].float(), b["attention_mask"])]),
        offsets=td["input_ids"].offsets())
    restored = no_padding_2_padding(logp, td)
    assert torch.equal(restored * b["response_mask"], b["responses"].float())
