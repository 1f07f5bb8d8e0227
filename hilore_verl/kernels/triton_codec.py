"""Triton kernels for the group-wise codecs; bit-for-bit the torch reference (`kernels.reference`).

One program handles BLOCK_R rows x one group (a tile of BLOCK_R x group_size), so a grid is
(cdiv(R, BLOCK_R), D / group_size), cut into several launches (each given its first row and group)
where that passes CUDA's grid limits; rows past R are masked, offsets are 64-bit. Everything is
fp32 inside. Written to
run unchanged in Triton's interpreter on CPU tensors (how the tests check them): bf16 moves in
and out as raw int16 bits with rounding done here, divisions are `div_rn`, and no libdevice call
is used. One config; tune BLOCK_R on a GPU with `benchmarks/codec_bandwidth.py`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hilore_verl.kernels.formats import QMAX, SPECS
from hilore_verl.kernels.reference import QuantizedTensor, check_args, seed_mix

FMT_CODE = {name: spec.kernel_id for name, spec in SPECS.items()}
BLOCK_R = 32
# CUDA's grid limits (x: 2**31 - 1 blocks, y: 65535): a tensor past them takes several launches.
MAX_GRID = (2**31 - 1, 65535)
# Integer arguments compiled as runtime values: Triton otherwise compiles an int equal to 1 as a
# constant (`smix.to(...)` then fails to compile) and recompiles on alignment. D stays specialised
# (always a multiple of 32: one variant, known 16-aligned).
RUNTIME_INTS = ("R", "R0", "G0", "smix")


class LaunchError(RuntimeError):
    """A kernel could not be compiled or launched (e.g. Triton's launcher could not be built: no C
    compiler, no Python.h, no libcuda). The call's outputs are dropped; `triton_guard` runs the
    reference instead."""


def _kind(dtype: torch.dtype) -> int:
    return {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}[dtype]


@triton.jit
def _load_f32(ptr, offs, mask, KIND: tl.constexpr):
    if KIND == 2:  # bf16 as int16 bits
        bits = tl.load(ptr + offs, mask=mask, other=0).to(tl.int32) & 0xFFFF
        return (bits << 16).to(tl.float32, bitcast=True)
    else:
        return tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _store_from_f32(ptr, offs, x, mask, KIND: tl.constexpr):
    if KIND == 2:  # round half-even to bf16, store the bits; any NaN -> 0x7FC0, as torch's scalar cast
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # a NaN's payload would carry into the sign or exponent
        rounded = tl.where((bits & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, rounded)
        tl.store(ptr + offs, rounded.to(tl.uint16).to(tl.int16, bitcast=True), mask=mask)
    elif KIND == 1:
        tl.store(ptr + offs, x.to(tl.float16), mask=mask)
    else:
        tl.store(ptr + offs, x, mask=mask)


@triton.jit
def _saturate(x):
    """value * scale past FLT_MAX (int8 at absmax = FLT_MAX) to +-FLT_MAX, as the reference does."""
    big = tl.abs(x) == float("inf")
    return tl.where(big, tl.where(x > 0.0, 3.4028234663852886e38, -3.4028234663852886e38), x)


@triton.jit
def _rne(y):
    r = tl.floor(y)
    frac = y - r
    odd = (r - 2.0 * tl.floor(r * 0.5)) == 1.0
    return tl.where((frac > 0.5) | ((frac == 0.5) & odd), r + 1.0, r)


@triton.jit
def _uniform(idx, smix):
    h = idx.to(tl.uint32) * 0x61C88647 + smix.to(tl.uint32)
    h = h ^ (h >> 16)
    h = h * 0x7FEB352D
    h = h ^ (h >> 15)
    h = h * 0x5A2C4E6B
    h = h ^ (h >> 16)
    return (h >> 8).to(tl.float32) * (1.0 / 16777216.0)


@triton.jit
def _round(y, idx, smix, STOCHASTIC: tl.constexpr):
    if STOCHASTIC:
        return tl.floor(y + _uniform(idx, smix))
    else:
        return _rne(y)


@triton.jit
def _fp8_encode(y, idx, smix, STOCHASTIC: tl.constexpr):
    a = tl.abs(y)
    e = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    normal = e >= -6
    e = tl.where(normal, e, -6)
    inv_pow = ((127 - e) << 23).to(tl.float32, bitcast=True)
    m = tl.where(normal, a * inv_pow - 1.0, a * 512.0 * 0.125)
    q = _round(m * 8.0, idx, smix, STOCHASTIC)
    carry = q >= 8.0
    exp_field = tl.where(normal, e + 7, 0)
    exp_field = tl.where(carry, exp_field + 1, exp_field)
    q = tl.where(carry, 0.0, q)
    code = tl.minimum((exp_field << 3) | q.to(tl.int32), 0x7E)
    return code | ((y < 0).to(tl.int32) << 7)


@triton.jit
def _fp8_decode(code):
    c = code.to(tl.int32) & 0xFF
    e = (c >> 3) & 0xF
    q = (c & 7).to(tl.float32)
    pow2 = ((tl.maximum(e, 1) - 7 + 127) << 23).to(tl.float32, bitcast=True)
    value = tl.where(e == 0, q * 0.001953125, (1.0 + q * 0.125) * pow2)
    return tl.where((c & 0x80) != 0, -value, value)


@triton.jit
def _group_scale(x, QMAX: tl.constexpr):
    """Per row of the tile: (scale with nan for non-finite groups, divisor, finite flag)."""
    fin = (x == x) & (tl.abs(x) < float("inf"))
    finite = tl.min(fin.to(tl.int32), axis=1) == 1
    absmax = tl.max(tl.where(fin, tl.abs(x), 0.0), axis=1)
    scale = tl.math.div_rn(absmax, QMAX)
    safe = tl.where(scale > 0.0, scale, 1.0)
    return scale, safe, finite


@triton.jit
def _pair_absmax(xe, xo):
    """Per row of a tile read as even and odd columns: (all finite, absmax over the finite values)."""
    fin_e = (xe == xe) & (tl.abs(xe) < float("inf"))
    fin_o = (xo == xo) & (tl.abs(xo) < float("inf"))
    finite = (tl.min(fin_e.to(tl.int32), axis=1) == 1) & (tl.min(fin_o.to(tl.int32), axis=1) == 1)
    absmax = tl.maximum(tl.max(tl.where(fin_e, tl.abs(xe), 0.0), axis=1),
                        tl.max(tl.where(fin_o, tl.abs(xo), 0.0), axis=1))
    return finite, absmax


@triton.jit(do_not_specialize=RUNTIME_INTS)
def _quantize_kernel(X, CODES, SCALES, FLAGS, R, D, R0, G0, smix, GS: tl.constexpr, BLOCK_R: tl.constexpr,
                     FMT: tl.constexpr, KIND: tl.constexpr, STOCHASTIC: tl.constexpr, QMAX: tl.constexpr):
    rows = R0 + tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    gi = G0 + tl.program_id(1).to(tl.int64)
    rmask = rows < R
    row_base = rows * D
    if FMT == 2:  # int4: even and odd columns separately, to pack pairs
        HALF: tl.constexpr = GS // 2
        cols = gi * GS + 2 * tl.arange(0, HALF)
        offs = row_base[:, None] + cols[None, :]
        m2 = rmask[:, None]
        xe = _load_f32(X, offs, m2, KIND)
        xo = _load_f32(X, offs + 1, m2, KIND)
        finite, absmax = _pair_absmax(xe, xo)
        scale = tl.math.div_rn(absmax, QMAX)
        safe = tl.where(scale > 0.0, scale, 1.0)
        ye = tl.where(finite[:, None], tl.math.div_rn(xe, safe[:, None]), 0.0)
        yo = tl.where(finite[:, None], tl.math.div_rn(xo, safe[:, None]), 0.0)
        qe = tl.minimum(tl.maximum(_round(ye, offs, smix, STOCHASTIC), -QMAX), QMAX)
        qo = tl.minimum(tl.maximum(_round(yo, offs + 1, smix, STOCHASTIC), -QMAX), QMAX)
        byte = (qe + 8.0).to(tl.int32) | ((qo + 8.0).to(tl.int32) << 4)
        code_offs = rows[:, None] * (D // 2) + (gi * HALF + tl.arange(0, HALF))[None, :]
        tl.store(CODES + code_offs, byte.to(tl.uint8), mask=m2)
    else:
        cols = gi * GS + tl.arange(0, GS)
        offs = row_base[:, None] + cols[None, :]
        m2 = rmask[:, None]
        x = _load_f32(X, offs, m2, KIND)
        scale, safe, finite = _group_scale(x, QMAX)
        y = tl.where(finite[:, None], tl.math.div_rn(x, safe[:, None]), 0.0)
        if FMT == 1:
            tl.store(CODES + offs, _fp8_encode(y, offs, smix, STOCHASTIC).to(tl.uint8), mask=m2)
        else:
            q = tl.minimum(tl.maximum(_round(y, offs, smix, STOCHASTIC), -QMAX), QMAX)
            tl.store(CODES + offs, q.to(tl.int8), mask=m2)
    G = D // GS
    s_offs = rows * G + gi
    tl.store(SCALES + s_offs, tl.where(finite, scale, float("nan")), mask=rmask)
    tl.store(FLAGS + s_offs, tl.where(finite, 0, 1).to(tl.uint8), mask=rmask)


@triton.jit(do_not_specialize=RUNTIME_INTS)
def _dequantize_kernel(CODES, SCALES, OUT, R, D, R0, G0, GS: tl.constexpr, BLOCK_R: tl.constexpr,
                       FMT: tl.constexpr, KIND: tl.constexpr):
    rows = R0 + tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    gi = G0 + tl.program_id(1).to(tl.int64)
    rmask = rows < R
    m2 = rmask[:, None]
    scale = tl.load(SCALES + rows * (D // GS) + gi, mask=rmask, other=0.0)
    row_base = rows * D
    if FMT == 2:
        HALF: tl.constexpr = GS // 2
        code_offs = rows[:, None] * (D // 2) + (gi * HALF + tl.arange(0, HALF))[None, :]
        byte = tl.load(CODES + code_offs, mask=m2, other=0).to(tl.int32) & 0xFF
        lo = _saturate(((byte & 0x0F) - 8).to(tl.float32) * scale[:, None])
        hi = _saturate(((byte >> 4) - 8).to(tl.float32) * scale[:, None])
        offs = row_base[:, None] + (gi * GS + 2 * tl.arange(0, HALF))[None, :]
        _store_from_f32(OUT, offs, lo, m2, KIND)
        _store_from_f32(OUT, offs + 1, hi, m2, KIND)
    else:
        offs = row_base[:, None] + (gi * GS + tl.arange(0, GS))[None, :]
        code = tl.load(CODES + offs, mask=m2, other=0)
        if FMT == 1:
            value = _fp8_decode(code)
        else:
            value = code.to(tl.float32)
        _store_from_f32(OUT, offs, _saturate(value * scale[:, None]), m2, KIND)


def _as_kernel_view(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int16) if x.dtype == torch.bfloat16 else x


def launches(R: int, G: int) -> list[tuple[int, int, tuple[int, int]]]:
    """(first row, first group, grid) per launch: the (row block, group) tiles of an R x G-group
    tensor, cut to MAX_GRID (one launch unless a dim is past CUDA's grid limit)."""
    blocks = triton.cdiv(R, BLOCK_R)
    return [(b0 * BLOCK_R, g0, (min(MAX_GRID[0], blocks - b0), min(MAX_GRID[1], G - g0)))
            for b0 in range(0, blocks, MAX_GRID[0]) for g0 in range(0, G, MAX_GRID[1])]


def _launch(kernel, R: int, G: int, *args, **meta) -> None:
    try:
        for r0, g0, grid in launches(R, G):
            kernel[grid](*args, R0=r0, G0=g0, **meta)
    except torch.OutOfMemoryError:
        raise
    except Exception as e:  # compiling, building Triton's launcher, loading the module
        raise LaunchError(f"{type(e).__name__}: {e}") from e


def quantize(x: torch.Tensor, fmt: str = "int8", group_size: int = 64, stochastic: bool = False,
             seed: int = 0) -> QuantizedTensor:
    check_args(x, fmt, group_size)
    D = x.shape[-1]
    x2 = x.reshape(-1, D).contiguous()
    R, G = x2.shape[0], D // group_size
    codes = torch.empty(SPECS[fmt].codes_shape(R, D), device=x.device, dtype=SPECS[fmt].code_dtype)
    scales = torch.empty((R, G), device=x.device, dtype=torch.float32)
    flags = torch.empty((R, G), device=x.device, dtype=torch.uint8)
    _launch(_quantize_kernel, R, G, _as_kernel_view(x2), codes, scales, flags, R, D, smix=seed_mix(seed),
            GS=group_size, BLOCK_R=BLOCK_R, FMT=FMT_CODE[fmt], KIND=_kind(x.dtype), STOCHASTIC=stochastic,
            QMAX=QMAX[fmt])
    return QuantizedTensor(codes, scales, flags, x.shape, x.dtype, fmt, group_size)


def dequantize(q: QuantizedTensor) -> torch.Tensor:
    R, G = q.scales.shape
    D = G * q.group_size
    out = torch.empty((R, D), device=q.codes.device, dtype=q.dtype)
    _launch(_dequantize_kernel, R, G, q.codes, q.scales, _as_kernel_view(out), R, D, GS=q.group_size,
            BLOCK_R=BLOCK_R, FMT=FMT_CODE[q.fmt], KIND=_kind(q.dtype))
    return out.view(q.shape)
