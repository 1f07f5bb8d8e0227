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
to nan rather than to wrong finite values; `QuantizedTensor.has_nonfinite` reports it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FORMATS = ("int8", "fp8", "int4")
GROUP_SIZES = (32, 64, 128)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
QMAX = {"int8": 127.0, "fp8": 448.0, "int4": 7.0}
FLT_MAX = torch.finfo(torch.float32).max
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
        return bool(self.flags.any())

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
    """u in [0, 1) from a 32-bit integer hash of (seed, element index): the same numbers as the kernels.
    int64 products may wrap; only their low 32 bits are used, and those are exact."""
    h = ((index & _M32) * _IDX_MUL + seed_mix(seed)) & _M32
    h = h ^ (h >> 16)
    h = (h * _MIX1) & _M32
    h = h ^ (h >> 15)
    h = (h * _MIX2) & _M32
    h = h ^ (h >> 16)
    return (h >> 8).float() * (1.0 / 16777216.0)


def round_half_even(y: torch.Tensor) -> torch.Tensor:
    r = torch.floor(y)
    frac = y - r  # exact for |y| < 2**23
    odd = (r - 2.0 * torch.floor(r * 0.5)) == 1.0
    return torch.where((frac > 0.5) | ((frac == 0.5) & odd), r + 1.0, r)


def _round(y: torch.Tensor, u: torch.Tensor | None) -> torch.Tensor:
    return round_half_even(y) if u is None else torch.floor(y + u)


def _fp8_encode(y: torch.Tensor, u: torch.Tensor | None) -> torch.Tensor:
    """fp32 y with |y| <= 448 (or a hair above) -> e4m3fn bits (uint8), rounding on the e4m3 grid."""
    a = y.abs()
    bits = a.view(torch.int32)
    e = ((bits >> 23) & 0xFF) - 127  # unbiased exponent of a (a is normal or zero here)
    normal = e >= -6
    e = torch.where(normal, e, torch.full_like(e, -6))
    # a / 2**e by building the power of two from bits: exact
    inv_pow = ((127 - e) << 23).view(torch.float32)
    m = torch.where(normal, a * inv_pow - 1.0, a * 512.0 * 0.125)  # normal: mantissa fraction; sub: a / 2**-6
    q = _round(m * 8.0, u)  # 0..8
    carry = q >= 8.0
    exp_field = torch.where(normal, e + 7, torch.zeros_like(e))
    exp_field = torch.where(carry, exp_field + 1, exp_field)
    q = torch.where(carry, torch.zeros_like(q), q)
    # a subnormal that rounds up to 2**-6 becomes exponent field 1, mantissa 0, which the carry gives
    code = (exp_field << 3) | q.to(torch.int32)
    code = torch.clamp(code, max=0x7E)  # 448: the largest finite e4m3fn
    return (code | ((y < 0).to(torch.int32) << 7)).to(torch.uint8)


def fp8_decode(codes: torch.Tensor) -> torch.Tensor:
    c = codes.to(torch.int32)
    e, q = (c >> 3) & 0xF, (c & 7).float()
    pow2 = ((torch.clamp(e, min=1) - 7 + 127) << 23).view(torch.float32)
    value = torch.where(e == 0, q * 0.001953125, (1.0 + q * 0.125) * pow2)  # 2**-9 * q for subnormals
    return torch.where((c & 0x80) != 0, -value, value)


def quantize(x: torch.Tensor, fmt: str = "int8", group_size: int = 64, stochastic: bool = False,
             seed: int = 0) -> QuantizedTensor:
    """Group-wise absmax quantization of `x` (fp32 / fp16 / bf16, last dim a multiple of group_size)."""
    check_args(x, fmt, group_size)
    D = x.shape[-1]
    xf = x.reshape(-1, D).float()
    R, G = xf.shape[0], D // group_size
    g = xf.view(R, G, group_size)
    finite = torch.isfinite(g).all(dim=-1)
    absmax = torch.where(torch.isfinite(g), g.abs(), torch.zeros_like(g)).amax(dim=-1)
    scales = absmax / QMAX[fmt]
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    y = torch.where(finite[..., None], g / safe[..., None], torch.zeros_like(g)).view(R, D)
    u = uniform(seed, torch.arange(R * D, dtype=torch.int64).view(R, D)) if stochastic else None
    if fmt == "fp8":
        codes = _fp8_encode(y, u)
    else:
        q = _round(y, u).clamp_(-QMAX[fmt], QMAX[fmt])
        if fmt == "int8":
            codes = q.to(torch.int8)
        else:
            nib = (q + 8.0).to(torch.uint8)
            codes = nib[:, 0::2] | (nib[:, 1::2] << 4)
    scales = torch.where(finite, scales, torch.full_like(scales, float("nan")))
    return QuantizedTensor(codes, scales, (~finite).to(torch.uint8), x.shape, x.dtype, fmt, group_size)


def dequantize(q: QuantizedTensor) -> torch.Tensor:
    """value(code) * scale in fp32, rounded half-even to the original dtype."""
    R, G = q.scales.shape
    if q.fmt == "fp8":
        values = fp8_decode(q.codes)
    elif q.fmt == "int8":
        values = q.codes.float()
    else:
        values = torch.stack([q.codes & 0x0F, q.codes >> 4], dim=-1).view(R, -1).float() - 8.0
    x = values.view(R, G, q.group_size) * q.scales[..., None]
    x = x.clamp_(-FLT_MAX, FLT_MAX)  # an overflow past FLT_MAX saturates (scales are never inf; NaN stays NaN)
    return x.reshape(q.shape).to(q.dtype)
