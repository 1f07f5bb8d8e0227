"""Which CPU codec path actually ran through `kernels.quantize` / `kernels.dequantize`, not only which one
was asked for. tests/conftest.py makes the rest of the suite run the torch reference
(HILORE_VERL_CPU_CODEC=reference); these tests set the variable themselves.

The default CPU codec is the native library
(tests/kernels/test_cpu_native_on_cpu.py::test_the_default_cpu_codec_is_native); the fused codec (the
reference compiled by torch.compile) runs where that library cannot be built, or on request. The fused
codec falls back to the reference on a compile error with one warning; its calls still return the
reference's bits then, so a bitwise comparison alone cannot tell that the compiled code ran:
`cpu_fused.status()` counts the calls the compiled code served. docs/design.md ("Codecs"): all CPU paths
agree bit for bit with the reference (codes, scales, flags and the dequantized output, as raw bits).
"""

import logging

import pytest
import torch

from hilore_verl import kernels
from hilore_verl.kernels import cpu_fused, cpu_native, reference


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()])


def _bf16_input():
    x = torch.randn(37, 256, generator=torch.Generator().manual_seed(4)) * 3
    x[0, 5] = float("inf")  # a flagged group
    x[2] = 0  # an all-zero row
    x[:, :3] *= 1e-30
    return x.to(torch.bfloat16)


def _through_the_entry_point_bitwise(x, fmt="int8", group=64):
    q = kernels.quantize(x, fmt, group)
    y = kernels.dequantize(q)
    ref = reference.quantize(x, fmt, group)
    assert torch.equal(_raw(q.codes), _raw(ref.codes)) and torch.equal(_raw(q.scales), _raw(ref.scales))
    assert torch.equal(q.flags, ref.flags) and q.flags.any()
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    assert torch.equal(_raw(y), _raw(reference.dequantize(ref)))


def test_the_fused_codec_on_request_runs_its_compiled_code(monkeypatch):
    monkeypatch.setenv("HILORE_VERL_CPU_CODEC", "fused")
    before = cpu_fused.status()
    _through_the_entry_point_bitwise(_bf16_input())
    after = cpu_fused.status()
    assert after["compiled"] and after["error"] is None, after
    assert after["fused_calls"] == before["fused_calls"] + 2, (before, after)  # quantize and dequantize
    assert after["reference_calls"] == before["reference_calls"], (before, after)
    assert kernels.cpu_codec_in_use() == "fused"


def test_where_the_native_library_cannot_be_built_the_default_runs_fused_code(monkeypatch, caplog):
    def unbuildable():
        raise cpu_native.Unavailable("injected: the build failed", no_compiler=False)

    monkeypatch.delenv("HILORE_VERL_CPU_CODEC", raising=False)  # the default: native
    monkeypatch.setattr(kernels, "_native_outcome", [])
    monkeypatch.setattr(cpu_native, "load", unbuildable)
    calls = []
    real = cpu_native.quantize
    monkeypatch.setattr(cpu_native, "quantize", lambda *a: calls.append(1) or real(*a))
    before = cpu_fused.status()
    with caplog.at_level(logging.WARNING, logger="hilore_verl"):
        _through_the_entry_point_bitwise(_bf16_input(), "fp8", 32)
    after = cpu_fused.status()
    assert kernels.cpu_codec() == "native" and kernels.cpu_codec_in_use() == "fused" and not calls
    assert after["fused_calls"] == before["fused_calls"] + 2 and after["reference_calls"] == before["reference_calls"]
    warnings = [r.getMessage() for r in caplog.records if "native CPU codec could not be built" in r.getMessage()]
    assert len(warnings) == 1 and "injected" in warnings[0]


def test_a_failed_fused_compile_is_reported_and_warned_once(monkeypatch, caplog):
    def broken(*args):
        raise RuntimeError("injected: no C++ compiler")

    monkeypatch.setenv("HILORE_VERL_CPU_CODEC", "fused")
    monkeypatch.setattr(cpu_fused, "_failed", [])
    monkeypatch.setattr(cpu_fused, "_calls", {"fused": 0, "reference": 0})
    monkeypatch.setattr(cpu_fused, "_quantize_fn", lambda *a: broken)
    monkeypatch.setattr(cpu_fused, "_dequantize_fn", lambda *a: broken)
    assert kernels.cpu_codec_in_use() == "fused"  # nothing compiled yet
    with caplog.at_level(logging.WARNING, logger="hilore_verl"):
        for _ in range(2):
            _through_the_entry_point_bitwise(_bf16_input())
    assert cpu_fused.status() == {"compiled": False, "fused_calls": 0, "reference_calls": 4,
                                  "error": "RuntimeError: injected: no C++ compiler"}
    assert kernels.cpu_codec_in_use() == "reference"
    warnings = [r.getMessage() for r in caplog.records if "could not be compiled" in r.getMessage()]
    assert len(warnings) == 1 and "injected" in warnings[0]


@pytest.mark.parametrize("codec", ["reference", "native"])
def test_other_codecs_do_not_count_as_fused(monkeypatch, codec):
    monkeypatch.setenv("HILORE_VERL_CPU_CODEC", codec)
    before = cpu_fused.status()
    _through_the_entry_point_bitwise(_bf16_input())
    assert cpu_fused.status() == before
