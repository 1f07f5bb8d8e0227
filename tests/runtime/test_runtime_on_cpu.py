"""The recovery-unit runtime on plain models: exact modes bitwise, lossy modes within bounds, bookkeeping."""

import copy
import logging
import random

import pytest
import torch

import hilore_verl
from hilore_verl import Plan, UnitPlan, attach
from hilore_verl.runtime import Mode
from hilore_verl.tiny.models import build_tiny_model
from hilore_verl.tiny.workload import make_grpo_batch
from tests.harness.models import WORKLOAD, cosine_and_rel_error, policy_gradient_step

FAMILIES = ["qwen2", "llama"]
DTYPES = [torch.float32, torch.bfloat16]


def _model(family, dtype=torch.float32, **overrides):
    return build_tiny_model(family, seed=0, dtype=dtype, **overrides).train()


def _random_exact_plans(units, count, seed):
    rng = random.Random(seed)
    return [{u.name: rng.choice(["keep", "recompute"]) for u in units} for _ in range(count)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("family", FAMILIES)
def test_keep_and_recompute_mixes_are_bitwise_exact(family, dtype):
    ref = _model(family, dtype)
    loss0, grads0 = policy_gradient_step(ref)
    model = copy.deepcopy(ref)
    rt = attach(model)
    plans = [{}, {"layers": "recompute", "head": "recompute"},
             {f"layers.{i}.{sub}": "recompute" for i in range(2) for sub in ("attn.norm", "mlp.norm", "mlp.act")},
             {"layers.0.attn.core": "recompute", "layers.1.mlp.proj": "recompute"},
             *_random_exact_plans(rt.units, 4, seed=7)]
    for plan in plans:
        rt.set_plan(plan)
        loss, grads = policy_gradient_step(model)
        assert torch.equal(loss, loss0), plan
        for name, g in grads0.items():
            assert torch.equal(grads[name], g), (plan, name)
        recomputed = [n for n, u in rt.stats().units.items() if u.mode == "recompute" and u.saved_bytes]
        assert all(rt.stats().units[n].stored_bytes == 0 for n in recomputed if "proj" not in n)


def test_recompute_restores_the_rng_state_under_dropout():
    ref = _model("llama", attention_dropout=0.3)
    loss0, grads0 = policy_gradient_step(ref, seed=5)
    model = copy.deepcopy(ref)
    rt = attach(model)
    rt.set_plan({"layers": "recompute"})
    loss, grads = policy_gradient_step(model, seed=5)
    assert torch.equal(loss, loss0) and all(torch.equal(grads[n], g) for n, g in grads0.items())


# Every unit compressed, Qwen2 / Llama, fp32 / bf16. Measured: int8 cos >= 0.99997, rel <= 0.0065;
# fp8 cos >= 0.99978, rel <= 0.021; int4 cos >= 0.9963, rel <= 0.087. Bounds leave about 2x room.
LOSSY_BOUNDS = {"int8": (0.999, 0.015), "fp8": (0.999, 0.04), "int4": (0.99, 0.15)}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("fmt", ["int8", "fp8", "int4"])
def test_compressing_every_unit_stays_within_bounds(fmt, family, dtype):
    ref = _model(family, dtype)
    _, grads0 = policy_gradient_step(ref)
    model = copy.deepcopy(ref)
    rt = attach(model)
    rt.set_plan(Plan(default=fmt))
    _, grads = policy_gradient_step(model)
    cos, rel = cosine_and_rel_error(grads, grads0)
    min_cos, max_rel = LOSSY_BOUNDS[fmt]
    assert cos >= min_cos and rel <= max_rel, (cos, rel)
    assert rel > 0  # it did compress
    code_bytes = 0.5 if fmt == "int4" else 1.0
    element = torch.tensor([], dtype=dtype).element_size()  # some saved tensors are fp32 even in bf16 models
    for name, unit in rt.stats().units.items():
        if unit.nonfinite == 0:  # the attention core also saves the -inf causal mask, which stays exact
            assert unit.stored_bytes <= unit.saved_bytes * (code_bytes + 5 / 64) / element, name


@pytest.mark.parametrize("group_size", [64, 128])
def test_a_hidden_size_the_group_does_not_divide_compresses_with_a_group_that_fits(group_size):
    # hidden 96: rows of 96 fit neither 64 nor 128; the saved tensors compress with groups over their flat
    # elements or, where those do not fit either, with 32 (SavedTensors._quantize), never a failed plan
    ref = _model("qwen2", hidden_size=96)
    _, grads0 = policy_gradient_step(ref)
    model = copy.deepcopy(ref)
    rt = attach(model)
    rt.set_plan(Plan(default=UnitPlan(Mode.COMPRESS, fmt="int8", group_size=group_size)))
    _, grads = policy_gradient_step(model)
    cos, rel = cosine_and_rel_error(grads, grads0)
    min_cos, max_rel = LOSSY_BOUNDS["int8"]
    assert cos >= min_cos and 0 < rel <= max_rel, (cos, rel)
    units = [u for u in rt.stats().units.values() if u.saved_bytes and not u.nonfinite]
    assert units  # codes (1 byte per fp32 element) and a scale and a flag per group of at least 32
    assert all(0 < u.stored_bytes <= u.saved_bytes * (1 + 5 / 32) / 4 for u in units), units


def _independent_saved_bytes(model):
    """Every float, non-parameter tensor the model's forward saves, once per distinct view (all kept alive)."""
    seen, sizes = set(), []

    def pack(t):
        if t.is_nested or not t.is_floating_point() or isinstance(t, torch.nn.Parameter) \
                or isinstance(t._base, torch.nn.Parameter):
            return t
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        if key not in seen:
            seen.add(key)
            sizes.append(t.numel() * t.element_size())
        return t

    batch = make_grpo_batch(WORKLOAD, seed=0)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
              position_ids=batch["position_ids"], use_cache=False)
    return sum(sizes)


def test_stats_match_an_independent_count_and_the_formats():
    model = _model("qwen2")
    independent = _independent_saved_bytes(model)
    rt = attach(model)
    policy_gradient_step(model)
    keep = rt.stats()
    assert keep.saved_bytes + keep.unmanaged_bytes == independent
    assert keep.stored_bytes == keep.saved_bytes and keep.parameter_saves > 0
    for fmt, code_bytes in (("int8", 1.0), ("fp8", 1.0), ("int4", 0.5)):
        rt.set_plan(Plan(default=fmt))
        policy_gradient_step(model)
        stats = rt.stats()
        assert stats.saved_bytes == keep.saved_bytes
        assert {n for n, u in stats.units.items() if u.nonfinite} == {"layers.0.attn.core", "layers.1.attn.core"}
        for name, unit in stats.units.items():
            if unit.nonfinite:
                continue  # the attention core saves the causal mask (-inf): kept exact
            numel = unit.saved_bytes // 4  # fp32
            expected = numel * code_bytes + numel // 64 * 5  # codes + an fp32 scale and a flag byte per 64
            assert unit.stored_bytes == expected, (fmt, name, unit)


def test_parameters_never_reach_a_codec(monkeypatch):
    model = _model("llama")
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = []
    real = hilore_verl.runtime.saving.quantize

    def spy(t, *args, **kwargs):
        seen.append(t)
        return real(t, *args, **kwargs)

    monkeypatch.setattr(hilore_verl.runtime.saving, "quantize", spy)
    rt = attach(model)
    rt.set_plan(Plan(default="int8"))
    policy_gradient_step(model)
    assert seen
    assert not any(isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter) for t in seen)
    assert not any(t.untyped_storage().data_ptr() in params for t in seen)


def test_plan_swap_changes_behaviour_without_reattaching():
    ref = _model("qwen2")
    _, grads0 = policy_gradient_step(ref)
    model = copy.deepcopy(ref)
    rt = attach(model)
    hooks = len(rt._installed.handles)
    rt.set_plan({"layers": "int8"})
    _, lossy = policy_gradient_step(model)
    rt.set_plan({"layers": "recompute"})
    _, exact = policy_gradient_step(model)
    assert len(rt._installed.handles) == hooks
    assert not all(torch.equal(lossy[n], g) for n, g in grads0.items())
    assert all(torch.equal(exact[n], g) for n, g in grads0.items())
    assert rt.stats().units["layers.1.mlp.act"].mode == "recompute"


def test_detach_leaves_the_model_as_before():
    ref = _model("qwen2")
    loss0, grads0 = policy_gradient_step(ref)
    model = copy.deepcopy(ref)
    rt = attach(model)
    rt.set_plan({"layers": "int8", "head": "recompute"})
    policy_gradient_step(model)
    rt.detach()
    assert all(not m._forward_hooks and not m._forward_pre_hooks and "forward" not in m.__dict__
               for m in model.modules())
    loss, grads = policy_gradient_step(model)
    assert torch.equal(loss, loss0) and all(torch.equal(grads[n], g) for n, g in grads0.items())
    attach(model).detach()  # attachable again


def test_hf_gradient_checkpointing_is_taken_over_and_restored(caplog):
    model = _model("qwen2")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with caplog.at_level(logging.WARNING, logger="hilore_verl"):
        rt = attach(model)
    assert "turned off Hugging Face gradient checkpointing on 2 decoder layers" in caplog.text
    assert not any(getattr(m, "gradient_checkpointing", False) for m in model.model.layers)
    rt.detach()
    assert all(m.gradient_checkpointing for m in model.model.layers)


def test_offload_gives_the_same_result_as_in_place_compression():
    model = _model("qwen2")
    rt = attach(model)
    rt.set_plan({"layers": UnitPlan(Mode.COMPRESS, fmt="int8")})
    _, in_place = policy_gradient_step(model)
    rt.set_plan({"layers": UnitPlan(Mode.COMPRESS, fmt="int8", offload=True)})
    _, offloaded = policy_gradient_step(model)
    assert all(torch.equal(offloaded[n], g) for n, g in in_place.items())
    pool = rt.saving.pools[torch.device("cpu")]
    allocated = pool.allocated
    assert allocated > 0
    _, again = policy_gradient_step(model)  # the second step reuses the host buffers of the first
    assert pool.allocated == allocated
    assert all(torch.equal(again[n], g) for n, g in in_place.items())


def test_non_finite_tensors_are_kept_exact_and_counted():
    model = _model("qwen2")
    rt = attach(model)
    rt.set_plan({"layers.0.mlp.proj": "int8"})
    gate = model.model.layers[0].mlp.gate_proj
    poison = gate.register_forward_hook(lambda mod, args, out: out.index_fill(-1, torch.tensor([3]), float("inf")),
                                        prepend=True)  # before the runtime's hook sees the output
    policy_gradient_step(model)
    poison.remove()
    proj = rt.stats().units["layers.0.mlp.proj"]
    assert proj.nonfinite == 1  # the gate output; the up projection is finite and compressed
    numel_up = proj.saved_bytes // 2 // 4
    assert proj.stored_bytes == numel_up * 4 + numel_up + numel_up // 64 * 5


def test_units_are_named_and_ordered():
    rt = attach(_model("llama"))
    names = [u.name for u in rt.units]
    assert names[:6] == ["layers.0.attn.norm", "layers.0.attn.proj", "layers.0.attn.core",
                         "layers.0.mlp.norm", "layers.0.mlp.proj", "layers.0.mlp.act"]
    assert names[-1] == "head" and len(names) == 13
    assert {u.kind for u in rt.units} == {"norm", "proj", "attn_core", "act", "head"}
    assert [u.layer_index for u in rt.units[:7]] == [0] * 6 + [1]


def test_bad_input_names_the_bad_value_and_leaves_nothing_half_installed():
    model = _model("qwen2", hidden_size=96)
    rt = attach(model)
    with pytest.raises(ValueError, match="unknown unit 'layers.9'; valid: 'layers.<i>' for i in 0..1"):
        rt.set_plan({"layers.9": "keep"})
    with pytest.raises(ValueError, match="unknown mode 'int2'; valid modes: keep, recompute, int8, fp8, int4"):
        rt.set_plan({"layers.0": "int2"})
    assert rt.plan_of("layers.0.attn.norm") == UnitPlan()  # the old plan stands
    with pytest.raises(ValueError, match="already attached"):
        attach(model)
    rt.detach()
    with pytest.raises(ValueError, match="has no `layers` list"):
        attach(torch.nn.Sequential(torch.nn.Linear(4, 4)))


def _logits_and_log_probs(model, rt, batch):
    P = batch["prompts"].shape[1]
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   position_ids=batch["position_ids"], use_cache=False).logits

    def log_probs(logits, responses):  # vocab-sized: the head's largest saved tensors live here
        logp = torch.log_softmax(logits[:, P - 1 : -1].float(), dim=-1)
        return logp.gather(-1, responses[..., None]).squeeze(-1)

    return log_probs(logits, batch["responses"]) if rt is None else rt.call("head", log_probs, logits,
                                                                            batch["responses"])


@pytest.mark.parametrize("mode", ["keep", "recompute", "int8"])
def test_code_after_the_forward_joins_the_head_unit(mode):
    batch = make_grpo_batch(WORKLOAD, seed=0)
    ref = _model("qwen2")
    _logits_and_log_probs(ref, None, batch).sum().backward()
    model = copy.deepcopy(ref)
    rt = attach(model)
    rt.set_plan({"head": mode})
    _logits_and_log_probs(model, rt, batch).sum().backward()
    head = rt.stats().units["head"]
    vocab_bytes = batch["input_ids"].shape[0] * (batch["input_ids"].shape[1] - 24) * 512 * 4  # log_softmax output
    assert head.saved_bytes >= vocab_bytes
    if mode == "int8":
        cos, _ = cosine_and_rel_error({n: p.grad for n, p in model.named_parameters()},
                                      {n: p.grad for n, p in ref.named_parameters()})
        assert cos >= 0.999 and head.stored_bytes < head.saved_bytes / 3
    else:
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters()))
        assert head.stored_bytes == (head.saved_bytes if mode == "keep" else 0)
    with pytest.raises(ValueError, match="unknown unit 'tail'"):
        rt.call("tail", torch.neg, torch.ones(1))


@pytest.mark.parametrize("family", ["qwen3", "mistral"])
def test_other_families_attach_and_recompute_exactly(family):
    ref = _model(family)
    loss0, grads0 = policy_gradient_step(ref)
    model = copy.deepcopy(ref)
    rt = attach(model)
    rt.set_plan({"layers.0": "recompute", "layers.1.attn.core": "recompute", "head": "recompute"})
    loss, grads = policy_gradient_step(model)
    assert torch.equal(loss, loss0) and all(torch.equal(grads[n], g) for n, g in grads0.items())
    assert rt.stats().units["layers.0.attn.core"].stored_bytes == 0


def test_stochastic_rounding_in_a_plan_is_reproducible_from_the_seed():
    ref = _model("qwen2")
    plan = {"layers": UnitPlan(Mode.COMPRESS, fmt="int4", stochastic=True)}
    runs = []
    for seed in (3, 3, 4):
        model = copy.deepcopy(ref)
        rt = attach(model, hilore_verl.RuntimeConfig(seed=seed))
        rt.set_plan(plan)
        runs.append(policy_gradient_step(model)[1])
    assert all(torch.equal(runs[0][n], runs[1][n]) for n in runs[0])
    assert not all(torch.equal(runs[0][n], runs[2][n]) for n in runs[0])
    _, grads0 = policy_gradient_step(ref)
    cos, _ = cosine_and_rel_error(runs[0], grads0)
    assert cos >= 0.99
    assert rt.stats().units["layers.0.mlp.act"].mode == "int4+sr"


@pytest.mark.parametrize("plan", [{"layers": "keep"}, {"layers": "recompute"}, {"layers": "int8"},
                                  {"layers.0": "recompute", "layers.1.mlp": "int4", "head": "recompute"}])
def test_steps_leave_no_tensor_behind(plan):
    """Training steps must not accumulate tensors: a re-run's graph once held its outputs through
    C++ (invisible to Python's collector) and every recomputing step leaked its activations."""
    import gc

    model = build_tiny_model("qwen2").train()
    rt = attach(model, hilore_verl.RuntimeConfig(min_bytes=1024))
    rt.set_plan(plan)

    def live_tensors():
        gc.collect()
        return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))

    counts = []
    for step in range(4):
        ids = torch.randint(1, 512, (1, 60 + step))
        logits = model(ids).logits
        rt.call("head", lambda x: x.float().log_softmax(-1).mean(), logits).backward()
        del logits
        counts.append(live_tensors())
    assert counts[1] == counts[2] == counts[3], counts
    rt.detach()


@pytest.mark.parametrize("kwargs, message", [
    ({"mode": Mode.COMPRESS, "fmt": "int8", "group_size": 64.0}, r"UnitPlan.group_size: got 64.0; valid: an integer"),
    ({"mode": Mode.COMPRESS, "fmt": "int8", "group_size": True}, r"UnitPlan.group_size: got True"),
    ({"group_size": 64.0}, r"UnitPlan.group_size: got 64.0"),
    ({"mode": Mode.COMPRESS, "fmt": "int8", "offload": "no"}, r"UnitPlan.offload: got 'no'; valid: true or false"),
    ({"offload": "no"}, r"UnitPlan.offload: got 'no'"),
    ({"mode": Mode.COMPRESS, "fmt": "int8", "stochastic": 1}, r"UnitPlan.stochastic: got 1; valid: true or false"),
    ({"mode": "int8"}, r"UnitPlan.mode: got 'int8'; valid: a Mode or one of keep, compress, recompute"),
    ({"mode": 1}, r"UnitPlan.mode: got 1"),
    ({"mode": "compress", "fmt": "int3"}, r"unknown compression format 'int3'"),
])
def test_unit_plan_checks_types(kwargs, message):
    with pytest.raises(ValueError, match=message):
        UnitPlan(**kwargs)


def test_unit_plan_takes_a_mode_or_its_string_value():
    assert UnitPlan("compress", "int8") == UnitPlan(Mode.COMPRESS, "int8") and UnitPlan("keep").mode is Mode.KEEP
    assert UnitPlan("recompute").mode is Mode.RECOMPUTE and str(UnitPlan("recompute")) == "recompute"


@pytest.mark.parametrize("kwargs, message", [
    ({"min_bytes": -5}, r"RuntimeConfig.min_bytes: got -5; valid: an integer >= 0"),
    ({"min_bytes": 1024.0}, r"RuntimeConfig.min_bytes: got 1024.0"),
    ({"min_bytes": True}, r"RuntimeConfig.min_bytes: got True"),
    ({"seed": 1.5}, r"RuntimeConfig.seed: got 1.5; valid: an integer"),
    ({"seed": "7"}, r"RuntimeConfig.seed: got '7'"),
])
def test_runtime_config_checks_its_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        hilore_verl.RuntimeConfig(**kwargs)
    assert hilore_verl.RuntimeConfig(min_bytes=0, seed=-3).min_bytes == 0


def test_a_unit_plan_has_one_spelling_that_parses_back_and_compares_equal():
    import itertools

    from hilore_verl.kernels import FORMATS, GROUP_SIZES
    from hilore_verl.runtime import KEEP, RECOMPUTE, Mode, UnitPlan

    plans = [KEEP, RECOMPUTE] + [UnitPlan(Mode.COMPRESS, fmt=f, group_size=g, offload=o, stochastic=s)
                                 for f, g, o, s in itertools.product(FORMATS, GROUP_SIZES, (False, True), (False, True))]
    spellings = [str(p) for p in plans]
    assert len(set(spellings)) == len(plans)  # one spelling each, none shared
    for plan, spelled in zip(plans, spellings):
        assert UnitPlan.parse(spelled) == plan and plan == spelled and hash(plan) == hash(spelled)
        assert f"{plan:>14}" == f"{spelled:>14}"
    assert str(UnitPlan(Mode.COMPRESS, fmt="int8")) == "int8"  # the default group size is left out
    assert str(UnitPlan(Mode.COMPRESS, fmt="int4", group_size=128, offload=True, stochastic=True)) == "int4/g128+sr+offload"
    assert {KEEP: 1}["keep"] == 1 and KEEP != RECOMPUTE and KEEP != "int8" and KEEP != 3
    for other in ("int8/g64", "int8+offload+sr", "int8+sr+sr", "int8/g", "int9", "keep+offload", ""):
        with pytest.raises(ValueError, match="unknown mode"):
            UnitPlan.parse(other)


def test_the_planner_options_carry_unit_plans_at_the_tables_group_size():
    from hilore_verl.planner import CostTable, UnitProfile
    from hilore_verl.runtime import KEEP, RECOMPUTE, UnitPlan

    unit = UnitProfile("layers.0.mlp.act", 1e6, 1e5, 1e-3)
    table = CostTable([unit], tokens=256, unmanaged_bytes=0.0, group_size=128, offload=True, formats=("int8",))
    plans = [o.plan for o in table.options(unit, 256)]
    assert plans == [KEEP, RECOMPUTE, UnitPlan.parse("int8/g128"), UnitPlan.parse("int8/g128+offload")]
    assert all(isinstance(p, UnitPlan) for p in plans)
