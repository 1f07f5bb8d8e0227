"""GPU-only runtime checks: exactness on CUDA, the pinned / side-stream offload path, real peak memory.

Skipped without a CUDA device (the CPU suite covers the same logic through the synchronous path).
Bitwise comparisons run both sides under torch's deterministic algorithms (the `deterministic`
fixture, conftest.py).
"""

import copy

import pytest
import torch

import hilore_verl
from hilore_verl import Mode, Plan, UnitPlan
from hilore_verl.tiny.models import build_tiny_model
from tests.harness.models import cosine_and_rel_error

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _step(model, batch):
    model.zero_grad(set_to_none=True)
    logits = model(**batch, use_cache=False).logits
    loss = torch.log_softmax(logits.float(), -1)[..., :8].mean()
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _setup(dtype=torch.bfloat16):
    ref = build_tiny_model("qwen2", dtype=dtype, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                           vocab_size=4096).cuda().train()
    ids = torch.randint(0, 4096, (4, 512), device="cuda")
    return ref, {"input_ids": ids}


def _pinned_pools(rt):
    """The runtime's host offload pools that use pinned memory (one per device, or a single pool)."""
    pools = getattr(rt, "_pools", None)
    pools = list(pools.values()) if isinstance(pools, dict) else [pools] if pools is not None else []
    return [pool for pool in pools if getattr(pool, "pinned", False)]


def test_recompute_is_bitwise_on_cuda(deterministic):
    ref, batch = _setup()
    torch.manual_seed(0)
    grads0 = _step(ref, batch)
    model = copy.deepcopy(ref)
    rt = hilore_verl.attach(model)
    rt.set_plan({"layers": "recompute", "head": "recompute"})
    torch.manual_seed(0)
    grads = _step(model, batch)
    assert all(torch.equal(grads[n], g) for n, g in grads0.items())


def test_pinned_offload_matches_in_place_compression(deterministic):
    ref, batch = _setup()
    model = copy.deepcopy(ref)
    rt = hilore_verl.attach(model)
    rt.set_plan(Plan(default="int8"))
    in_place = _step(model, batch)
    rt.set_plan(Plan(default=UnitPlan(Mode.COMPRESS, fmt="int8", offload=True)))
    offloaded = _step(model, batch)
    assert all(torch.equal(offloaded[n], g) for n, g in in_place.items())
    assert _pinned_pools(rt), "the offloaded payloads went through no pinned host pool"


def test_recompute_and_compression_lower_the_real_peak():
    ref, batch = _setup()
    model = copy.deepcopy(ref)
    rt = hilore_verl.attach(model)
    peaks = {}
    for name, plan in (("keep", {}), ("int8", Plan(default="int8")), ("recompute", {"layers": "recompute"})):
        rt.set_plan(plan)
        _step(model, batch)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        grads = _step(model, batch)
        torch.cuda.synchronize()
        peaks[name] = torch.cuda.max_memory_allocated()
        if name == "int8":
            cos, _ = cosine_and_rel_error(grads, _step(ref, batch))
            assert cos >= 0.999
    assert peaks["int8"] < peaks["keep"] and peaks["recompute"] < peaks["keep"], peaks
