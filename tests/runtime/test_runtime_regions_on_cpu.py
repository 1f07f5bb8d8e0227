"""Regions: a decoder block with a recomputed unit re-runs once in backward, as checkpoint does; its kept
and compressed calls hand out their held outputs."""

import copy
from collections import Counter

import pytest
import torch
import torch.nn as nn

from hilore_verl import attach
from hilore_verl.tiny.models import build_tiny_model
from tests.harness.models import policy_gradient_step


def _model(family="qwen2"):
    return build_tiny_model(family, seed=0, dtype=torch.float32).train()


def _backward_calls(model, run, monkeypatch):
    """Linear layers computed during backward (re-runs; a replayed call computes nothing), by module name."""
    calls, in_backward = Counter(), [False]
    names = {m.weight: n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    linear = torch.nn.functional.linear

    def counting_linear(x, weight, bias=None):
        if in_backward[0]:
            calls.update([names[weight]])
        return linear(x, weight, bias)

    class Mark(torch.autograd.Function):  # flips the flag when backward starts
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, g):
            in_backward[0] = True
            return g

    original = model.lm_head.forward
    with monkeypatch.context() as patch:
        patch.setattr(torch.nn.functional, "linear", counting_linear)
        patch.setattr(model.lm_head, "forward", lambda x: original(Mark.apply(x)))
        result = run(model)
    return calls, result


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_a_recomputed_layer_reruns_once_as_checkpoint_does(family, monkeypatch):
    ref = _model(family)
    loss0, grads0 = policy_gradient_step(copy.deepcopy(ref))
    gc_model = copy.deepcopy(ref)
    gc_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    gc_calls, _ = _backward_calls(gc_model, policy_gradient_step, monkeypatch)
    model = copy.deepcopy(ref)
    rt = attach(model)
    rt.set_plan({"layers": "recompute"})
    calls, (loss, grads) = _backward_calls(model, policy_gradient_step, monkeypatch)
    # every projection checkpoint re-runs, once, but the last one: the re-run stops before it, as
    # nothing saved needs its output (checkpoint's early stop stops after it)
    last = {f"model.layers.{i}.mlp.down_proj" for i in range(model.config.num_hidden_layers)}
    assert set(calls.values()) == {1} and set(calls) == set(gc_calls) - last and last <= set(gc_calls)
    assert torch.equal(loss, loss0) and all(torch.equal(grads[n], g) for n, g in grads0.items())
    # what the forward leaves held: each layer's input (as checkpoint holds), the head's input and what
    # the head keeps, and small shared tensors (rotary tables, norm statistics): less than one hidden state
    stats = rt.stats()
    hidden = model.config.hidden_size * 8 * 96 * 4  # batch 8 x 96 tokens, fp32
    total = stats.unmanaged_bytes + stats.unmanaged_held_bytes + stats.stored_bytes
    floor = model.config.num_hidden_layers * hidden + stats.units["head"].stored_bytes  # the head owns its input
    assert floor <= total < floor + hidden

def test_kept_units_inside_a_recomputed_layer_hand_out_their_outputs(monkeypatch):
    ref = _model()
    loss0, grads0 = policy_gradient_step(copy.deepcopy(ref))
    model = copy.deepcopy(ref)
    rt = attach(model)
    rt.set_plan({"layers": "recompute", "layers.0.mlp.proj": "keep", "layers.1.attn.proj": "keep"})
    calls, (loss, grads) = _backward_calls(model, policy_gradient_step, monkeypatch)
    assert torch.equal(loss, loss0) and all(torch.equal(grads[n], g) for n, g in grads0.items())
    assert not any(k.startswith("model.layers.0.mlp.") or k.startswith("model.layers.1.self_attn.") for k in calls)
    assert calls["model.layers.0.self_attn.q_proj"] == 1 and calls["model.layers.1.mlp.up_proj"] == 1


def _reruns(monkeypatch):
    """Count region re-runs (each is one call of recompute.rerun)."""
    import hilore_verl.runtime.runtime as runtime_module

    count, real = [0], runtime_module.rerun
    monkeypatch.setattr(runtime_module, "rerun", lambda *a: count.__setitem__(0, count[0] + 1) or real(*a))
    return count


@pytest.mark.parametrize("plan", [
    {"layers.0.mlp": "recompute", "layers.1.attn": "recompute"},  # one half of each layer
    {"layers": "recompute", "layers.0.attn.norm": "keep", "layers.1.mlp.act": "keep", "layers.1.mlp.proj": "keep"},
    {"layers.0.attn.core": "recompute", "layers.0.mlp.norm": "recompute", "layers.1.mlp.norm": "recompute"},
])
def test_a_mixed_layer_reruns_once_and_replays_its_kept_calls(plan, monkeypatch):
    """A layer that recomputes some outermost calls and keeps others is one region: re-run once from
    its inputs, the kept calls handing out their outputs (their projections never computed again)."""
    ref = _model()
    loss0, grads0 = policy_gradient_step(copy.deepcopy(ref))
    model = copy.deepcopy(ref)
    rt = attach(model)
    rt.set_plan(plan)
    reruns = _reruns(monkeypatch)
    calls, (loss, grads) = _backward_calls(model, policy_gradient_step, monkeypatch)
    assert torch.equal(loss, loss0) and all(torch.equal(grads[n], g) for n, g in grads0.items())
    assert reruns[0] == model.config.num_hidden_layers  # once per layer, whatever the mix
    assert set(calls.values()) <= {1}
    for i in range(model.config.num_hidden_layers):
        for part, prefix in (("attn", "self_attn."), ("mlp", "mlp.")):
            recomputed = any(rt.plan_of(f"layers.{i}.{part}.{k}").mode.value == "recompute"
                             for k in ("core", "proj", "act") if f"layers.{i}.{part}.{k}" in rt._by_name)
            computed = any(k.startswith(f"model.layers.{i}.{prefix}") for k in calls)
            assert computed == (recomputed and rt.plan_of(f"layers.{i}.{part}.proj").mode.value == "recompute")


def test_a_replayed_call_leaves_the_rng_as_it_did_in_forward(monkeypatch):
    """A kept call that draws random numbers is replayed, drawing nothing: the recomputed dropout after
    it must still draw what it drew in forward (bitwise the plain model's gradients)."""
    torch.manual_seed(0)
    ref = _model()

    def patched(model):
        for layer in model.model.layers:
            norm, mlp = layer.input_layernorm, layer.mlp
            norm_fwd, mlp_fwd = norm.forward, mlp.forward
            norm.forward = lambda x, f=norm_fwd: f(x) + 0 * torch.rand(1)  # draws, kept
            mlp.forward = lambda x, f=mlp_fwd: torch.nn.functional.dropout(f(x), 0.5, True)  # draws, recomputed
        return model

    torch.manual_seed(1)
    loss0, grads0 = policy_gradient_step(patched(copy.deepcopy(ref)))
    model = patched(copy.deepcopy(ref))
    rt = attach(model)
    rt.set_plan({"layers": "recompute", "layers.0.attn.norm": "keep", "layers.1.attn": "keep"})
    torch.manual_seed(1)
    loss, grads = policy_gradient_step(model)
    assert torch.equal(loss, loss0) and all(torch.equal(grads[n], g) for n, g in grads0.items())


def test_a_rerun_that_makes_other_calls_fails_loudly():
    model = _model()
    rt = attach(model)
    rt.set_plan({"layers.0": "recompute"})
    mlp = model.model.layers[0].mlp
    original, runs = mlp.forward, [0]

    def flaky(x):  # calls its projections only on the first run
        runs[0] += 1
        return original(x) if runs[0] == 1 else x * 2

    mlp.forward = flaky
    with pytest.raises(RuntimeError, match="diverged from its forward"):
        policy_gradient_step(model)


def test_a_replayed_compressed_output_is_decoded_once_for_the_rerun_and_the_saves(monkeypatch):
    import hilore_verl.runtime.records as records

    ref = _model()
    _, exact = policy_gradient_step(copy.deepcopy(ref))
    counts = {}
    for share in (True, False):
        model = copy.deepcopy(ref)
        rt = attach(model)
        rt.set_plan({"layers": "recompute", "layers.0.mlp.proj": "int8"})  # layer 0's MLP re-run replays them
        decodes = []
        real = records.Compressed.get
        monkeypatch.setattr(records.Compressed, "get", lambda self: decodes.append(1) or real(self))
        if not share:
            monkeypatch.setattr(records.Checked, "decode_for_replay", lambda self: self.held.get())
        _, grads = policy_gradient_step(model)
        monkeypatch.undo()
        counts[share] = len(decodes)
        assert all(torch.nn.functional.cosine_similarity(grads[n].flatten(), g.flatten(), 0) > 0.9999
                   for n, g in exact.items() if g.abs().sum() > 0)
        if share:
            shared = grads
        else:
            assert all(torch.equal(shared[n], g) for n, g in grads.items())  # the same values either way
    assert counts[True] < counts[False]
