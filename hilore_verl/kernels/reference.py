"""Torch reference codecs for saved activations: group-wise absmax int8, fp8-e4m3 and int4.

The tensor is flattened (row-major) and cut into groups of `group_size` consecutive elements;
when the last dimension is a multiple of `group_size` (the runtime checks this for the hidden
size) no group spans two rows. A short last group is zero-padded. Per group:

    scale = absmax / QMAX                      (fp32; QMAX = 127 int8, 448 fp8-e4m3, 7 int4)
    code  = round_half_even(x / scale)         int8 in [-127, 127]; int4 in [-7, 7] stored +8,
                                               two per byte (even index in the low nibble);
            fp8_e4m3(x / scale)                fp8 by torch's round-to-nearest-even cast
    x'    = code * scale                       (back in x's dtype)

A group of zeros has scale 0 and decodes to exact zeros. Relative error per element is at most
half a step of its group: int8 1/254, int4 1/14 of the group absmax; fp8 about 2^-4 of the value.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FORMATS = ("int8", "fp8", "int4")
QMAX = {"int8": 127.0, "fp8": 448.0, "int4": 7.0}
GROUP_SIZES = (32, 64, 128)


@dataclass
class QuantizedTensor:
    """Codes + one fp32 scale per group; `dequantize()` gives back shape and dtype."""

    codes: torch.Tensor  # uint8 (fp8 bits, or int4 pairs) or int8
    scales: torch.Tensor  # (num_groups,) fp32
    shape: torch.Size
    dtype: torch.dtype
    fmt: str
    group_size: int

    @property
    def nbytes(self) -> int:
        return self.codes.numel() * self.codes.element_size() + self.scales.numel() * self.scales.element_size()

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def to(self, device: torch.device | str, non_blocking: bool = False, copy: bool = False) -> "QuantizedTensor":
        return QuantizedTensor(self.codes.to(device, non_blocking=non_blocking, copy=copy),
                               self.scales.to(device, non_blocking=non_blocking, copy=copy),
                               self.shape, self.dtype, self.fmt, self.group_size)

    def dequantize(self) -> torch.Tensor:
        return dequantize(self)


def _check(fmt: str, group_size: int) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; valid formats: {', '.join(FORMATS)}")
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group_size {group_size} is not supported; valid group sizes: {GROUP_SIZES}")


def _groups(x: torch.Tensor, group_size: int) -> torch.Tensor:
    flat = x.reshape(-1).float()
    pad = (-flat.numel()) % group_size
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    return flat.view(-1, group_size)


def quantize(x: torch.Tensor, fmt: str = "int8", group_size: int = 64) -> QuantizedTensor:
    """Quantize `x` (fp32 / fp16 / bf16, any shape) group-wise along its flattened elements."""
    _check(fmt, group_size)
    if not x.is_floating_point():
        raise ValueError(f"quantize takes floating-point tensors, got {x.dtype}")
    g = _groups(x, group_size)  # (G, group_size) fp32
    scales = g.abs().amax(dim=1) / QMAX[fmt]
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))[:, None]
    if fmt == "fp8":
        codes = (g / safe).to(torch.float8_e4m3fn).view(torch.uint8)
    else:
        q = torch.round(g / safe).clamp_(-QMAX[fmt], QMAX[fmt])
        if fmt == "int8":
            codes = q.to(torch.int8)
        else:
            nib = (q + 8).to(torch.uint8).view(-1, group_size // 2, 2)
            codes = nib[..., 0] | (nib[..., 1] << 4)
    return QuantizedTensor(codes.reshape(-1), scales, x.shape, x.dtype, fmt, group_size)


def dequantize(q: QuantizedTensor) -> torch.Tensor:
    """Inverse of `quantize` up to rounding: same shape and dtype as the input was."""
    if q.fmt == "fp8":
        values = q.codes.view(torch.float8_e4m3fn).float().view(-1, q.group_size)
    elif q.fmt == "int8":
        values = q.codes.float().view(-1, q.group_size)
    else:
        pairs = torch.stack([q.codes & 0x0F, q.codes >> 4], dim=-1)
        values = (pairs.float() - 8.0).view(-1, q.group_size)
    x = (values * q.scales[:, None]).reshape(-1)[: q.shape.numel()]
    return x.view(q.shape).to(q.dtype)
