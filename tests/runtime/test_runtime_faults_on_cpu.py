"""The runtime under faults and misuse: abandoned graphs, in-place changes, failing forwards,
retained graphs, detach mid-step, plan switches mid-forward. Each case against plain PyTorch."""

import copy
import gc

import pytest
import torch

from hilore_verl import UnitPlan, attach
from hilore_verl.runtime.stats import StepStats
from hilore_verl.tiny.models import build_tiny_model
from hilore_verl.tiny.workload import make_grpo_batch
from tests.harness.models import WORKLOAD, policy_gradient_step

PLANS = {
    "keep": {},
    "recompute": {"layers": "recompute", "head": "recompute"},
    "int8": {"layers": "int8", "head": "int8"},
    "offload": {"layers": UnitPlan("compress", fmt="int8", offload=True)},
    "mixed": {"layers.0": "recompute", "layers.1.mlp": "int4", "head": "fp8"},
}


def _model(family="qwen2"):
    return build_tiny_model(family, seed=0).train()


def _loss(model, batch, **kwargs):
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                position_ids=batch["position_ids"], use_cache=False, **kwargs)
    return out, out.logits.float().log_softmax(-1).mean()


def _live_tensors() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))


@pytest.mark.parametrize("plan", PLANS.values(), ids=PLANS.keys())
def test_abandoned_graphs_hold_nothing(plan):
    """A forward whose loss is dropped without backward frees everything it held, without help from
    Python's cycle collector (a reference cycle through autograd's C++ nodes would never be freed)."""
    model = _model()
    rt = attach(model)
    rt.set_plan(plan)
    batch = make_grpo_batch(WORKLOAD, seed=0)
    _loss(model, batch)
    before = _live_tensors()
    gc.disable()
    try:
        for _ in range(10):
            _loss(model, batch)
        leaked = sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor)) - before
    finally:
        gc.enable()
    assert leaked <= 0, f"{leaked} tensors left behind by 10 abandoned forwards"
    assert _live_tensors() <= before


def _change_in_place_after_forward(model, batch, free_it: bool):
    """Double the final hidden state (the head's saved input) after the forward, as a buggy caller would."""
    out, loss = _loss(model, batch, output_hidden_states=True)
    out.hidden_states[-1].mul_(2)
    if free_it:
        del out
    loss.backward()


@pytest.mark.parametrize("free_it", [False, True], ids=["alive", "freed"])
@pytest.mark.parametrize("plan", PLANS.values(), ids=PLANS.keys())
def test_in_place_change_of_a_saved_tensor_raises_as_in_plain_pytorch(plan, free_it):
    batch = make_grpo_batch(WORKLOAD, seed=0)
    plain = _model()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _change_in_place_after_forward(plain, batch, free_it)
    model = _model()
    attach(model).set_plan(plan)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _change_in_place_after_forward(model, batch, free_it)


def test_saved_tensors_are_not_flagged_without_an_in_place_change():
    """The version check compares the version at save time: a tensor changed in place *before* it
    is saved again is a new saved value (and compressing it again), not an error."""
    batch = make_grpo_batch(WORKLOAD, seed=0)
    for plan in PLANS.values():
        model = _model()
        attach(model).set_plan(plan)
        _, loss = _loss(model, batch)
        loss.backward()


class _Fault(Exception):
    pass


def _fail_once(module, where="forward"):
    """Make `module` raise once, in its forward or in its backward."""
    state = {"armed": True}

    def hook(mod, args, output):
        if state["armed"] and where == "forward":
            state["armed"] = False
            raise _Fault("injected in forward")
        if where == "backward" and output.requires_grad:
            def grad_hook(grad):
                if state["armed"]:
                    state["armed"] = False
                    raise _Fault("injected in backward")
                return grad
            output.register_hook(grad_hook)
        return output

    return module.register_forward_hook(hook)


@pytest.mark.parametrize("where", ["forward", "backward", "summary"])
@pytest.mark.parametrize("plan", ["int4", "recompute", "offload"])
def test_a_failed_step_leaves_the_runtime_ready(where, plan, monkeypatch):
    """After a forward or backward that raised (or bookkeeping that raised at the end of a forward),
    the next steps run under their plans: exact plans bitwise, lossy plans compressed."""
    ref = _model()
    _, grads0 = policy_gradient_step(ref)
    model = copy.deepcopy(ref)
    rt = attach(model)
    plans = {"int4": {"layers": "int4", "head": "int4"}, "recompute": PLANS["recompute"],
             "offload": PLANS["offload"]}
    rt.set_plan(plans[plan])
    if where == "summary":
        real = StepStats.summary
        calls = []

        def summary_fails_once(self, plans):
            calls.append(1)
            if len(calls) == 1:
                raise _Fault("injected in the forward's bookkeeping")
            return real(self, plans)

        monkeypatch.setattr(StepStats, "summary", summary_fails_once)
        handle = None
    else:
        handle = _fail_once(model.model.layers[1].mlp, where)
    with pytest.raises(_Fault):
        policy_gradient_step(model)
    if handle is not None:
        handle.remove()
    assert not torch._C._autograd._top_saved_tensors_default_hooks(False), "a saved-tensor hook was left installed"
    _, grads = policy_gradient_step(model)
    stats = rt.stats()
    if plan == "recompute":
        assert all(torch.equal(grads[n], g) for n, g in grads0.items())
    else:
        assert 0 < stats.stored_bytes < stats.saved_bytes, stats.table()
        assert not all(torch.equal(grads[n], g) for n, g in grads0.items())
    rt.set_plan({})
    _, grads = policy_gradient_step(model)
    assert all(torch.equal(grads[n], g) for n, g in grads0.items())


@pytest.mark.parametrize("plan", ["recompute", "mixed", "keep"])
def test_a_second_backward_through_a_retained_graph(plan):
    batch = make_grpo_batch(WORKLOAD, seed=0)
    plain = _model()
    model = copy.deepcopy(plain)
    attach(model).set_plan(PLANS[plan] if plan != "mixed" else {"layers.0": "recompute", "layers.1.attn": "recompute"})
    for m in (plain, model):
        _, loss = _loss(m, batch)
        loss.backward(retain_graph=True)
        loss.backward()
    for (n, p), q in zip(plain.named_parameters(), model.parameters()):
        assert torch.equal(p.grad, q.grad), n


def test_detach_between_forward_and_backward():
    """A graph built while attached still runs backward after detach; the model is plain afterwards."""
    batch = make_grpo_batch(WORKLOAD, seed=0)
    plain = _model()
    model = copy.deepcopy(plain)
    rt = attach(model)
    rt.set_plan(PLANS["recompute"])
    _, loss = _loss(model, batch)
    rt.detach()
    loss.backward()
    _, loss0 = _loss(plain, batch)
    loss0.backward()
    for (n, p), q in zip(plain.named_parameters(), model.parameters()):
        assert torch.equal(p.grad, q.grad), n
    assert all("forward" not in m.__dict__ for m in model.modules()), "a forward wrapper is left behind"
    attach(model).detach()  # attachable again


def test_a_plan_switched_inside_a_forward_applies_to_the_next_forward():
    ref = _model()
    _, grads0 = policy_gradient_step(ref)
    model = copy.deepcopy(ref)
    rt = attach(model)
    switch = model.model.layers[0].register_forward_hook(lambda *a: rt.set_plan({"layers": "int8", "head": "int8"}))
    _, grads = policy_gradient_step(model)  # this forward started on "keep"
    switch.remove()
    assert all(torch.equal(grads[n], g) for n, g in grads0.items())
    assert rt.stats().stored_bytes == rt.stats().saved_bytes
    _, grads = policy_gradient_step(model)  # the next one runs on int8
    assert rt.stats().stored_bytes < rt.stats().saved_bytes
