"""A training plan (`set_plan(measure=False)`) counts nothing and takes shorter paths through the
saved-tensor hook; what it holds for backward must be what the measured forward holds, save for save."""

import copy

import pytest
import torch

import hilore_verl
from hilore_verl import UnitPlan, attach
from hilore_verl.runtime import Mode
from hilore_verl.runtime.records import Dropped
from hilore_verl.tiny.models import build_tiny_model
from tests.harness.models import policy_gradient_step

PLANS = [
    {},
    {"layers.0": "recompute", "head": "recompute"},
    {"layers.0.attn": "recompute", "layers.1.mlp.proj": "recompute"},  # kept units save recomputed outputs
    {"layers.0.mlp.act": "recompute", "layers.1.attn.core": "recompute", "layers.1.mlp.norm": "recompute"},
    {"layers.0": "int8", "layers.1.attn.core": "recompute"},
    {"layers.1.mlp": UnitPlan(Mode.COMPRESS, fmt="int4", group_size=32), "head": "recompute"},
]


def _holders(rt, model, measure: bool, hands_off: bool = True):
    """(loss, grads, what pack returned for each save in order: holder type and, if dropped, its locator)."""
    held = []
    pack = rt.saving.pack

    def spy(t):
        value = pack(t)
        held.append((type(value).__name__, value.locator if isinstance(value, Dropped) else None))
        return value

    rt.saving.pack = spy
    try:
        loss, grads = policy_gradient_step(model)
    finally:
        del rt.saving.pack
    return loss, grads, held


@pytest.mark.parametrize("plan", PLANS, ids=str)
def test_a_training_forward_holds_what_a_measured_forward_holds(plan):
    model = build_tiny_model("qwen2", seed=0).train()
    rt = attach(model, hilore_verl.RuntimeConfig(min_bytes=1024))
    rt.set_plan(plan)
    loss0, grads0, held0 = _holders(rt, model, measure=True)
    measured = rt.stats()
    assert held0 and measured.saved_bytes > 0
    rt.set_plan(plan, measure=False, hands_off=False)
    loss, grads, held = _holders(rt, model, measure=False)
    assert held == held0
    assert torch.equal(loss, loss0) and all(torch.equal(grads[n], g) for n, g in grads0.items())
    # nothing counted: stats() still describes the measured forward
    assert rt.stats() is measured and rt.stats().saved_bytes == measured.saved_bytes
    with rt.measured():  # a report's count of what the training plan holds: the same bytes
        policy_gradient_step(model)
    counted = rt.stats()
    assert counted is not measured
    assert (counted.saved_bytes, counted.stored_bytes) == (measured.saved_bytes, measured.stored_bytes)


def test_an_unmeasured_exact_plan_through_the_hooks_is_bitwise_exact():
    ref = build_tiny_model("llama", seed=0).train()
    loss0, grads0 = policy_gradient_step(ref)
    model = copy.deepcopy(ref)
    rt = attach(model)
    for plan in PLANS[:4]:
        rt.set_plan(plan, measure=False, hands_off=False)
        assert not rt.hands_off
        loss, grads = policy_gradient_step(model)
        assert torch.equal(loss, loss0) and all(torch.equal(grads[n], g) for n, g in grads0.items()), plan


def test_hands_off_false_runs_the_plans_the_plain_model_could_run_through_the_hooks():
    model = build_tiny_model("qwen2", seed=0).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    rt = attach(model)
    for plan in ({}, rt.checkpoint_plan()):
        rt.set_plan(plan, measure=False)
        assert rt.hands_off
        assert _holders(rt, model, measure=False)[2] == []  # no save reached the runtime
        rt.set_plan(plan, measure=False, hands_off=False)
        assert not rt.hands_off
        assert _holders(rt, model, measure=False)[2]


def test_a_kept_unit_still_catches_an_in_place_change_of_what_it_saved():
    model = build_tiny_model("qwen2", seed=0).train()
    rt = attach(model, hilore_verl.RuntimeConfig(min_bytes=1024))
    rt.set_plan({"layers.1": "recompute"}, measure=False, hands_off=False)
    captured = {}
    norm = model.model.layers[0].input_layernorm  # layers.0.attn.norm: its output is saved by the q/k/v projections

    def change_output_later(module, args, output):
        captured["out"] = output

    handle = norm.register_forward_hook(change_output_later)
    ids = torch.randint(1, 512, (1, 24))
    loss = model(ids).logits.float().square().mean()
    handle.remove()
    with torch.no_grad():
        captured["out"].add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation.*checked by hilore-verl's runtime"):
        loss.backward()
