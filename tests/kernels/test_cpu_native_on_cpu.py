"""The native CPU codec (kernels/cpu_native.cpp): bitwise the reference (codes, scales, flags and decoded
values as raw bits), the default CPU path where it builds, and a fallback with one warning where not."""

import logging

import pytest
import torch

from hilore_verl import kernels
from hilore_verl.kernels import cpu_native, reference

FLT_MAX = torch.finfo(torch.float32).max
_BIG = {torch.float32: FLT_MAX, torch.bfloat16: 3.3895e38, torch.float16: 65504.0}


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()])


def _special(shape, dtype, seed=0):
    """Normal values with, per row: subnormals, -0.0, an inf / a nan (flagged groups), an all-zero row,
    a row of subnormals only, values at the dtype's largest finite magnitude."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 4
    f = x.view(-1, shape[-1])
    f[:, :3] *= 1e-30
    f[:, 3] = -0.0
    f[0, 5] = float("inf")
    rows = f.shape[0]
    if rows > 2:
        f[2] = 0
    if rows > 4:
        f[3] *= 1e-40
        f[4, 7] = float("nan")
        f[4, -1] = float("-inf")
    if rows > 6:
        f[5, 1], f[6, 0], f[6, -1] = _BIG[dtype], -_BIG[dtype], _BIG[dtype]
    return x.to(dtype)


def _assert_bitwise(x, fmt, group, stochastic, seed=5, native=cpu_native):
    q, ref = native.quantize(x, fmt, group, stochastic, seed), reference.quantize(x, fmt, group, stochastic, seed)
    what = (fmt, x.dtype, group, stochastic, tuple(x.shape))
    assert q.codes.dtype == ref.codes.dtype and torch.equal(_raw(q.codes), _raw(ref.codes)), what
    assert torch.equal(_raw(q.scales), _raw(ref.scales)) and torch.equal(q.flags, ref.flags), what
    y, y_ref = native.dequantize(q), reference.dequantize(ref)
    assert y.dtype == x.dtype and y.shape == x.shape and torch.equal(_raw(y), _raw(y_ref)), what


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("fmt", ["int8", "fp8", "int4"])
def test_native_is_bitwise_the_reference(fmt, dtype):
    for group in (32, 64, 128):
        for shape in ((37, 256), (3, 5, 128), (1, 128), (7, 384)):
            for stochastic in (False, True):
                _assert_bitwise(_special(shape, dtype), fmt, group, stochastic)


def _random_bits(rows, cols, generator):
    """fp32 values from random bits over the whole exponent range (a narrow range per group of 64, so that
    ties, subnormal scales and huge values all occur), and half-integers times powers of two (exact ties)."""
    b = torch.randint(0, 2**31, (rows, cols), generator=generator, dtype=torch.int64)
    e = torch.randint(0, 255, (rows, cols // 64), generator=generator).repeat_interleave(64, 1)
    e = (e + torch.randint(-3, 1, (rows, cols), generator=generator)).clamp(0, 254)
    x = ((b & 0x807FFFFF) | (e << 23)).to(torch.int32).view(torch.float32).clone()
    ties = torch.randint(-300, 300, (rows, cols), generator=generator).float() / 2
    return x, ties * 2.0 ** torch.randint(-140, 120, (rows, 1), generator=generator).float()


def test_random_bit_patterns_and_ties_on_two_threads_are_bitwise_the_reference():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # above 64k elements the groups are split over threads
    try:
        g = torch.Generator().manual_seed(1)
        for i, x32 in enumerate(_random_bits(301, 512, g)):
            for dtype in (torch.float32, torch.bfloat16, torch.float16):
                for fmt in ("int8", "fp8", "int4"):
                    _assert_bitwise(x32.to(dtype), fmt, (64, 128)[i], stochastic=bool(i), seed=i + 3)
    finally:
        torch.set_num_threads(threads)


def test_the_seed_and_element_index_drive_stochastic_rounding():
    x = torch.randn(4, 256)
    a, b = (cpu_native.quantize(x, "int8", 64, True, s) for s in (1, 2))
    assert not torch.equal(a.codes, b.codes)
    assert torch.equal(a.codes, cpu_native.quantize(x, "int8", 64, True, 1).codes)


def test_noncontiguous_input_and_odd_row_counts():
    x = torch.randn(9, 3, 192).transpose(0, 1)  # not contiguous
    for fmt in ("int8", "fp8", "int4"):
        _assert_bitwise(x, fmt, 64, False)


@pytest.fixture
def fresh_native(monkeypatch, tmp_path):
    """A cache directory of its own and no loaded library; the real one is loaded again afterwards."""
    monkeypatch.setenv("HILORE_VERL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("HILORE_VERL_CPU_CODEC", raising=False)
    monkeypatch.setattr(kernels, "_native_outcome", [])
    cpu_native.load.cache_clear()
    yield tmp_path
    cpu_native.load.cache_clear()


def test_without_a_compiler_the_reference_runs_with_one_warning(fresh_native, monkeypatch, caplog):
    monkeypatch.setenv("CXX", str(fresh_native / "no-such-compiler"))
    x = _special((7, 128), torch.bfloat16)
    with caplog.at_level(logging.WARNING, logger="hilore_verl"):
        for _ in range(3):
            q = kernels.quantize(x, "fp8", 32, stochastic=True, seed=2)
            y = kernels.dequantize(q)
    warnings = [r.getMessage() for r in caplog.records if "native CPU codec" in r.getMessage()]
    assert len(warnings) == 1 and "no C++ compiler" in warnings[0] and "no-such-compiler" in warnings[0]
    assert kernels.cpu_codec_in_use() == "reference"
    ref = reference.quantize(x, "fp8", 32, True, 2)
    assert torch.equal(q.codes, ref.codes) and torch.equal(_raw(y), _raw(reference.dequantize(ref)))


def test_a_failing_build_falls_back_to_the_fused_codec_with_one_warning(fresh_native, monkeypatch, caplog):
    broken = fresh_native / "broken-cxx"
    broken.write_text("#!/bin/sh\necho 'fatal: unsupported target' >&2\nexit 3\n")
    broken.chmod(0o755)
    monkeypatch.setenv("CXX", str(broken))
    with caplog.at_level(logging.WARNING, logger="hilore_verl"):
        assert [kernels.cpu_codec_in_use() for _ in range(3)] == ["fused"] * 3
    warnings = [r.getMessage() for r in caplog.records if "native CPU codec" in r.getMessage()]
    assert len(warnings) == 1 and "unsupported target" in warnings[0] and "exited 3" in warnings[0]
    assert not list((fresh_native / "cache").glob("*.so"))  # no half-written library left behind


def test_the_default_cpu_codec_is_native(monkeypatch):
    monkeypatch.delenv("HILORE_VERL_CPU_CODEC", raising=False)
    calls = []
    real = cpu_native.quantize
    monkeypatch.setattr(cpu_native, "quantize", lambda *a: calls.append(1) or real(*a))
    assert kernels.cpu_codec() == "native" and kernels.cpu_codec_in_use() == "native"
    x = _special((5, 128), torch.float32)
    q = kernels.quantize(x, "int4", 64)
    assert calls and torch.equal(_raw(kernels.dequantize(q)), _raw(reference.dequantize(reference.quantize(x, "int4"))))
    kernels.warm_up()


def test_portable_build_is_bitwise_the_reference(fresh_native, monkeypatch, capsys):
    """Without -march=native / OpenMP (the scalar forms of the vector blocks): the same bits."""
    monkeypatch.setattr(cpu_native, "FLAGS", cpu_native.PORTABLE_FLAGS)
    assert cpu_native.main(["build"]) == 0
    path = capsys.readouterr().out.strip()
    assert path.endswith(".so") and (fresh_native / "cache") in __import__("pathlib").Path(path).parents
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for fmt in ("int8", "fp8", "int4"):
            for stochastic in (False, True):
                _assert_bitwise(_special((7, 128), dtype), fmt, 64, stochastic)
