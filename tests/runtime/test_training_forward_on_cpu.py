"""A training plan (`set_plan(measure=False)`) counts nothing, takes shorter paths through the
saved-tensor hook and switches the hooks off inside kept calls that only kept units fed; what it holds
for backward must be what the measured forward holds, save for save."""

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
    # compressing units adopt the rotary tables and a residual-stream tensor that kept calls save too
    {"layers.0.attn.core": "int8", "layers.1.mlp.norm": "int8"},
]


def _holders(rt, model, measure: bool, hands_off: bool = True):
    """(loss, grads, how each save was held, in order: the type of what the runtime's pack returned, if
    dropped its locator, and whether it passed the runtime; "Kept" for a save made while the runtime's
    hooks were off, which reaches the hooks outside them: autograd holds it as it is)."""
    held = []
    pack = rt.saving.pack

    def spy(t):
        value = pack(t)
        held.append((type(value).__name__, value.locator if isinstance(value, Dropped) else None, True))
        return value

    def outside(t):
        held.append(("Kept", None, False))
        outside.count += 1
        return t.detach()

    outside.count = 0
    rt.saving.pack = spy
    try:
        with torch.autograd.graph.saved_tensors_hooks(outside, lambda t: t):
            loss, grads = policy_gradient_step(model)
    finally:
        del rt.saving.pack
    rt.autograd_held = outside.count
    return loss, grads, held


@pytest.mark.parametrize("plan", PLANS, ids=str)
def test_a_training_forward_holds_what_a_measured_forward_holds(plan):
    model = build_tiny_model("qwen2", seed=0).train()
    rt = attach(model, hilore_verl.RuntimeConfig(min_bytes=1024))
    rt.set_plan(plan)
    loss0, grads0, held0 = _holders(rt, model, measure=True)
    measured = rt.stats()
    assert held0 and measured.saved_bytes > 0
    outside_model = rt.autograd_held  # the loss's saves, after the model's forward: none pass the runtime
    rt.set_plan(plan, measure=False, hands_off=False)
    loss, grads, held = _holders(rt, model, measure=False)
    assert [h[:2] for h in held] == [h[:2] for h in held0]
    assert rt.autograd_held > outside_model  # kept calls that kept units fed ran without the runtime's hooks
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
        # no save reached the runtime
        assert not any(runtime for _, _, runtime in _holders(rt, model, measure=False)[2])
        rt.set_plan(plan, measure=False, hands_off=False)
        assert not rt.hands_off
        assert any(runtime for _, _, runtime in _holders(rt, model, measure=False)[2])


@pytest.mark.parametrize("measure, checked_by", [(True, ".*checked by hilore-verl's runtime"), (False, "")])
def test_a_kept_unit_still_catches_an_in_place_change_of_what_it_saved(measure, checked_by):
    """Measured, the runtime's holder checks the version; in training the projections' calls run
    without the runtime's hooks (their input is a kept unit's) and autograd checks it."""
    model = build_tiny_model("qwen2", seed=0).train()
    rt = attach(model, hilore_verl.RuntimeConfig(min_bytes=1024))
    rt.set_plan({"layers.1": "recompute"}, measure=measure, hands_off=False)
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
    with pytest.raises(RuntimeError, match="modified by an inplace operation" + checked_by):
        loss.backward()


def _innermost_hooks():
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


def test_a_forward_that_raises_inside_a_call_without_hooks_leaves_the_hook_stack_as_it_found_it():
    ref = build_tiny_model("qwen2", seed=0).train()
    loss0, grads0 = policy_gradient_step(ref)
    model = copy.deepcopy(ref)
    rt = attach(model)
    rt.set_plan({"layers.1.attn.core": "recompute"}, measure=False, hands_off=False)
    proj = model.model.layers[0].mlp.down_proj  # a kept call inside a kept call: both without the hooks

    def fail(module, args):
        assert _innermost_hooks() is None  # the runtime's were switched off for this call
        raise RuntimeError("injected")

    handle = proj.register_forward_pre_hook(fail)
    with pytest.raises(RuntimeError, match="injected"):
        policy_gradient_step(model)
    handle.remove()
    assert _innermost_hooks() is None and rt._fwd is None
    loss, grads = policy_gradient_step(model)
    assert torch.equal(loss, loss0) and all(torch.equal(grads[n], g) for n, g in grads0.items())


def test_hooks_pushed_around_a_layer_keep_seeing_its_saves():
    """Someone's saved-tensor hooks inside the model's forward (around a decoder layer): the runtime's
    are not the innermost there, so they are not switched off and the saves reach the other hooks."""
    ref = build_tiny_model("qwen2", seed=0).train()
    loss0, grads0 = policy_gradient_step(ref)
    model = copy.deepcopy(ref)
    rt = attach(model)
    rt.set_plan({"layers.0.attn.core": "recompute"}, measure=False, hands_off=False)
    seen = []
    theirs = torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(1) or t.detach(), lambda t: t)
    layer = model.model.layers[1]  # every unit kept: without them, its calls would run without hooks
    handles = [layer.register_forward_pre_hook(lambda m, a: theirs.__enter__()),
               layer.register_forward_hook(lambda m, a, o: theirs.__exit__())]
    loss, grads = policy_gradient_step(model)
    for handle in handles:
        handle.remove()
    assert len(seen) > 10 and _innermost_hooks() is None
    assert torch.equal(loss, loss0) and all(torch.equal(grads[n], g) for n, g in grads0.items())
