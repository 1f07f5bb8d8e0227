"""Attention per sequence of a packed row, for hosts without a varlen kernel: `attn_implementation:
hilore_packed_sdpa`.

verl's remove-padding packs a micro-batch's sequences into one row whose position ids restart at 0 for
each sequence. On a GPU, flash-attention's varlen kernel attends within each sequence. transformers' sdpa
on the CPU instead builds a block-diagonal [L, L] mask over the row and computes every pair of it, most of
them masked: a packed row of 16 sequences of 142 tokens costs 16x the attention of its sequences. This
implementation runs one causal SDPA per sequence (the boundaries read from `position_ids`), what the GPU
kernel computes; any other call (a batch of padded rows, a KV cache, a sliding window, no position ids)
is transformers' sdpa itself. The mask function is sdpa's, so the model builds the same masks as under sdpa.
Registered by the plugin in every process that imports verl; exact against sdpa up to summation order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

NAME = "hilore_packed_sdpa"


def _starts(position_ids: torch.Tensor | None, length: int) -> list[int] | None:
    """Where each sequence of a packed row starts (its position 0), or None when the row is not packed."""
    if position_ids is None or position_ids.dim() != 2 or position_ids.shape != (1, length):
        return None
    starts = (position_ids[0] == 0).nonzero().flatten().tolist()
    return starts if len(starts) > 1 and starts[0] == 0 else None


def packed_sdpa(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                sliding_window: int | None = None, **kwargs):
    """query [1, H, L, D], key / value [1, H_kv, L, D] -> ([1, L, H, D], None), as sdpa_attention_forward."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    starts = _starts(kwargs.get("position_ids"), query.shape[2])
    if (starts is None or query.shape[0] != 1 or key.shape[2] != query.shape[2] or sliding_window is not None
            or kwargs.get("past_key_values") is not None):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      sliding_window=sliding_window, **kwargs)
    bounds = [*starts, query.shape[2]]
    gqa = query.shape[1] != key.shape[1]
    out = [F.scaled_dot_product_attention(query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], is_causal=True,
                                          dropout_p=dropout, scale=scaling, enable_gqa=gqa)
           for s, e in zip(bounds, bounds[1:])]  # [1, H, L_i, D] each
    return torch.cat(out, dim=2).transpose(1, 2).contiguous(), None


def register() -> str:
    """Register the implementation with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    if NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(NAME, packed_sdpa)
        AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    return NAME
