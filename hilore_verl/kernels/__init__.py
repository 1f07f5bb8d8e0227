"""Codecs for saved activations: group-wise int8 / fp8-e4m3 / int4, and row-mixed precision.

    q = quantize(x, fmt="int8", group_size=64)       # QuantizedTensor: codes + scales + flags
    y = q.dequantize()                                # x's shape and dtype
    qm = quantize_rows(x, row_fmt)                    # per-row keep / int8 / int4 in one payload

Dispatch by device: Triton kernels for CUDA tensors, the torch reference (`kernels.reference`)
for CPU tensors. The Triton kernels are tested on CPU against the reference through Triton's
interpreter (TRITON_INTERPRET=1).
"""

from __future__ import annotations

import torch

from hilore_verl.kernels import reference, rows
from hilore_verl.kernels.reference import DTYPES, FORMATS, GROUP_SIZES, QuantizedTensor
from hilore_verl.kernels.rows import ROW_INT4, ROW_INT8, ROW_KEEP, RowQuantized


def quantize(x: torch.Tensor, fmt: str = "int8", group_size: int = 64, stochastic: bool = False,
             seed: int = 0) -> QuantizedTensor:
    if x.is_cuda:
        from hilore_verl.kernels import triton_codec

        return triton_codec.quantize(x, fmt, group_size, stochastic, seed)
    return reference.quantize(x, fmt, group_size, stochastic, seed)


def dequantize(q: QuantizedTensor) -> torch.Tensor:
    if q.codes.is_cuda:
        from hilore_verl.kernels import triton_codec

        return triton_codec.dequantize(q)
    return reference.dequantize(q)


__all__ = ["DTYPES", "FORMATS", "GROUP_SIZES", "QuantizedTensor", "dequantize", "quantize"]


def quantize_rows(x: torch.Tensor, row_fmt: torch.Tensor, group_size: int = 64) -> RowQuantized:
    """Row-mixed precision: row_fmt (R,) int8 with ROW_KEEP (0), ROW_INT8 (1) or ROW_INT4 (2) per row."""
    if x.is_cuda:
        from hilore_verl.kernels import triton_rows

        return triton_rows.quantize_rows(x, row_fmt, group_size)
    return rows.quantize_rows(x, row_fmt, group_size)


def dequantize_rows(q: RowQuantized) -> torch.Tensor:
    if q.codes.is_cuda:
        from hilore_verl.kernels import triton_rows

        return triton_rows.dequantize_rows(q)
    return rows.dequantize_rows(q)


__all__ += ["ROW_INT4", "ROW_INT8", "ROW_KEEP", "RowQuantized", "dequantize_rows", "quantize_rows"]
