"""Torch reference codecs: error bounds, SQNR floors, fp8 rounding, stochastic rounding, flags, bad input."""

import pytest
import torch

from hilore_verl.kernels import FORMATS, GROUP_SIZES, quantize, reference
from hilore_verl.kernels.reference import QMAX, _fp8_encode, fp8_decode

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHAPES = [(4, 128), (3, 7, 256), (1, 128), (33, 384)]
# Gaussian inputs, every dtype and group size; measured minimum: int8 43.5 dB, fp8 31.8 dB, int4 18.6 dB.
SQNR_FLOOR_DB = {"int8": 42.0, "fp8": 30.0, "int4": 17.0}


def sqnr_db(x, y):
    x, y = x.float(), y.float()
    return (10 * torch.log10(x.pow(2).sum() / (x - y).pow(2).sum())).item()


def _group_absmax(x, g):
    return x.float().reshape(-1, g).abs().amax(1).repeat_interleave(g).view(x.shape)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("group_size", GROUP_SIZES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_round_trip_error_bound_and_sqnr(shape, group_size, fmt, dtype):
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    q = quantize(x, fmt, group_size)
    y = q.dequantize()
    assert y.shape == x.shape and y.dtype == x.dtype and not q.has_nonfinite
    err = (y.float() - x.float()).abs()
    absmax = _group_absmax(x, group_size)
    out_rounding = y.float().abs() * {torch.float32: 0.0, torch.float16: 2**-11, torch.bfloat16: 2**-8}[dtype]
    if fmt == "fp8":  # half a step of e4m3 (3 mantissa bits), or of its subnormal grid
        bound = x.float().abs() * 2**-4 + absmax / QMAX["fp8"] * 2**-10
    else:  # half a step of the integer grid
        bound = absmax / QMAX[fmt] / 2
    assert (err <= bound * (1 + 1e-5) + out_rounding).all()
    if x.numel() >= 4096:
        assert sqnr_db(x, y) >= SQNR_FLOOR_DB[fmt]



def _extremes(dtype):
    """Rows at the dtype's largest finite magnitudes (+-max, just below, mixed with small values)."""
    big = torch.finfo(dtype).max
    x = torch.randn(6, 128, generator=torch.Generator().manual_seed(3)).clamp(-1, 1) * big
    x[0], x[1, ::2], x[2, ::2] = big, -big, big
    x[3, 0], x[4, 64] = -big, big
    x[5] = torch.finfo(dtype).tiny * torch.arange(1, 129)  # the small end: normal, near the minimum
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("stochastic", [False, True])
def test_values_up_to_the_dtype_max_decode_finite_within_the_bound(fmt, dtype, stochastic):
    x = _extremes(dtype)
    y = quantize(x, fmt, 64, stochastic=stochastic, seed=1).dequantize()
    assert torch.isfinite(y).all(), (fmt, dtype)  # int8 at FLT_MAX overflowed to inf: 127 x (FLT_MAX / 127)
    err = (y.float() - x.float()).abs()
    step = _group_absmax(x, 64) / QMAX[fmt] * (1 if stochastic else 0.5)
    bound = x.float().abs() * 2**-4 * (2 if stochastic else 1) + step * 2**-9 if fmt == "fp8" else step
    rel = {torch.float32: 2**-23, torch.float16: 2**-11, torch.bfloat16: 2**-8}[dtype]
    assert (err <= bound * (1 + 1e-5) + y.float().abs() * rel).all()
    assert (y[0].float() == torch.finfo(dtype).max).all()  # +-max itself is a code times the scale, exactly


def test_fp8_encoding_is_torchs_e4m3fn_cast():
    g = torch.Generator().manual_seed(1)
    y = torch.cat([torch.randn(50000, generator=g) * 100, torch.randn(5000, generator=g) * 0.01,
                   torch.tensor([448.0, -448.0, 2**-9, 2**-10, 3 * 2**-10, 2**-6, 240.0, 232.0, 248.0])]).clamp(-448, 448)
    y = y[y != 0]
    assert torch.equal(_fp8_encode(y, None), y.to(torch.float8_e4m3fn).view(torch.uint8))
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]  # e4m3fn's nan codes
    assert torch.equal(fp8_decode(codes), codes.view(torch.float8_e4m3fn).float())


@pytest.mark.parametrize("fmt", FORMATS)
def test_stochastic_rounding_is_unbiased_and_reproducible(fmt):
    x = torch.randn(32, 128, generator=torch.Generator().manual_seed(2))
    draws = torch.stack([quantize(x, fmt, 64, stochastic=True, seed=s).dequantize() - x for s in range(256)])
    mean_err = draws[:16].mean(0).abs().mean(), draws.mean(0).abs().mean()
    assert mean_err[1] < mean_err[0] / 2.5  # 16x the draws: about 4x smaller, as for an unbiased estimator
    nearest = (quantize(x, fmt, 64).dequantize() - x).abs().mean()
    assert nearest > 3 * mean_err[1]  # a single draw is no better than nearest; the average is far better
    a, b = quantize(x, fmt, 64, stochastic=True, seed=9), quantize(x, fmt, 64, stochastic=True, seed=9)
    assert torch.equal(a.codes, b.codes)
    assert not torch.equal(a.codes, quantize(x, fmt, 64, stochastic=True, seed=10).codes)


def test_bytes_held():
    x = torch.randn(64, 256)
    for fmt, code_bytes in (("int8", 1), ("fp8", 1), ("int4", 0.5)):
        q = quantize(x, fmt, 64)
        assert q.nbytes == int(x.numel() * code_bytes) + x.numel() // 64 * (4 + 1)  # codes, scales, flags


def test_zero_groups_and_non_finite_groups():
    x = torch.randn(4, 128)
    x[1] = 0
    x[2, 70] = float("inf")
    x[3, 5] = float("nan")
    for fmt in FORMATS:
        q = quantize(x, fmt, 64)
        y = q.dequantize()
        assert (q.scales[1] == 0).all() and (y[1] == 0).all()
        assert q.flags.tolist() == [[0, 0], [0, 0], [0, 1], [1, 0]] and q.has_nonfinite
        assert y[2, 64:].isnan().all() and y[3, :64].isnan().all()  # flagged groups decode to nan
        assert torch.isfinite(y[2, :64]).all() and torch.isfinite(y[3, 64:]).all()


def test_int4_packing_layout():
    x = torch.tensor([[7.0, -7.0] + [0.0] * 30])  # scale 1: codes 7 -> 15, -7 -> 1
    q = quantize(x, "int4", 32)
    assert q.codes[0, 0].item() == (15 | (1 << 4)) and q.codes.shape == (1, 16)


def test_bad_input_names_the_valid_values():
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match="unknown format 'int3'; valid formats: int8, fp8, int4"):
        quantize(x, "int3")
    with pytest.raises(ValueError, match=r"group_size 48 is not supported; valid group sizes: \(32, 64, 128\)"):
        quantize(x, "int8", 48)
    with pytest.raises(ValueError, match=r"group_size 128 does not divide the last dim 64; valid group sizes "
                                         r"for it: \[32, 64\]"):
        quantize(x, "int8", 128)
    with pytest.raises(ValueError, match="unsupported dtype torch.int32; valid dtypes: float32, float16, bfloat16"):
        quantize(torch.ones(4, 64, dtype=torch.int32))
    with pytest.raises(ValueError, match="empty"):
        quantize(torch.empty(0, 64))


def test_the_reference_never_divides_by_a_python_number():
    """torch on CUDA computes tensor / number as tensor * (1 / number), which is not IEEE division (for
    fp8's 448, 55% of quotients differ in the last bit): the reference divides by tensors, so it is the
    same function on every device, as the kernels are."""
    import math

    from torch.overrides import TorchFunctionMode

    divisions = []

    class Record(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if getattr(func, "__name__", "") in ("div", "__truediv__", "true_divide") and len(args) > 1:
                d = args[1]
                if not isinstance(d, torch.Tensor) and math.frexp(float(d))[0] != 0.5:  # not a power of two
                    divisions.append(d)
            return func(*args, **(kwargs or {}))

    x = torch.randn(8, 128)
    with Record():
        for fmt in FORMATS:
            for stochastic in (False, True):
                reference.dequantize(reference.quantize(x, fmt, 64, stochastic=stochastic, seed=3))
    assert divisions == []
