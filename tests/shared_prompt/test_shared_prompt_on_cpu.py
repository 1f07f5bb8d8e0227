"""The shared-prompt forward (hilore_verl.shared_prompt) against the ordinary per-sequence forward.

Bounds, fp32, every family of hilore_verl.tiny.models:
  log-probs and entropies   max |shared - ref| / max |ref| <= 1e-5
  gradients of sum(logp * c), per parameter: cosine >= 0.999999 and |g - g_ref| / |g_ref| <= 1e-5
A wrong mask (responses cut off from their prompt, or a sliding window ignored) moves the log-probs
by more than 1e-3 relative on these models (checked below), far outside the bounds.
"""

from __future__ import annotations

import logging
import random

import pytest
import torch

from hilore_verl.shared_prompt import (
    SharedLayout,
    install,
    shared_attention,
    shared_layout,
    shared_log_probs,
    shared_logits,
    uninstall,
    unshared_log_probs,
)
from hilore_verl.tiny.models import FAMILIES, build_tiny_model

NO_SHARED_ATTENTION = {"gpt_oss"}  # attention sinks (s_aux): the fallback serves them

REL = 1e-5
COSINE = 0.999999
# (prompt length, group size); odd lengths, P = 1, groups of 1, 3 and 5
GROUPS = [(1, 3), (7, 5), (12, 1), (5, 3), (2, 1)]


def _ids(gen: torch.Generator, n: int) -> torch.Tensor:
    return torch.randint(3, 500, (n,), generator=gen)


def _sequences(seed: int = 0, groups=GROUPS, ungrouped: int = 1):
    gen = torch.Generator().manual_seed(seed)
    seqs = []
    for gid, (p, n) in enumerate(groups):
        prompt = _ids(gen, p)
        for _ in range(n):
            seqs.append((f"g{gid}", prompt.clone(), _ids(gen, int(torch.randint(1, 21, (1,), generator=gen)))))
    for _ in range(ungrouped):
        seqs.append((None, _ids(gen, 4), _ids(gen, 6)))
    random.Random(seed).shuffle(seqs)  # group members need not be adjacent
    return seqs


def _rel(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    a, b = torch.cat(a).detach(), torch.cat(b).detach()
    return float((a - b).abs().max() / b.abs().max())


def _grads(model, logps: list[torch.Tensor], coefs: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    sum((lp * c).sum() for lp, c in zip(logps, coefs)).backward()
    return {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()}


def _assert_grads_close(got: dict, ref: dict) -> None:
    for name, g_ref in ref.items():
        g = got[name]
        ref_norm = float(g_ref.norm())
        if ref_norm == 0.0:  # e.g. an expert no token was routed to
            assert float(g.norm()) <= 1e-12, name
            continue
        rel = float((g - g_ref).norm()) / ref_norm
        cos = float(torch.nn.functional.cosine_similarity(g.flatten(), g_ref.flatten(), dim=0))
        assert rel <= REL and cos >= COSINE, (name, rel, cos)


def test_layout_structure():
    seqs = _sequences()
    layout = SharedLayout.build(seqs)
    by_group: dict = {}
    for gid, prompt, response in seqs:
        by_group.setdefault(gid if gid is not None else id(response), []).append((prompt, response))
    # one segment per group (P + sum R tokens) and one per ungrouped sequence
    assert len(layout.groups) == len(by_group)
    assert layout.fallback_groups == 0 and layout.ungrouped == 1
    assert layout.shared_groups == sum(1 for _, n in GROUPS if n > 1)
    for g in layout.groups:
        assert g.length == g.prompt_len + sum(g.response_lens)
        pos = layout.position_ids[0, g.start : g.end]
        assert pos[: g.prompt_len].tolist() == list(range(g.prompt_len))
    assert layout.shared_tokens == sum(len(ms[0][0]) + sum(len(r) for _, r in ms) for ms in by_group.values())
    assert layout.unshared_tokens == sum(len(p) + len(r) for _, p, r in seqs)
    assert layout.shared_tokens < layout.unshared_tokens
    # each response token is predicted from the token before it in its own (unshared) sequence
    row = layout.input_ids[0]
    per_sequence = zip(seqs, layout.split(layout.predict_index), layout.split(layout.target_ids))
    for (_, prompt, response), pred, tgt in per_sequence:
        full = torch.cat([prompt, response])
        assert torch.equal(tgt, response)
        assert torch.equal(row[pred], full[len(prompt) - 1 : -1])
        assert torch.equal(layout.position_ids[0, pred], torch.arange(len(prompt) - 1, len(full) - 1))


def test_empty_prompt_is_refused():
    with pytest.raises(ValueError, match="empty prompt"):
        SharedLayout.build([("a", torch.tensor([], dtype=torch.long), torch.tensor([5, 6]))])


def test_differing_prompts_fall_back_to_unshared_segments():
    gen = torch.Generator().manual_seed(3)
    a, b = _ids(gen, 6), _ids(gen, 6)  # same length, different tokens
    seqs = [("x", a, _ids(gen, 5)), ("x", b, _ids(gen, 7)), ("x", a, _ids(gen, 3))]
    seqs += [("y", a, _ids(gen, 4)), ("y", a, _ids(gen, 0)), ("y", a, _ids(gen, 2))]  # an empty response too
    layout = SharedLayout.build(seqs)
    assert layout.fallback_groups == 1
    assert [len(g.response_lens) for g in layout.groups] == [1, 1, 1, 3]
    assert [g.shared for g in layout.groups] == [False, False, False, True]
    assert layout.shared_tokens == layout.unshared_tokens - 2 * len(a)  # group y's prompt once, not 3 times
    model = build_tiny_model("qwen2")
    got, ref = shared_log_probs(model, seqs), unshared_log_probs(model, seqs)
    assert [len(x) for x in got] == [5, 7, 3, 4, 0, 2]
    assert _rel(got, ref) <= REL


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_matches_unshared_forward(family, caplog):
    seqs = _sequences()
    model = build_tiny_model(family)
    before = model.config._attn_implementation
    try:
        shared_logits(model, SharedLayout.build(seqs))
    except NotImplementedError as exc:
        # only attention sinks are out of the shared-prompt attention's reach: any other family must run
        assert family in NO_SHARED_ATTENTION and "attention sinks" in str(exc), (family, exc)
        # the public entry point warns once and returns the ordinary forward's values
        with caplog.at_level(logging.WARNING, logger="hilore_verl.shared_prompt"):
            got = shared_log_probs(model, seqs, with_entropy=True)
        warnings = [r for r in caplog.records if r.name.startswith("hilore_verl.shared_prompt")]
        assert len(warnings) == 1 and "not available" in warnings[0].getMessage()
        ref = unshared_log_probs(model, seqs, with_entropy=True)
        assert all(torch.equal(x, y) for x, y in zip(got[0] + got[1], ref[0] + ref[1]))
        assert model.config._attn_implementation == before
        pytest.skip(f"{family}: falls back to the ordinary forward ({exc})")
    assert family not in NO_SHARED_ATTENTION, f"{family} now runs the shared-prompt attention: update the test"
    assert model.config._attn_implementation == before

    logp, ent = shared_log_probs(model, seqs, with_entropy=True)
    ref_logp, ref_ent = unshared_log_probs(model, seqs, with_entropy=True)
    assert [len(x) for x in logp] == [len(r) for _, _, r in seqs]
    assert _rel(logp, ref_logp) <= REL and _rel(ent, ref_ent) <= REL
    hot = shared_log_probs(model, seqs, temperature=0.7)
    assert _rel(hot, unshared_log_probs(model, seqs, temperature=0.7)) <= REL

    gen = torch.Generator().manual_seed(1)
    coefs = [torch.randn(len(r), generator=gen) for _, _, r in seqs]
    _assert_grads_close(_grads(model, logp, coefs), _grads(model, ref_logp, coefs))


@pytest.mark.parametrize("family", ["mistral", "gemma2", "gemma3"])
def test_sliding_window_is_honoured(family):
    # prompts and responses longer than the window: a query at position t sees positions > t - 4 only
    seqs = _sequences(seed=5, groups=[(9, 3), (3, 3), (1, 1)], ungrouped=0)
    windowed = build_tiny_model(family, sliding_window=4)
    unwindowed = build_tiny_model(family, sliding_window=4096)  # same weights, window never reached
    ref = unshared_log_probs(windowed, seqs)
    assert _rel(unshared_log_probs(unwindowed, seqs), ref) > 1e-3  # the data exercises the window
    logp = shared_log_probs(windowed, seqs)
    assert _rel(logp, ref) <= REL
    coefs = [torch.ones(len(r)) for _, _, r in seqs]
    _assert_grads_close(_grads(windowed, logp, coefs), _grads(windowed, ref, coefs))


def test_context_managers_and_installed_model_stay_exact():
    seqs = _sequences(seed=2)
    model = build_tiny_model("gemma2")
    layout = SharedLayout.build(seqs)
    expected = shared_logits(model, layout)
    with shared_attention(model), shared_layout(layout):  # the layout by context only, full logits
        logits = model(input_ids=layout.input_ids, position_ids=layout.position_ids, use_cache=False).logits[0]
    logits, expected = logits.detach(), expected.detach()
    assert float((logits[layout.predict_index] - expected).abs().max()) <= REL * float(expected.abs().max())
    assert model.config._attn_implementation == "sdpa"
    # installed but without a layout: the base implementation, bit for bit on ordinary batches
    ids = torch.randint(3, 500, (2, 9))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    plain = model(input_ids=ids, attention_mask=mask).logits
    previous = install(model)
    try:
        assert torch.equal(model(input_ids=ids, attention_mask=mask).logits, plain)
    finally:
        uninstall(model, previous)
    assert model.config._attn_implementation == previous == "sdpa"


def test_gradient_checkpointing_recompute_serves_the_layout():
    seqs = _sequences(seed=4)
    model = build_tiny_model("qwen3")
    coefs = [torch.randn(len(r)) for _, _, r in seqs]
    ref = _grads(model, unshared_log_probs(model, seqs), coefs)
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    logp = shared_log_probs(model, seqs)
    # the backward recomputes the layers after the call returned: the model stays installed for it
    assert model.config._attn_implementation.startswith("hilore_shared_prompt")
    _assert_grads_close(_grads(model, logp, coefs), ref)
    uninstall(model)
    assert model.config._attn_implementation == "sdpa"


def test_a_soft_cap_is_applied_as_the_base_attention_applies_it():
    # sdpa ignores Gemma2's attention soft-cap, eager applies it: shared, the model computes what it computes
    # unshared under each (queries scaled up and a cap of 1: the cap moves the reference beyond the bound)
    seqs = _sequences(seed=2, groups=[(5, 3), (2, 2)], ungrouped=0)
    values = {}
    for base in ("sdpa", "eager"):
        model = build_tiny_model("gemma2", attn_logit_softcapping=1.0)
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_proj.weight.mul_(30.0)
        model.config._attn_implementation = base
        ref = unshared_log_probs(model, seqs)
        assert _rel(shared_log_probs(model, seqs), ref) <= REL, base
        values[base] = ref
    assert _rel(values["sdpa"], values["eager"]) > 1e-3


def test_models_mixing_tokens_outside_attention_are_refused_at_start_up():
    from hilore_verl.integration.actor.shared_prompt import unsupported_model

    model = build_tiny_model("qwen2")
    assert unsupported_model(model) is None
    model.config.layer_types = ["full_attention", "linear_attention"]
    assert "linear_attention layers" in unsupported_model(model)
    model.config.layer_types = None
    model.model.layers[0].self_attn.is_causal = False
    assert "non-causal" in unsupported_model(model)


@pytest.mark.parametrize("seed", range(4))
def test_the_token_count_is_the_row_the_layout_builds(seed):
    """shared_token_count (what the planner sizes a micro-batch by) without building the layout."""
    from hilore_verl.shared_prompt import shared_token_count

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 50, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g) for _ in range(3)]
    sequences = []
    for _ in range(11):
        prompt = prompts[int(torch.randint(0, 3, (1,), generator=g))]
        response = torch.randint(0, 50, (int(torch.randint(0, 7, (1,), generator=g)),), generator=g)
        alone = bool(torch.rand(1, generator=g) < 0.2)
        sequences.append((None if alone else tuple(prompt.tolist()), prompt, response))
    layout = SharedLayout.build(sequences)
    assert shared_token_count([(k, p.numel(), r.numel()) for k, p, r in sequences]) == layout.shared_tokens


@pytest.mark.parametrize("seed", range(6))
def test_micro_batches_keep_groups_together_within_verls_bounds(seed):
    """group_micro_batches: every sequence once, every micro-batch within the token limit (or size) and
    non-empty, at least `at_least` of them, and a group that fits one micro-batch is never split."""
    from hilore_verl.shared_prompt.grouping import group_micro_batches

    rng = random.Random(seed)
    groups, n = rng.randint(1, 5), rng.choice([1, 2, 4, 8])
    prompt = {g: rng.randint(1, 40) for g in range(groups)}
    keys, lengths, prompts = [], [], []
    for g in range(groups):
        for _ in range(n):
            keys.append(None if rng.random() < 0.1 else g)
            prompts.append(prompt[g])
            lengths.append(prompt[g] + rng.randint(0, 30))
    order = list(range(len(keys)))
    rng.shuffle(order)  # scattered, as verl's trainer can hand them
    keys, lengths, prompts = ([xs[i] for i in order] for xs in (keys, lengths, prompts))
    limit = max(lengths) + rng.randint(0, 150)
    for bound in ({"max_tokens": limit}, {"size": rng.randint(1, 6)}):
        at_least = rng.randint(1, 3)
        parts = group_micro_batches(keys, lengths, prompts, at_least, **bound)
        if parts is None:  # only when there are too few sequences for at_least micro-batches
            assert len(keys) < at_least + 1 or "size" in bound
            continue
        assert sorted(i for p in parts for i in p) == list(range(len(keys))) and all(parts)
        assert len(parts) >= at_least
        for p in parts:
            assert (sum(lengths[i] for i in p) <= limit) if "max_tokens" in bound else len(p) <= bound["size"]
        for g in range(groups):
            members = [i for i, k in enumerate(keys) if k == g]
            whole = sum(lengths[i] for i in members) if "max_tokens" in bound else len(members)
            if members and whole <= next(iter(bound.values())) and len(parts) <= len({k for k in keys}):
                assert sum(any(i in p for i in members) for p in parts) == 1, (g, parts)


def test_a_split_that_cannot_fill_the_micro_batches_is_refused():
    from hilore_verl.shared_prompt.grouping import group_micro_batches

    assert group_micro_batches([1, 1], [5, 5], [2, 2], at_least=3, max_tokens=100) is None
    assert group_micro_batches([1, 1, 2], [5, 5, 5], [2, 2, 2], at_least=3, max_tokens=100) == [[0], [1], [2]]
    with pytest.raises(ValueError, match="longer than max_tokens"):
        group_micro_batches([1], [50], [2], max_tokens=10)


def test_a_group_is_shared_only_where_the_saved_tokens_outweigh_its_attention_square():
    """ShareRule on the bench's model shape: a one-token prompt before long responses (P -> 0) is laid out
    as before; a long prompt, or the default workload's, is shared; the count follows the rule."""
    from hilore_verl.shared_prompt import ShareRule, shared_token_count

    rule = ShareRule.of(build_tiny_model("qwen2"))
    assert rule.flops_per_token > 0 and rule.flops_per_pair > 0
    assert not rule.pays(1, [96] * 8) and not rule.pays(40, [5])
    assert rule.pays(512, [128] * 8)
    wide = ShareRule(flops_per_token=8e6, flops_per_pair=2048.0)  # the bench's default model, about
    assert wide.pays(48, [96] * 8) and not wide.pays(1, [96] * 8)
    g = torch.Generator().manual_seed(0)
    for prompt_len, paid in ((1, False), (600, True)):
        prompt = torch.randint(0, 50, (prompt_len,), generator=g)
        sequences = [(0, prompt, torch.randint(0, 50, (40,), generator=g)) for _ in range(4)]
        layout = SharedLayout.build(sequences, rule=rule)
        assert (layout.shared_tokens < layout.unshared_tokens) == paid == rule.pays(prompt_len, [40] * 4)
        assert shared_token_count([(k, p.numel(), r.numel()) for k, p, r in sequences], rule) == layout.shared_tokens


@pytest.mark.parametrize("case", ["plain", "grouped_heads_window", "softcap"])
def test_the_flex_kernel_computes_what_the_per_segment_path_does(case):
    """shared_prompt/flex.py's block mask (the CUDA kernel) against the per-segment SDPA path, forward on the
    CPU (FlexAttention has no CPU backward; `hilore-verl gpu-check` runs both directions on CUDA)."""
    from hilore_verl.shared_prompt.attention import shared_prompt_attention
    from hilore_verl.shared_prompt.flex import flex_shared_attention

    g = torch.Generator().manual_seed(len(case))
    sequences = []
    for gid, (prompt_len, responses) in enumerate([(7, [5, 9, 3]), (1, [6]), (12, [4, 4])]):
        prompt = torch.randint(0, 50, (prompt_len,), generator=g)
        sequences += [(gid, prompt, torch.randint(0, 50, (r,), generator=g)) for r in responses]
    sequences.append((None, torch.randint(0, 50, (3,), generator=g), torch.randint(0, 50, (5,), generator=g)))
    layout = SharedLayout.build(sequences)
    kv_heads = 2 if case == "grouped_heads_window" else 4
    window = 6 if case == "grouped_heads_window" else None
    softcap = 3.0 if case == "softcap" else None
    length = layout.shared_tokens
    q = torch.randn(1, 4, length, 16, generator=g)
    k, v = (torch.randn(1, kv_heads, length, 16, generator=g) for _ in range(2))
    module = torch.nn.Module()
    reference, _ = shared_prompt_attention(module, q, k, v, layout, scaling=0.3, sliding_window=window,
                                           softcap=softcap)  # [1, L, H, D]: per segment on the CPU
    out = flex_shared_attention(q, k, v, layout, 0.3, window, softcap, compiled=False).transpose(1, 2)
    assert out.shape == reference.shape and float((out - reference).abs().max()) <= 1e-5


def test_a_flex_failure_is_said_once_and_the_per_segment_path_serves(monkeypatch, caplog):
    """On CUDA the attention runs FlexAttention; if it raises (e.g. no compiler), one warning, the
    per-segment path computes the same output, and the process stays on it."""
    from hilore_verl.shared_prompt import attention

    assert attention.kernel_on("cpu") == "sdpa" and attention.kernel_on("cuda") == "flex"
    layout = SharedLayout.build([(0, torch.tensor([1, 2, 3]), torch.tensor([4, 5])),
                                 (0, torch.tensor([1, 2, 3]), torch.tensor([6]))])
    q, k, v = (torch.randn(1, 2, layout.shared_tokens, 8) for _ in range(3))
    reference, _ = attention.shared_prompt_attention(torch.nn.Module(), q, k, v, layout)
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(attention, "flex_shared_attention", broken)
    monkeypatch.setattr(attention, "_FLEX_FAILED", [])
    monkeypatch.setattr(attention, "kernel_on", lambda device: "sdpa" if attention._FLEX_FAILED else "flex")
    with caplog.at_level(logging.WARNING):
        first, _ = attention.shared_prompt_attention(torch.nn.Module(), q, k, v, layout)
        again, _ = attention.shared_prompt_attention(torch.nn.Module(), q, k, v, layout)
    assert torch.equal(first, reference) and torch.equal(again, reference) and len(calls) == 1
    assert sum("FlexAttention failed" in r.getMessage() for r in caplog.records) == 1


def test_the_compiled_block_mask_build_gives_the_eager_builds_mask():
    """On an accelerator the block mask is built compiled (no L x L boolean): the same block mask as the
    eager build, for two layouts of different lengths (one compiled kernel, dynamic in the length)."""
    from hilore_verl.shared_prompt.flex import block_mask

    g = torch.Generator().manual_seed(0)
    for groups in ([(70, [50, 90, 30]), (1, [60])], [(200, [40, 40, 130]), (12, [300])]):
        sequences = []
        for gid, (prompt_len, responses) in enumerate(groups):
            prompt = torch.randint(0, 50, (prompt_len,), generator=g)
            sequences += [(gid, prompt, torch.randint(0, 50, (r,), generator=g)) for r in responses]
        for window in (None, 64):
            eager = block_mask(SharedLayout.build(sequences), window, torch.device("cpu"), compiled=False)
            compiled = block_mask(SharedLayout.build(sequences), window, torch.device("cpu"), compiled=True)
            tensors = [(a, b) for a, b in zip(eager.as_tuple(), compiled.as_tuple()) if isinstance(a, torch.Tensor)]
            assert tensors and all(torch.equal(a, b) for a, b in tensors)
