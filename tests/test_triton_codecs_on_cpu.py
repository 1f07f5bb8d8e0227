"""The Triton codec kernels, bit for bit against the torch reference (Triton's interpreter on CPU).

Codes, scales and flags are compared as bits; dequantized outputs too (NaNs, which only flagged
groups produce, compared as NaN). Shapes have row counts that are not multiples of the kernels'
BLOCK_R (masked tails) and group counts above one per row.
"""

import os

import pytest
import torch

from hilore_verl.kernels import FORMATS, GROUP_SIZES, reference

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                reason="needs a GPU or Triton's interpreter (TRITON_INTERPRET=1, set by conftest)")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHAPES = [(37, 128), (2, 3, 256), (1, 384)]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.is_floating_point():
        nan = a.isnan()
        if not torch.equal(nan, b.isnan()):
            return False
        a, b = a.masked_fill(nan, 0), b.masked_fill(nan, 0)
        view = {4: torch.int32, 2: torch.int16}[a.element_size()]
        return torch.equal(a.contiguous().view(view), b.contiguous().view(view))
    return torch.equal(a, b)


def _x(shape, dtype, seed=0):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 3
    x.view(-1)[5] = 0.0
    return x.to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_and_dequantize_match_the_reference(fmt, dtype):
    from hilore_verl.kernels import triton_codec

    for group_size in GROUP_SIZES:
        for shape in SHAPES:
            for stochastic in (False, True):
                x = _x(shape, dtype)
                ref = reference.quantize(x.cpu(), fmt, group_size, stochastic, seed=7)
                out = triton_codec.quantize(x, fmt, group_size, stochastic, seed=7)
                for field in ("codes", "scales", "flags"):
                    assert same_bits(getattr(out, field).cpu(), getattr(ref, field)), (group_size, shape, field)
                assert same_bits(triton_codec.dequantize(out).cpu(), reference.dequantize(ref)), (group_size, shape)


def test_zero_and_non_finite_groups_match_the_reference():
    from hilore_verl.kernels import triton_codec

    x = _x((40, 128), torch.bfloat16)
    x[3] = 0
    x[7, 9] = float("inf")
    x[39, 100] = float("nan")
    for fmt in FORMATS:
        ref, out = reference.quantize(x.cpu(), fmt, 64), triton_codec.quantize(x, fmt, 64)
        assert same_bits(out.flags.cpu(), ref.flags) and int(out.flags.sum()) == 2
        assert same_bits(out.scales.cpu(), ref.scales) and same_bits(out.codes.cpu(), ref.codes)
        assert same_bits(triton_codec.dequantize(out).cpu(), reference.dequantize(ref))


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the interpreter's product, saturated
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_values_up_to_the_dtype_max_match_the_reference_and_decode_finite(dtype):
    from hilore_verl.kernels import triton_codec

    big = torch.finfo(dtype).max
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(4)).clamp(-1, 1) * big
    x[0], x[1, ::2], x[2, 3] = big, -big, -big
    x = x.to(dtype).to(DEVICE)
    for fmt in FORMATS:
        ref, out = reference.quantize(x.cpu(), fmt, 64), triton_codec.quantize(x, fmt, 64)
        y = triton_codec.dequantize(out).cpu()
        assert same_bits(out.codes.cpu(), ref.codes) and same_bits(out.scales.cpu(), ref.scales)
        assert same_bits(y, reference.dequantize(ref)) and torch.isfinite(y).all(), fmt
