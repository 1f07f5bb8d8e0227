"""Torch reference codecs: shapes, dtypes, per-element error bounds, sizes, zero groups, tails, bad input."""

import pytest
import torch

from hilore_verl.kernels import FORMATS, GROUP_SIZES, quantize
from hilore_verl.kernels.reference import QMAX

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHAPES = [(4, 128), (3, 7, 64), (5, 33), (1,), (2, 1, 96)]  # (5, 33) and (1,) have short last groups


def _group_absmax(x, group_size):
    flat = x.float().reshape(-1)
    flat = torch.nn.functional.pad(flat, (0, (-flat.numel()) % group_size))
    return flat.view(-1, group_size).abs().amax(1).repeat_interleave(group_size)[: x.numel()].view(x.shape)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("group_size", GROUP_SIZES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_round_trip_within_half_a_step(shape, group_size, fmt, dtype):
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    q = quantize(x, fmt, group_size)
    y = q.dequantize()
    assert y.shape == x.shape and y.dtype == x.dtype
    err = (y.float() - x.float()).abs()
    absmax = _group_absmax(x, group_size)
    out_ulp = y.float().abs() * {torch.float32: 0.0, torch.float16: 2**-11, torch.bfloat16: 2**-8}[dtype]
    if fmt == "fp8":  # e4m3: 3 mantissa bits -> half-ulp 2^-4 relative, subnormal step 2^-9 of scale
        bound = x.float().abs() * 2**-4 + absmax / QMAX["fp8"] * 2**-9
    else:
        bound = absmax / QMAX[fmt] / 2
    assert (err <= bound * (1 + 1e-5) + out_ulp + 1e-30).all()


@pytest.mark.parametrize("fmt, ratio", [("int8", 0.25), ("fp8", 0.25), ("int4", 0.125)])
def test_bytes_held(fmt, ratio):
    x = torch.randn(64, 256)
    q = quantize(x, fmt, 64)
    groups = x.numel() // 64
    assert q.nbytes == int(x.numel() * 4 * ratio) + groups * 4


def test_zero_groups_decode_to_exact_zeros():
    x = torch.randn(4, 128)
    x[1] = 0
    for fmt in FORMATS:
        q = quantize(x, fmt, 64)
        assert (q.scales[2:4] == 0).all()
        assert (q.dequantize()[1] == 0).all()


def test_int4_packing_layout():
    x = torch.tensor([7.0, -7.0] + [0.0] * 30)  # scale 1: codes 7 -> 15, -7 -> 1
    q = quantize(x, "int4", 32)
    assert q.codes[0].item() == (15 | (1 << 4))
    assert q.codes.numel() == 16


def test_offload_round_trip_keeps_values():
    x = torch.randn(8, 64)
    q = quantize(x, "int8", 32)
    assert torch.equal(q.to("cpu").dequantize(), q.dequantize())


def test_bad_input_names_the_valid_values():
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match="unknown format 'int3'; valid formats: int8, fp8, int4"):
        quantize(x, "int3")
    with pytest.raises(ValueError, match=r"group_size 48 is not supported; valid group sizes: \(32, 64, 128\)"):
        quantize(x, "int8", 48)
    with pytest.raises(ValueError, match="floating-point"):
        quantize(torch.ones(4, 64, dtype=torch.int32))
