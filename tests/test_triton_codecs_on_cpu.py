"""The Triton codec kernels, bit for bit against the torch reference (Triton's interpreter on CPU).

Codes, scales and flags are compared as bits; dequantized outputs too (NaNs, which only flagged
groups produce, compared as NaN). Shapes have row counts that are not multiples of the kernels'
BLOCK_R (masked tails) and group counts above one per row.
"""

import os

import pytest
import torch

from hilore_verl.kernels import FORMATS, GROUP_SIZES, reference, rows

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
    from hilore_verl.kernels import triton_codec, triton_rows

    big = torch.finfo(dtype).max
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(4)).clamp(-1, 1) * big
    x[0], x[1, ::2], x[2, 3] = big, -big, -big
    x = x.to(dtype).to(DEVICE)
    for fmt in FORMATS:
        ref, out = reference.quantize(x.cpu(), fmt, 64), triton_codec.quantize(x, fmt, 64)
        y = triton_codec.dequantize(out).cpu()
        assert same_bits(out.codes.cpu(), ref.codes) and same_bits(out.scales.cpu(), ref.scales)
        assert same_bits(y, reference.dequantize(ref)) and torch.isfinite(y).all(), fmt
    row_fmt = torch.tensor([1, 2, 0, 1, 2], dtype=torch.int8)
    y = triton_rows.dequantize_rows(triton_rows.quantize_rows(x, row_fmt.to(DEVICE), 64)).cpu()
    assert same_bits(y, rows.dequantize_rows(rows.quantize_rows(x.cpu(), row_fmt, 64))) and torch.isfinite(y).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_row_mixed_kernels_match_the_reference(dtype):
    from hilore_verl.kernels import triton_rows

    for group_size in GROUP_SIZES:
        x = _x((45, 256), dtype, seed=group_size)
        row_fmt = torch.randint(0, 3, (45,), generator=torch.Generator().manual_seed(group_size), dtype=torch.int8)
        x[4, 3] = float("nan")
        row_fmt[4] = 1
        ref = rows.quantize_rows(x.cpu(), row_fmt, group_size)
        out = triton_rows.quantize_rows(x, row_fmt.to(DEVICE), group_size)
        for field in ("keep", "codes", "scales", "flags", "index"):
            assert same_bits(getattr(out, field).cpu(), getattr(ref, field)), (group_size, field)
        y = triton_rows.dequantize_rows(out).cpu()
        assert same_bits(y, rows.dequantize_rows(ref))
        keep = row_fmt == rows.ROW_KEEP
        assert same_bits(y[keep], x.cpu()[keep])  # keep rows bit-exact


def test_row_mixed_all_keep_and_all_compressed():
    from hilore_verl.kernels import triton_rows

    x = _x((33, 128), torch.float32)
    for cls in (0, 1, 2):
        row_fmt = torch.full((33,), cls, dtype=torch.int8)
        out = triton_rows.quantize_rows(x, row_fmt.to(DEVICE), 64)
        assert same_bits(triton_rows.dequantize_rows(out).cpu(),
                         rows.dequantize_rows(rows.quantize_rows(x.cpu(), row_fmt, 64)))
