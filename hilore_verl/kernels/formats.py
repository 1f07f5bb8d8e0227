"""One spec per codec format: what every other module (plans, config, cost model, kernels) reads.

A format maps y = x / scale (fp32, |y| <= qmax, scale = group absmax / qmax) to codes and back:

    int8   code = round_half_even(y)           int8 in [-127, 127]
    int4   code = round_half_even(y) + 8       in [1, 15], two per byte, even column in the low nibble
    fp8    code = e4m3fn(y), rounded half-even encoded with integer arithmetic (see _fp8_encode)

With `u` (stochastic rounding, u in [0, 1) per element) the integer formats take floor(y + u) and
fp8 floor(fraction + u) on its mantissa grid. Adding a format: one spec here (its encode / decode
in torch, the reference), a branch in the Triton kernels and in cpu_native.cpp keyed by `kernel_id`, and one
test.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

GROUP_SIZES = (32, 64, 128)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SCALE_BYTES, FLAG_BYTES = 4, 1  # per group: one fp32 scale and one flag byte


def round_half_even(y: torch.Tensor) -> torch.Tensor:
    r = torch.floor(y)
    frac = y - r  # exact for |y| < 2**23
    odd = (r - 2.0 * torch.floor(r * 0.5)) == 1.0
    return torch.where((frac > 0.5) | ((frac == 0.5) & odd), r + 1.0, r)


def _round(y: torch.Tensor, u: torch.Tensor | None) -> torch.Tensor:
    return round_half_even(y) if u is None else torch.floor(y + u)


def _int8_encode(y: torch.Tensor, u: torch.Tensor | None) -> torch.Tensor:
    return _round(y, u).clamp(-127.0, 127.0).to(torch.int8)


def _int8_decode(codes: torch.Tensor) -> torch.Tensor:
    return codes.float()


def _int4_encode(y: torch.Tensor, u: torch.Tensor | None) -> torch.Tensor:
    nib = (_round(y, u).clamp(-7.0, 7.0) + 8.0).to(torch.uint8)
    return nib[:, 0::2] | (nib[:, 1::2] << 4)


def _int4_decode(codes: torch.Tensor) -> torch.Tensor:
    return torch.stack([codes & 0x0F, codes >> 4], dim=-1).view(codes.shape[0], -1).float() - 8.0


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


@dataclass(frozen=True)
class Format:
    name: str
    qmax: float
    """Largest code magnitude: scale = group absmax / qmax."""
    code_bits: int
    """Bits per element of the codes."""
    code_dtype: torch.dtype
    encode: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]
    """(R, D) fp32 y, optional uniform u -> (R, D * code_bits / 8) codes: the reference."""
    decode: Callable[[torch.Tensor], torch.Tensor]
    """codes -> (R, D) fp32 values (to be multiplied by the scale)."""
    kernel_id: int
    """The FMT constant the Triton kernels and the native CPU library (cpu_native.cpp's enum) branch on."""

    def payload_ratio(self, element_size: int, group_size: int = 64) -> float:
        """Payload bytes per input byte: codes, plus a scale and a flag per group."""
        return (self.code_bits / 8 + (SCALE_BYTES + FLAG_BYTES) / group_size) / element_size

    def codes_shape(self, rows: int, cols: int) -> tuple[int, int]:
        return rows, cols * self.code_bits // 8


SPECS = {f.name: f for f in (
    Format("int8", 127.0, 8, torch.int8, _int8_encode, _int8_decode, 0),
    Format("fp8", 448.0, 8, torch.uint8, _fp8_encode, fp8_decode, 1),
    Format("int4", 7.0, 4, torch.uint8, _int4_encode, _int4_decode, 2),
)}
FORMATS = tuple(SPECS)
QMAX = {name: f.qmax for name, f in SPECS.items()}


def payload_ratio(fmt: str, element_size: int, group_size: int = 64) -> float:
    return SPECS[fmt].payload_ratio(element_size, group_size)
