"""The runtime on FSDP2-sharded models, 2 gloo ranks: exact modes bitwise, no stray collectives, params safe."""

import torch

from tests.harness.distributed import run_on_ranks

PLANS = {  # rank -> plan: the ranks deliberately disagree, so a recompute that issued a collective would hang
    "mixed": [{"layers": "recompute", "head": "recompute"}, {}],
    "selective": [{"layers.0.attn.core": "recompute", "layers.1.mlp.act": "recompute", "layers.1.attn.norm": "recompute"},
                  {"layers.0.mlp": "recompute"}],
}


def _sharded_model(family, dtype):
    from torch.distributed.fsdp import fully_shard

    from hilore_verl.tiny.models import build_tiny_model

    model = build_tiny_model(family, seed=0, dtype=dtype).train()
    for layer in model.model.layers:  # as verl does: each decoder layer, then the root
        fully_shard(layer)
    fully_shard(model)
    return model


def _full_grads(model):
    return {n: p.grad.full_tensor() for n, p in model.named_parameters()}


def _exact_plans_match(rank, world_size, family, dtype, plans_name):
    import hilore_verl
    from tests.harness.models import policy_gradient_step

    model = _sharded_model(family, dtype)
    loss0, _ = policy_gradient_step(model)
    grads0 = _full_grads(model)
    rt = hilore_verl.attach(model)
    rt.set_plan(PLANS[plans_name][rank])
    loss, _ = policy_gradient_step(model)
    grads = _full_grads(model)
    return {"loss_equal": torch.equal(loss, loss0),
            "grads_equal": all(torch.equal(grads[n], g) for n, g in grads0.items()),
            "dropped": sum(u.saved_bytes for u in rt.stats().units.values() if u.mode == "recompute")}


def test_recompute_is_exact_and_issues_no_collectives_under_fsdp2():
    for family, dtype, plans in (("qwen2", torch.float32, "mixed"), ("llama", torch.bfloat16, "selective")):
        results = run_on_ranks(_exact_plans_match, 2, args=(family, dtype, plans))
        assert all(r["loss_equal"] and r["grads_equal"] for r in results), (family, results)
        assert results[0]["dropped"] > 0


def _codec_inputs_are_never_parameters(rank, world_size):
    from torch.distributed.tensor import DTensor

    import hilore_verl
    import hilore_verl.runtime.saving as runtime_module
    from tests.harness.models import cosine_and_rel_error, policy_gradient_step

    model = _sharded_model("qwen2", torch.float32)
    policy_gradient_step(model)
    grads0 = _full_grads(model)
    violations, calls = [], []
    real = runtime_module.quantize

    def spy(t, *args, **kwargs):
        # the local shards, and the unsharded parameters FSDP2 has swapped in for the running layer
        live = {(p.to_local() if isinstance(p, DTensor) else p).untyped_storage().data_ptr()
                for p in model.parameters()}
        calls.append(1)
        if (isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter)
                or t.untyped_storage().data_ptr() in live):
            violations.append(tuple(t.shape))
        return real(t, *args, **kwargs)

    runtime_module.quantize = spy
    try:
        rt = hilore_verl.attach(model)
        rt.set_plan({"layers": "int8", "head": "int8"})
        policy_gradient_step(model)
    finally:
        runtime_module.quantize = real
    cos, _ = cosine_and_rel_error(_full_grads(model), grads0)
    return {"calls": len(calls), "violations": violations, "cos": cos}


def test_parameters_never_reach_a_codec_under_fsdp2():
    for r in run_on_ranks(_codec_inputs_are_never_parameters, 2):
        assert r["calls"] > 0 and r["violations"] == [] and r["cos"] >= 0.999
