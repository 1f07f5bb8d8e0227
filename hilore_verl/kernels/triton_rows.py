"""Triton kernels for row-mixed precision (layout in `rows.py`); bit for bit the torch reference.

One program: BLOCK_R rows x one group, read as even and odd columns so that int4 pairs pack in
place. Each row's class picks what is written: the raw bits (KEEP), int8 codes or int4 bytes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hilore_verl.kernels.rows import ROW_KEEP, RowQuantized, check_row_fmt, layout
from hilore_verl.kernels.triton_codec import (BLOCK_R, _as_kernel_view, _kind, _load_f32, _pair_absmax, _rne,
                                              _saturate, _store_from_f32)


@triton.jit
def _row_header(FMT, INDEX, R, BLOCK_R: tl.constexpr):
    """This program's rows, their mask, class, offset (keep row or code byte) and scale slot."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < R
    cls = tl.load(FMT + rows, mask=rmask, other=-1).to(tl.int32)
    offset = tl.load(INDEX + rows.to(tl.int64) * 2, mask=rmask, other=0)
    slot = tl.load(INDEX + rows.to(tl.int64) * 2 + 1, mask=rmask, other=0)
    return rows, rmask, cls, offset, slot


@triton.jit
def _quantize_rows_kernel(X, FMT, INDEX, KEEP, CODES, SCALES, FLAGS, R, D, GS: tl.constexpr,
                          BLOCK_R: tl.constexpr, KIND: tl.constexpr):
    HALF: tl.constexpr = GS // 2
    rows, rmask, cls, offset, slot = _row_header(FMT, INDEX, R, BLOCK_R)
    gi = tl.program_id(1)
    j = tl.arange(0, HALF)
    cols = gi * GS + 2 * j
    offs = rows.to(tl.int64)[:, None] * D + cols[None, :]
    m2 = rmask[:, None]
    # KEEP rows: the raw elements, bit for bit
    keep2 = (rmask & (cls == 0))[:, None]
    keep_offs = offset[:, None] * D + cols[None, :]
    tl.store(KEEP + keep_offs, tl.load(X + offs, mask=keep2), mask=keep2)
    tl.store(KEEP + keep_offs + 1, tl.load(X + offs + 1, mask=keep2), mask=keep2)
    # compressed rows
    xe = _load_f32(X, offs, m2, KIND)
    xo = _load_f32(X, offs + 1, m2, KIND)
    finite, absmax = _pair_absmax(xe, xo)
    qmax = tl.where(cls == 1, 127.0, 7.0)
    scale = tl.math.div_rn(absmax, qmax)
    safe = tl.where(scale > 0.0, scale, 1.0)
    ye = tl.where(finite[:, None], tl.math.div_rn(xe, safe[:, None]), 0.0)
    yo = tl.where(finite[:, None], tl.math.div_rn(xo, safe[:, None]), 0.0)
    qe = tl.minimum(tl.maximum(_rne(ye), -qmax[:, None]), qmax[:, None])
    qo = tl.minimum(tl.maximum(_rne(yo), -qmax[:, None]), qmax[:, None])
    int8_2 = (rmask & (cls == 1))[:, None]
    code_offs = offset[:, None] + cols[None, :]
    tl.store(CODES + code_offs, qe.to(tl.int8).to(tl.uint8, bitcast=True), mask=int8_2)
    tl.store(CODES + code_offs + 1, qo.to(tl.int8).to(tl.uint8, bitcast=True), mask=int8_2)
    int4_2 = (rmask & (cls == 2))[:, None]
    byte = (qe + 8.0).to(tl.int32) | ((qo + 8.0).to(tl.int32) << 4)
    tl.store(CODES + offset[:, None] + (gi * HALF + j)[None, :], byte.to(tl.uint8), mask=int4_2)
    qrow = rmask & (cls != 0)
    G = D // GS
    tl.store(SCALES + slot * G + gi, tl.where(finite, scale, float("nan")), mask=qrow)
    tl.store(FLAGS + slot * G + gi, tl.where(finite, 0, 1).to(tl.uint8), mask=qrow)


@triton.jit
def _dequantize_rows_kernel(FMT, INDEX, KEEP, CODES, SCALES, OUT, R, D, GS: tl.constexpr, BLOCK_R: tl.constexpr,
                            KIND: tl.constexpr):
    HALF: tl.constexpr = GS // 2
    rows, rmask, cls, offset, slot = _row_header(FMT, INDEX, R, BLOCK_R)
    gi = tl.program_id(1)
    j = tl.arange(0, HALF)
    cols = gi * GS + 2 * j
    offs = rows.to(tl.int64)[:, None] * D + cols[None, :]
    keep2 = (rmask & (cls == 0))[:, None]
    keep_offs = offset[:, None] * D + cols[None, :]
    tl.store(OUT + offs, tl.load(KEEP + keep_offs, mask=keep2), mask=keep2)
    tl.store(OUT + offs + 1, tl.load(KEEP + keep_offs + 1, mask=keep2), mask=keep2)
    qrow = rmask & (cls != 0)
    scale = tl.load(SCALES + slot * (D // GS) + gi, mask=qrow, other=0.0)
    int8_2 = (rmask & (cls == 1))[:, None]
    code_offs = offset[:, None] + cols[None, :]
    ce = tl.load(CODES + code_offs, mask=int8_2, other=0).to(tl.int8, bitcast=True).to(tl.float32)
    co = tl.load(CODES + code_offs + 1, mask=int8_2, other=0).to(tl.int8, bitcast=True).to(tl.float32)
    _store_from_f32(OUT, offs, _saturate(ce * scale[:, None]), int8_2, KIND)
    _store_from_f32(OUT, offs + 1, _saturate(co * scale[:, None]), int8_2, KIND)
    int4_2 = (rmask & (cls == 2))[:, None]
    byte = tl.load(CODES + offset[:, None] + (gi * HALF + j)[None, :], mask=int4_2, other=0).to(tl.int32) & 0xFF
    _store_from_f32(OUT, offs, _saturate(((byte & 0x0F) - 8).to(tl.float32) * scale[:, None]), int4_2, KIND)
    _store_from_f32(OUT, offs + 1, _saturate(((byte >> 4) - 8).to(tl.float32) * scale[:, None]), int4_2, KIND)


def quantize_rows(x: torch.Tensor, row_fmt: torch.Tensor, group_size: int = 64) -> RowQuantized:
    check_row_fmt(x, row_fmt, group_size)
    D = x.shape[-1]
    x2 = x.reshape(-1, D).contiguous()
    R, G = x2.shape[0], D // group_size
    index, nbytes, n_keep, n_q = layout(row_fmt, D)
    dev = x.device
    keep = torch.empty((n_keep, D), dtype=x.dtype, device=dev)
    codes = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=dev)  # never a zero-size pointer
    scales = torch.empty((max(n_q, 1), G), dtype=torch.float32, device=dev)
    flags = torch.empty((max(n_q, 1), G), dtype=torch.uint8, device=dev)
    keep_buf = keep if n_keep else torch.empty((1, D), dtype=x.dtype, device=dev)
    _quantize_rows_kernel[(triton.cdiv(R, BLOCK_R), G)](
        _as_kernel_view(x2), row_fmt, index, _as_kernel_view(keep_buf), codes, scales, flags, R, D, GS=group_size,
        BLOCK_R=BLOCK_R, KIND=_kind(x.dtype))
    return RowQuantized(keep, codes[:nbytes], scales[:n_q], flags[:n_q], row_fmt.clone(), index, x.shape, x.dtype,
                        group_size)


def dequantize_rows(q: RowQuantized) -> torch.Tensor:
    D = q.shape[-1]
    R, G = q.row_fmt.numel(), D // q.group_size
    dev = q.index.device
    out = torch.empty((R, D), dtype=q.dtype, device=dev)
    keep = q.keep if q.keep.numel() else torch.empty((1, D), dtype=q.dtype, device=dev)
    codes = q.codes if q.codes.numel() else torch.empty(1, dtype=torch.uint8, device=dev)
    scales = q.scales if q.scales.numel() else torch.empty((1, G), dtype=torch.float32, device=dev)
    _dequantize_rows_kernel[(triton.cdiv(R, BLOCK_R), G)](
        q.row_fmt, q.index, _as_kernel_view(keep), codes, scales, _as_kernel_view(out), R, D, GS=q.group_size,
        BLOCK_R=BLOCK_R, KIND=_kind(q.dtype))
    return out.view(q.shape)


__all__ = ["ROW_KEEP", "dequantize_rows", "quantize_rows"]
