"""Unit maps per model family (unit_maps.py) on tiny random models of every family verl users train.

For each family: the units its map declares, every keep / recompute mix bitwise equal to the plain
model, all-int8 gradients close, the share of saved bytes outside units small, and no more held
after `attach` with every unit recomputed than Hugging Face gradient checkpointing held. Tests run
with one thread (`OMP_NUM_THREADS=1`, as `make test` sets it); no family needed more pinning.
A block the runtime cannot map completely is refused, and the model is left as it was.
"""

import copy
import gc
import random

import pytest
import torch
import torch.nn as nn

import hilore_verl
from hilore_verl import Plan
from hilore_verl.planner import profile
from hilore_verl.tiny.models import FAMILIES, build_tiny_model
from hilore_verl.model.unit_maps import MAPS, UnitSpec, register_map
from hilore_verl.tiny.workload import make_grpo_batch
from hilore_verl.tiny.workload import response_log_probs
from tests.harness.models import WORKLOAD, cosine_and_rel_error, policy_gradient_step

PRE_NORM = ["attn.norm", "attn.proj", "attn.core", "mlp.norm", "mlp.proj", "mlp.act"]
POST_NORM = ["attn.proj", "attn.core", "attn.norm", "mlp.proj", "mlp.act", "mlp.norm"]
MOE = ["attn.norm", "attn.proj", "attn.core", "mlp.norm", "mlp.router", "mlp.experts", "mlp.act"]
MOE_SHARED = MOE[:-1] + ["mlp.shared", "mlp.act"]
# family -> units of layer 0 and layer 1 (the tiny MoE models have a dense first layer where the family allows one)
EXPECTED = {
    **{f: [PRE_NORM, PRE_NORM] for f in ("qwen2", "qwen3", "llama", "mistral", "phi3", "gemma2", "gemma3")},
    "olmo2": [POST_NORM, POST_NORM],
    "qwen3_moe": [PRE_NORM, MOE],
    "mixtral": [MOE, MOE],
    "gpt_oss": [MOE, MOE],
    "granitemoe": [MOE, MOE],
    "deepseek_v3": [PRE_NORM, MOE_SHARED],
}
MANAGED = hilore_verl.RuntimeConfig(min_bytes=1024)  # the tiny models' tensors at sizes the runtime manages


EXPERT_COUNTS = {"qwen3_moe": "num_experts", "mixtral": "num_local_experts", "gpt_oss": "num_local_experts",
                 "granitemoe": "num_local_experts", "deepseek_v3": "n_routed_experts"}


def second_shape(family) -> dict:
    """Hidden 256 over 2 query heads and 1 KV head (DeepSeek-V3's MLA: as many as queries), MoE families
    8 experts with 1 per token: the residual stream is large against a layer's other saves. At this
    shape DeepSeek-V3, Qwen3 and Qwen3-MoE had 22-23% of saved bytes outside units before a unit
    adopted the inputs its calls save (docs/benchmarks/unit_maps_cpu.md)."""
    shape = dict(hidden_size=256, num_attention_heads=2, num_key_value_heads=2 if family == "deepseek_v3" else 1)
    if family in EXPERT_COUNTS:
        shape.update({EXPERT_COUNTS[family]: 8, "num_experts_per_tok": 1})
    return shape


def _model(family, **overrides):
    return build_tiny_model(family, seed=0, **overrides).train()


def test_every_family_has_a_test_and_every_map_is_valid():
    assert set(EXPECTED) == set(FAMILIES)
    for model_type, units in MAPS.items():
        register_map(model_type, units)  # the checks a user's map goes through


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_units_follow_the_family_map(family):
    model = _model(family)
    rt = hilore_verl.attach(model)
    for i, expected in enumerate(EXPECTED[family]):
        layer = [u for u in rt.units if u.layer_index == i]
        assert [u.name.split(".", 2)[-1] for u in layer] == expected, (i, [u.name for u in layer])
        block = model.model.layers[i]
        owned = {id(m) for u in layer for m in u.modules}
        for name, _ in block.named_parameters():  # every parameter sits under a unit's module
            parts = name.split(".")[:-1]
            assert any(id(block.get_submodule(".".join(parts[:k]))) in owned for k in range(len(parts), 0, -1)), name
        by_name = {u.name.split(".", 2)[-1]: u for u in layer}
        assert all("norm" in type(m).__name__.lower() for m in by_name["attn.norm"].modules + by_name["mlp.norm"].modules)
        if "mlp.experts" in by_name:
            assert all(p.shape[0] == 4 for m in by_name["mlp.experts"].modules for p in m.parameters()), family  # per expert
            assert by_name["mlp.router"].kind == "router" and by_name["mlp.experts"].kind == "experts"
    assert rt.units[-1].name == "head"
    groups = {u.group for u in rt.units}
    variants = len({tuple(e) for e in EXPECTED[family]})
    assert any("/v1" in g for g in groups) == (variants > 1), groups


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_keep_and_recompute_mixes_are_bitwise_exact(family):
    ref = _model(family)
    loss0, grads0 = policy_gradient_step(ref)
    model = copy.deepcopy(ref)
    rt = hilore_verl.attach(model, MANAGED)
    rng = random.Random(3)
    plans = [{}, {"layers": "recompute", "head": "recompute"}, {"layers.0": "recompute"}]
    plans += [{u.name: rng.choice(["keep", "recompute"]) for u in rt.units} for _ in range(3)]
    for plan in plans:
        rt.set_plan(plan)
        loss, grads = policy_gradient_step(model)
        assert torch.equal(loss, loss0), plan
        assert all(torch.equal(grads[n], g) for n, g in grads0.items()), plan


def _all_int8(family):
    """Every unit in int8 (default min_bytes): gradient cosine and relative error, and the runtime's stats."""
    ref = _model(family)
    _, grads0 = policy_gradient_step(ref)
    model = copy.deepcopy(ref)
    rt = hilore_verl.attach(model)
    rt.set_plan(Plan(default="int8"))
    _, grads = policy_gradient_step(model)
    return (*cosine_and_rel_error(grads, grads0), rt.stats())


def _all_keep_stats(family, **overrides):
    model = _model(family, **overrides)
    rt = hilore_verl.attach(model, MANAGED)
    policy_gradient_step(model)
    return rt, rt.stats()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_unit_in_int8_keeps_the_gradient_close(family):
    cos, rel, stats = _all_int8(family)
    print(f"{family}: int8 cosine {cos:.6f}, rel {rel:.4f}, stored/saved {stats.stored_bytes / stats.saved_bytes:.3f}")
    assert cos >= 0.999 and 0 < rel, (cos, rel)
    assert stats.stored_bytes < 0.6 * stats.saved_bytes  # it did compress


def _outside_share(stats) -> float:
    return stats.unmanaged_bytes / (stats.unmanaged_bytes + stats.saved_bytes)


@pytest.mark.parametrize("second", [False, True], ids=["tiny", "second_shape"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_little_of_what_the_forward_saves_is_outside_units(family, second):
    _, stats = _all_keep_stats(family, **(second_shape(family) if second else {}))
    share = _outside_share(stats)
    print(f"{family}: outside units {share:.3f} of saved bytes; index tensors {stats.index_bytes} bytes")
    assert share <= 0.20, share
    if "mlp.router" in EXPECTED[family][-1]:
        assert stats.index_bytes > 0  # routing indices are counted


def test_inputs_made_outside_units_go_by_the_plan_of_the_unit_that_saves_them():
    """In fp32 a norm saves its input, the residual stream, made by no unit: it is the norm's, compressed
    under int8 and, under recompute, saved again by the norm's re-run (bitwise the plain model)."""
    shape = second_shape("deepseek_v3")
    ref = _model("deepseek_v3", **shape)
    loss0, grads0 = policy_gradient_step(ref)
    model = copy.deepcopy(ref)
    rt = hilore_verl.attach(model, MANAGED)
    norms = [u.name for u in rt.units if u.kind == "norm"]
    outside = {}
    for mode in ("keep", "int8", "recompute"):
        rt.set_plan({n: mode for n in norms})
        loss, grads = policy_gradient_step(model)
        stats = rt.stats()
        outside[mode] = stats.unmanaged_bytes
        if mode == "int8":
            assert all(stats.units[n].stored_bytes < 0.5 * stats.units[n].saved_bytes for n in norms), stats.table()
        else:
            assert torch.equal(loss, loss0) and all(torch.equal(grads[n], g) for n, g in grads0.items()), mode
    assert all(stats.units[n].saved_bytes > 0 and stats.units[n].stored_bytes == 0 for n in norms), stats.table()
    assert outside["int8"] == outside["keep"] == outside["recompute"] < 0.05 * stats.saved_bytes, outside


def _held_after_forward(model) -> int:
    """Bytes allocated by the forward and still alive when it returns (logits included), from the profiler."""
    batch = make_grpo_batch(WORKLOAD, seed=0)
    gc.collect()
    gc.disable()  # a collection inside the window would free older tensors and count them against the forward
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            output = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                           position_ids=batch["position_ids"], use_cache=False)
    finally:
        gc.enable()
    held = sum(e.self_cpu_memory_usage for e in prof.events())
    del output  # alive until the profiler stopped: the graph's saved tensors were counted
    return held


def _held_by_checkpointing(family) -> tuple[int, int, int]:
    """Held after the forward: no checkpointing, HF checkpointing, then attached with every unit recomputed."""
    model = _model(family)
    plain = _held_after_forward(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    hf = _held_after_forward(model)
    rt = hilore_verl.attach(model, MANAGED)
    rt.set_plan({u.name: "recompute" for u in rt.units})
    return plain, hf, _held_after_forward(model)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_attach_never_holds_more_than_hf_checkpointing_held(family):
    plain, hf, ours = _held_by_checkpointing(family)
    assert 0 < hf < plain, (hf, plain)  # the measure sees what checkpointing saves
    print(f"{family}: held after the forward: HF checkpointing {hf} B, all units recomputed {ours} B")
    assert ours <= hf, (ours, hf)


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_moe"])
def test_dense_and_moe_layers_are_profiled_each_as_their_own(family):
    model = _model(family)
    rt = hilore_verl.attach(model, MANAGED)
    batch = make_grpo_batch(WORKLOAD, seed=0)

    def run():
        model.zero_grad(set_to_none=True)
        response_log_probs(model, batch).sum().backward()

    costs = profile(rt, run, int(batch["attention_mask"].numel()), element_size=4)
    by_name = {u.name: u for u in costs.units}
    # layer 0's MLP is dense, layer 1's is MoE: their "mlp.act" are different code, measured apart
    assert rt.units[5].group == "mlp.act" and [u.group for u in rt.units if u.name == "layers.1.mlp.act"] == ["mlp.act/v1"]
    assert by_name["layers.0.mlp.act"].saved_bytes != by_name["layers.1.mlp.act"].saved_bytes
    assert all(u.forward_s > 0 and u.saved_bytes >= 0 for u in costs.units)


# ---------------------------------------------------------------------- refusal, never a wrong map
def _with_extra_child(model, kind=nn.Linear):
    for block in model.model.layers:
        block.extra = kind(64, 64)
    return model


def test_a_block_the_map_does_not_cover_is_refused_and_the_model_left_alone():
    model = _with_extra_child(_model("qwen2"))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    hooks = [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in model.modules()]
    with pytest.raises(ValueError) as err:
        hilore_verl.attach(model)
    message = str(err.value)
    for part in ("Qwen2DecoderLayer", "layers.0", "extra.weight", "extra: Linear", "register_map", "model_type 'qwen2'"):
        assert part in message, (part, message)
    assert all(block.gradient_checkpointing for block in model.model.layers)  # HF checkpointing untouched
    assert hooks == [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in model.modules()]


def test_a_model_type_without_a_map_is_guessed_and_proven_or_refused(monkeypatch):
    model = _model("qwen2")
    monkeypatch.setattr(model.config, "model_type", "unmapped")
    rt = hilore_verl.attach(model)  # the guess finds every part and covers every parameter
    assert [u.name for u in rt.units[:6]] == [f"layers.0.{n}" for n in PRE_NORM]
    rt.detach()
    odd = _with_extra_child(_model("qwen2"))
    monkeypatch.setattr(odd.config, "model_type", "unmapped")
    with pytest.raises(ValueError, match="a map guessed from child names.*extra.weight"):
        hilore_verl.attach(odd)


def test_a_declared_map_that_fits_is_used_and_a_unit_that_never_runs_is_refused_at_profiling(monkeypatch):
    model = _with_extra_child(_model("qwen2"))  # `extra` has parameters but the block never calls it
    monkeypatch.setitem(MAPS, "qwen2", [*MAPS["qwen2"], UnitSpec("extra", "proj", ("extra",))])
    rt = hilore_verl.attach(model, MANAGED)
    assert "layers.0.extra" in [u.name for u in rt.units]
    batch = make_grpo_batch(WORKLOAD, seed=0)

    def run():
        model.zero_grad(set_to_none=True)
        response_log_probs(model, batch).sum().backward()

    with pytest.raises(ValueError, match="layers.0.extra, layers.1.extra never ran.*Qwen2DecoderLayer"):
        profile(rt, run, int(batch["attention_mask"].numel()), element_size=4)


def test_register_map_checks_names_and_kinds():
    with pytest.raises(ValueError, match="names a unit twice"):
        register_map("x", [UnitSpec("a", "norm", ("n",)), UnitSpec("a", "norm", ("m",))])
    with pytest.raises(ValueError, match="unknown kinds"):
        register_map("x", [UnitSpec("a", "layernorm", ("n",))])
    assert "x" not in MAPS


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_analytic_model_saves_what_the_family_saves(family):
    """`hilore-verl plan`'s meta-device model against the real one in bf16: per unit, saved bytes within
    5% (attention's core aside: the analytic model prices a fused kernel's saves). GraniteMoE's router
    runs as its even-split stand-in; Gemma-2's final soft-cap is the head's in both."""
    from hilore_verl.planner.analytic import analytic_costs
    from hilore_verl.tiny.models import tiny_config

    tokens = 64
    config = tiny_config(family)
    analytic = analytic_costs(config, tokens=tokens, seq_len=tokens, dtype=torch.bfloat16)
    model = build_tiny_model(family, seed=0, dtype=torch.bfloat16).train()
    rt = hilore_verl.attach(model, hilore_verl.RuntimeConfig(min_bytes=0))
    rt.set_plan({u.name: "keep" for u in rt.units})
    ids = torch.randint(3, config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids).logits.float().sum().backward()
    measured = rt.stats().units
    assert [u.name for u in analytic.units] == list(measured)
    for unit in analytic.units:
        if "attn.core" not in unit.name:
            assert unit.saved_bytes == pytest.approx(measured[unit.name].saved_bytes, rel=0.05), unit.name


COHERE_MAP = [UnitSpec("attn.norm", "norm", ("input_layernorm",)),  # one norm feeds attention and MLP alike
              UnitSpec("attn.proj", "proj", tuple(f"self_attn.{p}_proj" for p in "qkvo")),
              UnitSpec("attn.core", "attn_core", ("self_attn",)),
              UnitSpec("mlp.proj", "proj", ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")),
              UnitSpec("mlp.act", "act", ("mlp",))]


def test_a_family_without_a_map_is_refused_until_the_user_registers_one():
    """Cohere's parallel block (one norm, attention and MLP side by side) defeats the name guess; a
    map registered with `register_map` makes it a managed family, exactly."""
    from transformers import AutoModelForCausalLM, CohereConfig

    config = CohereConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                          attn_implementation="sdpa")
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(config).train()
    with pytest.raises(ValueError, match="CohereDecoderLayer .* no module found for mlp.norm.*register_map"):
        hilore_verl.attach(copy.deepcopy(ref))
    loss0, grads0 = policy_gradient_step(ref)
    register_map("cohere", COHERE_MAP)
    try:
        for plan in ({"layers": "recompute"}, {"layers.0": "recompute", "layers.1.attn": "recompute", "head": "recompute"},
                     {"layers.1.mlp.act": "recompute", "layers.0.attn.norm": "recompute"}):
            model = copy.deepcopy(ref)
            rt = hilore_verl.attach(model)
            rt.set_plan(plan)
            loss, grads = policy_gradient_step(model)
            assert torch.equal(loss, loss0) and all(torch.equal(grads[n], g) for n, g in grads0.items()), plan
            stats = rt.stats()
            assert stats.unmanaged_bytes <= 0.2 * (stats.unmanaged_bytes + stats.saved_bytes)
            rt.detach()
    finally:
        MAPS.pop("cohere")


# ---------------------------------------------------------------------- LoRA (peft, as verl applies it)
def _lora_model(family="qwen2"):
    import peft

    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0, init_lora_weights=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return peft.get_peft_model(_model(family), config)


def _lora_step(model):
    """-(w * log p) summed; the gradients of the trainable (adapter) parameters."""
    batch = make_grpo_batch(WORKLOAD, seed=0)
    model.zero_grad(set_to_none=True)
    weights = torch.randn(batch["responses"].shape, generator=torch.Generator().manual_seed(1))
    loss = -(response_log_probs(model, batch) * weights).sum()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("family", ["qwen2", "phi3", "mixtral"])
def test_lora_wrapped_projections_are_projection_units_and_exact(family, monkeypatch):
    ref = _lora_model(family)
    loss0, grads0 = _lora_step(ref)
    model = copy.deepcopy(ref)
    frozen = {p.untyped_storage().data_ptr() for p in model.parameters() if not p.requires_grad}
    seen = []
    real = hilore_verl.runtime.saving.quantize
    monkeypatch.setattr(hilore_verl.runtime.saving, "quantize", lambda t, *a, **k: seen.append(t) or real(t, *a, **k))
    rt = hilore_verl.attach(model, MANAGED)
    proj = {u.name: u for u in rt.units}["layers.0.attn.proj"]
    assert proj.modules and all(hasattr(m, "base_layer") and hasattr(m, "lora_A") for m in proj.modules)
    for plan in [{}, {"layers": "recompute", "head": "recompute"}, {"layers.0.attn.proj": "recompute"}]:
        rt.set_plan(plan)
        loss, grads = _lora_step(model)
        assert torch.equal(loss, loss0) and all(torch.equal(grads[n], g) for n, g in grads0.items()), plan
    rt.set_plan({u.name: "int8" for u in rt.units if u.kind == "proj"})
    _lora_step(model)
    assert seen and not any(t.untyped_storage().data_ptr() in frozen for t in seen)  # base weights never compressed


def table() -> str:
    """The measured figures per family, as docs/benchmarks/unit_maps_cpu.md shows them."""
    rows = ["| family | units (layer 0 / 1) | int8 cosine | outside units | outside, second shape | index tensors "
            "| HF GC held | all recompute held |", "|---|---|---|---|---|---|---|---|"]
    for family in sorted(FAMILIES):
        cos, _, _ = _all_int8(family)
        rt, stats = _all_keep_stats(family)
        second = _outside_share(_all_keep_stats(family, **second_shape(family))[1])
        counts = " / ".join(str(sum(u.layer_index == i for u in rt.units)) for i in (0, 1))
        _, hf, ours = _held_by_checkpointing(family)
        rows.append(f"| {family} | {counts} | {cos:.6f} | {_outside_share(stats):.1%} | {second:.1%} | "
                    f"{stats.index_bytes} B | {hf / 2**20:.2f} MiB | {ours / 2**20:.2f} MiB |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(table())
