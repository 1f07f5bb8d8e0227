"""Row-mixed precision: each row (token) kept exact, or int8, or int4, in one compact payload.

Exposure differs per token (tokens of zero-advantage groups cannot move the update at all), so
precision can follow it row by row. Layout for R rows of D elements, with `row_fmt` (R,) int8:

    keep    (n_keep, D) in x's dtype      rows classed KEEP, in row order (bit-exact copies)
    codes   (bytes,) uint8                int8 rows take D bytes, int4 rows D / 2, in row order
    scales  (n_q, D / g) fp32, flags (n_q, D / g) uint8   for the compressed rows, in row order
    index   (R, 2) int64                  [offset, slot]: a KEEP row's position in `keep`, or a
                                          compressed row's byte offset in `codes`; slot = its row in scales

The torch reference lives here; the Triton kernels in `triton_rows.py` match it bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hilore_verl.kernels import reference
from hilore_verl.kernels.reference import QuantizedTensor, check_args

ROW_KEEP, ROW_INT8, ROW_INT4 = 0, 1, 2
ROW_CLASSES = {"keep": ROW_KEEP, "int8": ROW_INT8, "int4": ROW_INT4}


@dataclass
class RowQuantized:
    keep: torch.Tensor
    codes: torch.Tensor
    scales: torch.Tensor
    flags: torch.Tensor
    row_fmt: torch.Tensor
    index: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype
    group_size: int

    @property
    def nbytes(self) -> int:
        parts = (self.keep, self.codes, self.scales, self.flags, self.row_fmt, self.index)
        return sum(t.numel() * t.element_size() for t in parts)

    @property
    def has_nonfinite(self) -> bool:
        return bool(self.flags.any())

    def dequantize(self) -> torch.Tensor:
        from hilore_verl.kernels import dequantize_rows

        return dequantize_rows(self)


def check_row_fmt(x: torch.Tensor, row_fmt: torch.Tensor, group_size: int) -> None:
    check_args(x, "int8", group_size)
    rows = x.numel() // x.shape[-1]
    if row_fmt.dtype != torch.int8 or row_fmt.shape != (rows,):
        raise ValueError(f"row_fmt must be an int8 tensor of shape ({rows},), one class per row; "
                         f"got {row_fmt.dtype} {tuple(row_fmt.shape)}")
    if row_fmt.numel() and (row_fmt.min() < 0 or row_fmt.max() > 2):
        raise ValueError(f"row classes must be one of {ROW_CLASSES}; got values {sorted(set(row_fmt.tolist()))}")


def layout(row_fmt: torch.Tensor, D: int) -> tuple[torch.Tensor, int, int, int]:
    """(index (R, 2), code bytes, kept rows, compressed rows) for a row classification."""
    fmt = row_fmt.long()
    keep = fmt == ROW_KEEP
    row_bytes = torch.where(fmt == ROW_INT8, D, torch.where(fmt == ROW_INT4, D // 2, 0))
    byte_offset = torch.cumsum(row_bytes, 0) - row_bytes
    keep_pos = torch.cumsum(keep.long(), 0) - keep.long()
    slot = torch.cumsum((~keep).long(), 0) - (~keep).long()
    index = torch.stack([torch.where(keep, keep_pos, byte_offset), torch.where(keep, -1, slot)], dim=1)
    return index, int(row_bytes.sum()), int(keep.sum()), int((~keep).sum())


def quantize_rows(x: torch.Tensor, row_fmt: torch.Tensor, group_size: int = 64) -> RowQuantized:
    check_row_fmt(x, row_fmt, group_size)
    D = x.shape[-1]
    x2 = x.reshape(-1, D)
    index, nbytes, _, n_q = layout(row_fmt, D)
    G = D // group_size
    codes = torch.empty(nbytes, dtype=torch.uint8, device=x.device)
    scales = torch.empty((n_q, G), dtype=torch.float32, device=x.device)
    flags = torch.empty((n_q, G), dtype=torch.uint8, device=x.device)
    for cls, fmt, width in ((ROW_INT8, "int8", D), (ROW_INT4, "int4", D // 2)):
        rows = (row_fmt == cls).nonzero().squeeze(1)
        if rows.numel():
            q = reference.quantize(x2[rows], fmt, group_size)
            positions = index[rows, 0][:, None] + torch.arange(width, device=x.device)
            codes[positions] = q.codes.view(torch.uint8)
            scales[index[rows, 1]] = q.scales
            flags[index[rows, 1]] = q.flags
    return RowQuantized(x2[row_fmt == ROW_KEEP].clone(), codes, scales, flags, row_fmt.clone(), index, x.shape,
                        x.dtype, group_size)


def dequantize_rows(q: RowQuantized) -> torch.Tensor:
    D = q.shape[-1]
    out = torch.empty((q.row_fmt.numel(), D), dtype=q.dtype, device=q.codes.device)
    out[q.row_fmt == ROW_KEEP] = q.keep
    for cls, fmt, width, code_dtype in ((ROW_INT8, "int8", D, torch.int8), (ROW_INT4, "int4", D // 2, torch.uint8)):
        rows = (q.row_fmt == cls).nonzero().squeeze(1)
        if rows.numel():
            codes = q.codes[q.index[rows, 0][:, None] + torch.arange(width, device=out.device)].view(code_dtype)
            slots = q.index[rows, 1]
            part = QuantizedTensor(codes, q.scales[slots], q.flags[slots], torch.Size((rows.numel(), D)), q.dtype,
                                   fmt, q.group_size)
            out[rows] = reference.dequantize(part)
    return out.view(q.shape)
