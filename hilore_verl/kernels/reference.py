"""Torch reference codecs for saved activations. The Triton kernels are held to these bit for bit.

A tensor x of shape (..., D) is viewed as R x D rows; each row is cut into groups of `group_size`
along the last dim (D must be a multiple). Per group, in fp32:

    scale = absmax / QMAX                        QMAX: int8 127, fp8-e4m3 448, int4 7
    y     = x / scale                            (IEEE division; a zero group has scale 0, codes 0)
    int8  code = round_half_even(y)              int8 in [-127, 127]
    int4  code = round_half_even(y) + 8          in [1, 15], two per byte, even column in the low nibble
    fp8   code = e4m3fn(y), rounded half-even    encoded with integer arithmetic (see _fp8_encode)
    x'    = value(code) * scale                  then rounded half-even to x's dtype; a product past
                                                 FLT_MAX (only int8 at absmax = FLT_MAX, where scale
                                                 rounds up) saturates to +-FLT_MAX instead of inf

Stochastic rounding (`stochastic=True`, explicit `seed`): round down or up with probability equal
to the distance, using u = hash(seed, element index) in [0, 1): floor(y + u) for the integer
formats, floor(fraction + u) on the fp8 mantissa grid. Unbiased, and reproducible from the seed.

A group holding inf or nan is flagged (`flags` = 1), gets codes 0 and a nan scale, so it decodes
to nan rather than to wrong finite values; `QuantizedTensor.has_nonfinite` reports it (on the host),
`any_nonfinite()` as a device tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hilore_verl.kernels.formats import (DTYPES, FORMATS, GROUP_SIZES, QMAX, SPECS, _fp8_encode, fp8_decode,  # noqa: F401
                                         round_half_even)

FLT_MAX = torch.finfo(torch.float32).max
CHUNK_ELEMENTS = 2**20  # the codec's fp32 temporaries (about 6 per element) follow a chunk, not the tensor
_M32 = 0xFFFFFFFF


@dataclass
class QuantizedTensor:
    """Codes + one fp32 scale and one flag byte per group; `dequantize()` gives back shape and dtype."""

    codes: torch.Tensor  # (R, D) int8 | (R, D) uint8 fp8 bits | (R, D // 2) uint8 int4 pairs
    scales: torch.Tensor  # (R, D // group_size) fp32
    flags: torch.Tensor  # (R, D // group_size) uint8: 1 where the group held inf / nan
    shape: torch.Size
    dtype: torch.dtype
    fmt: str
    group_size: int

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.flags))

    @property
    def device(self) -> torch.device:
        return self.codes.device

    @property
    def has_nonfinite(self) -> bool:
        """Reads the flags on the host: on a GPU this waits for the device (see `any_nonfinite`)."""
        return bool(self.flags.any())

    def any_nonfinite(self) -> torch.Tensor:
        """Whether a group held inf / nan, as a 0-d bool tensor on the payload's device (no host read)."""
        return self.flags.any()

    def to(self, device, non_blocking: bool = False, copy: bool = False) -> "QuantizedTensor":
        move = lambda t: t.to(device, non_blocking=non_blocking, copy=copy)  # noqa: E731
        return QuantizedTensor(move(self.codes), move(self.scales), move(self.flags), self.shape, self.dtype,
                               self.fmt, self.group_size)

    def dequantize(self) -> torch.Tensor:
        from hilore_verl.kernels import dequantize

        return dequantize(self)


def check_args(x: torch.Tensor, fmt: str, group_size: int) -> None:
    """ValueError naming the bad value and the valid choices."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; valid formats: {', '.join(FORMATS)}")
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group_size {group_size} is not supported; valid group sizes: {GROUP_SIZES}")
    if x.dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {x.dtype}; valid dtypes: float32, float16, bfloat16")
    if x.numel() == 0 or x.dim() == 0:
        raise ValueError(f"cannot quantize an empty or 0-d tensor (shape {tuple(x.shape)})")
    if x.shape[-1] % group_size:
        valid = [g for g in GROUP_SIZES if x.shape[-1] % g == 0]
        raise ValueError(f"group_size {group_size} does not divide the last dim {x.shape[-1]}; "
                         f"valid group sizes for it: {valid or 'none'}")


# Hash constants, all odd and below 2**31 so that the kernels can use them as 32-bit literals.
_IDX_MUL, _SEED_MUL, _MIX1, _MIX2 = 0x61C88647, 0x2C1B3C6D, 0x7FEB352D, 0x5A2C4E6B


def seed_mix(seed: int) -> int:
    """The seed's 31-bit contribution to every element's hash (what the kernels take as an argument)."""
    return ((seed & _M32) * _SEED_MUL) & 0x7FFFFFFF


def uniform(seed: int, index: torch.Tensor) -> torch.Tensor:
    """u in [0, 1) from a 32-bit integer hash of (seed, element index): the same numbers as the kernels."""
    return _uniform_mixed(seed_mix(seed), index)


def _uniform_mixed(smix: int, index: torch.Tensor) -> torch.Tensor:
    """int64 products may wrap; only their low 32 bits are used, and those are exact."""
    h = ((index & _M32) * _IDX_MUL + smix) & _M32
    h = h ^ (h >> 16)
    h = (h * _MIX1) & _M32
    h = h ^ (h >> 15)
    h = (h * _MIX2) & _M32
    h = h ^ (h >> 16)
    return (h >> 8).float() * (1.0 / 16777216.0)


def _row_chunks(rows: int, width: int) -> list[tuple[int, int]]:
    """(start, end) rows of at most CHUNK_ELEMENTS elements each (at least one row)."""
    step = max(CHUNK_ELEMENTS // max(width, 1), 1)
    return [(r, min(r + step, rows)) for r in range(0, rows, step)]


def quantize(x: torch.Tensor, fmt: str = "int8", group_size: int = 64, stochastic: bool = False,
             seed: int = 0) -> QuantizedTensor:
    """Group-wise absmax quantization of `x` (fp32 / fp16 / bf16, last dim a multiple of group_size), in
    chunks of rows (each group is computed as it would be whole: the same bits)."""
    check_args(x, fmt, group_size)
    x2 = x.reshape(-1, x.shape[-1])
    chunks = _row_chunks(*x2.shape)
    out = None
    for start, end in chunks:
        part = quantize_2d(x2[start:end], fmt, group_size, stochastic, seed_mix(seed), first=start * x2.shape[1])
        if len(chunks) == 1:
            out = part
            break
        if out is None:
            out = tuple(torch.empty((x2.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device) for t in part)
        for whole, piece in zip(out, part):
            whole[start:end] = piece
    codes, scales, flags = out
    return QuantizedTensor(codes, scales, flags, x.shape, x.dtype, fmt, group_size)


def quantize_2d(x: torch.Tensor, fmt: str, group_size: int, stochastic: bool, smix, first: int = 0):
    """(R, D) -> codes, scales (R, G) fp32, flags (R, G) uint8; `smix`: seed_mix(seed), an int or a 0-d
    int64 tensor; `first`: the flat index of x's first element in the whole tensor (stochastic rounding
    hashes it). Pure tensor code: the fused CPU path compiles it."""
    xf = x.float()
    R, D = xf.shape
    G = D // group_size
    g = xf.view(R, G, group_size)
    finite_elem = torch.isfinite(g)
    finite = finite_elem.all(dim=-1)
    absmax = torch.where(finite_elem, g.abs(), torch.zeros_like(g)).amax(dim=-1)
    # divided by a tensor, not a Python number: torch on CUDA turns the latter into a product with the
    # reciprocal, which differs from IEEE division (and the kernels) in the last bit
    scales = absmax / torch.full_like(absmax, QMAX[fmt])
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    y = torch.where(finite[..., None], g / safe[..., None], torch.zeros_like(g)).view(R, D)
    u = (_uniform_mixed(smix, torch.arange(first, first + R * D, dtype=torch.int64, device=x.device).view(R, D))
         if stochastic else None)
    codes = SPECS[fmt].encode(y, u)
    scales = torch.where(finite, scales, torch.full_like(scales, float("nan")))
    return codes, scales, (~finite).to(torch.uint8)


def dequantize(q: QuantizedTensor) -> torch.Tensor:
    """value(code) * scale in fp32, rounded half-even to the original dtype, in chunks of rows."""
    rows, groups = q.scales.shape
    chunks = _row_chunks(rows, groups * q.group_size)
    if len(chunks) == 1:
        return dequantize_2d(q.codes, q.scales, q.fmt, q.group_size, q.dtype).reshape(q.shape)
    out = torch.empty((rows, groups * q.group_size), dtype=q.dtype, device=q.codes.device)
    for start, end in chunks:
        out[start:end] = dequantize_2d(q.codes[start:end], q.scales[start:end], q.fmt, q.group_size, q.dtype)
    return out.reshape(q.shape)


def dequantize_2d(codes: torch.Tensor, scales: torch.Tensor, fmt: str, group_size: int,
                  dtype: torch.dtype) -> torch.Tensor:
    R, G = scales.shape
    x = SPECS[fmt].decode(codes).view(R, G, group_size) * scales[..., None]
    x = x.clamp(-FLT_MAX, FLT_MAX)  # an overflow past FLT_MAX saturates (scales are never inf; NaN stays NaN)
    return x.view(R, G * group_size).to(dtype)

