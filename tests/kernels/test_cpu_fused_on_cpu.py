"""The fused CPU codec (the reference compiled by torch.compile): bitwise the reference, compiled once
per shape class, and a compile failure falls back to the reference with one warning."""

import logging

import copy

import pytest
import torch

from hilore_verl import attach, kernels
from hilore_verl.kernels import cpu_fused, reference
from hilore_verl.tiny.models import build_tiny_model
from tests.harness.models import policy_gradient_step


def _input(shape, dtype, seed=0):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 4
    x[..., :3] *= 1e-30  # subnormal-range values
    flat = x.view(-1, shape[-1])
    flat[0, 5] = float("inf")  # a flagged group
    if flat.shape[0] > 2:
        flat[2, :] = 0  # all-zero groups
    return x.to(dtype)


def _same(a, b):
    return torch.equal(a.nan_to_num(), b.nan_to_num()) and torch.equal(a.isnan(), b.isnan())


@pytest.mark.parametrize("stochastic", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("fmt", ["int8", "fp8", "int4"])
def test_fused_is_bitwise_the_reference(fmt, dtype, stochastic):
    for shape, group in (((37, 128), 64), ((3, 5, 128), 64), ((1, 128), 64)):  # one width: one compile
        x = _input(shape, dtype)
        q, ref = cpu_fused.quantize(x, fmt, group, stochastic, seed=9), reference.quantize(x, fmt, group, stochastic, 9)
        assert torch.equal(q.codes, ref.codes) and _same(q.scales, ref.scales) and torch.equal(q.flags, ref.flags)
        y, y_ref = cpu_fused.dequantize(q), reference.dequantize(ref)
        assert y.dtype == dtype and y.shape == x.shape and _same(y, y_ref), (shape, group)


@pytest.mark.parametrize("group", [32, 128])
def test_every_group_size_is_bitwise_the_reference(group):
    x = _input((19, 256), torch.bfloat16)
    q, ref = cpu_fused.quantize(x, "int8", group), reference.quantize(x, "int8", group)
    assert torch.equal(q.codes, ref.codes) and _same(q.scales, ref.scales)
    assert _same(cpu_fused.dequantize(q), reference.dequantize(ref))


def test_a_new_token_count_reuses_the_compiled_code():
    import torch._dynamo.utils as dynamo_utils

    cpu_fused.dequantize(cpu_fused.quantize(torch.randn(40, 192), "int8", 64))
    before = dynamo_utils.counters["stats"]["unique_graphs"]
    for rows in (41, 100, 7, 2):
        cpu_fused.dequantize(cpu_fused.quantize(torch.randn(rows, 192), "int8", 64))
    assert dynamo_utils.counters["stats"]["unique_graphs"] == before


def test_a_compile_failure_falls_back_to_the_reference_with_one_warning(monkeypatch, caplog):
    def broken(*args):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(cpu_fused, "_failed", [])
    monkeypatch.setattr(cpu_fused, "_quantize_fn", lambda *a: broken)
    monkeypatch.setattr(cpu_fused, "_dequantize_fn", lambda *a: broken)
    x = _input((8, 64), torch.float32)
    with caplog.at_level(logging.WARNING, logger="hilore_verl"):
        for _ in range(3):
            y = cpu_fused.dequantize(cpu_fused.quantize(x, "fp8", 32))
    assert _same(y, reference.dequantize(reference.quantize(x, "fp8", 32)))
    warnings = [r for r in caplog.records if "could not be compiled" in r.getMessage()]
    assert len(warnings) == 1 and "no C++ compiler" in warnings[0].getMessage()
    assert not cpu_fused.available()


def test_the_reference_runs_on_request(monkeypatch):
    calls = []
    monkeypatch.setattr(cpu_fused, "quantize", lambda *a: calls.append("fused"))
    monkeypatch.setenv("HILORE_VERL_CPU_CODEC", "reference")
    assert kernels.cpu_codec() == "reference"
    q = kernels.quantize(torch.randn(4, 64), "int8", 64)
    assert not calls and isinstance(q, reference.QuantizedTensor)
    monkeypatch.setenv("HILORE_VERL_CPU_CODEC", "triton")
    with pytest.raises(ValueError, match="HILORE_VERL_CPU_CODEC='triton'; valid: native, fused, reference"):
        kernels.quantize(torch.randn(4, 64), "int8", 64)


@pytest.mark.parametrize("compiled", ["fused", "native"])
def test_the_runtime_on_a_compiled_codec_gives_the_reference_codec_gradients(compiled, monkeypatch):
    model = build_tiny_model("qwen2", seed=0, dtype=torch.bfloat16).train()
    other = copy.deepcopy(model)
    grads = []
    for m, codec in ((model, compiled), (other, "reference")):
        monkeypatch.setenv("HILORE_VERL_CPU_CODEC", codec)
        rt = attach(m)
        rt.set_plan({"layers.0": "int8", "layers.1": "fp8", "head": "int4"})
        grads.append(policy_gradient_step(m)[1])
        assert rt.stats().units["layers.0.mlp.proj"].stored_bytes < rt.stats().units["layers.0.mlp.proj"].saved_bytes
    assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[1])
