"""The shared-prompt attention as one FlexAttention call: the layout as a block mask.

The per-segment path (attention.py) runs one masked `scaled_dot_product_attention` per segment and so
computes each segment's full (P + sum R)^2 square. FlexAttention evaluates the layout's mask per
block and skips blocks the mask empties: a response's rows compute the prompt's keys and their own,
about the rectangles (P + R_i) x R_i a per-sequence kernel computes, whatever the group's size.

    mask(q, kv) = same segment  and  kv <= q (row order)  and  (kv is a prompt token or kv is q's response)
                  and, with a sliding window, position(q) - position(kv) < window

(rows of a segment are its prompt, then each response in turn, so row order is causal order.) Soft-caps
are a score modification. FlexAttention has no backward on the CPU (torch 2.13), so attention.py uses it
on CUDA only; on the CPU it serves the forward tests here. Its compiled kernel is built once per process
(`torch.compile(flex_attention, dynamic=True)`: one kernel for every row length).
"""

from __future__ import annotations

import torch

from hilore_verl.shared_prompt.layout import SharedLayout

_COMPILED = None


def _flex():
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention


def _compiled_flex():
    global _COMPILED
    if _COMPILED is None:
        _COMPILED = torch.compile(_flex(), dynamic=True)
    return _COMPILED


_COMPILED_MASK = None


def _create_block_mask(compiled: bool):
    """FlexAttention's `create_block_mask`, compiled (`compiled`): the eager build evaluates the mask on
    every (q, kv) pair at once, an L x L boolean (1 GiB at 32K tokens) beside the layer's activations; the
    compiled build reduces it block by block and holds only the block mask, about 16 (L / 128)^2 bytes
    (1 MiB at 32K). Compiled once per process, for every row length."""
    global _COMPILED_MASK
    from torch.nn.attention.flex_attention import create_block_mask

    if not compiled:
        return create_block_mask
    if _COMPILED_MASK is None:
        _COMPILED_MASK = torch.compile(create_block_mask, dynamic=True)
    return _COMPILED_MASK


def token_ids(layout: SharedLayout, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token of the row: (segment index, 0 for a prompt token else 1 + its response's index)."""
    segment, part = [], []
    for index, group in enumerate(layout.groups):
        lengths = torch.tensor((group.prompt_len, *group.response_lens))
        part.append(torch.repeat_interleave(torch.arange(len(lengths)), lengths))
        segment.append(torch.full((group.length,), index))
    return torch.cat(segment).to(device), torch.cat(part).to(device)


def block_mask(layout: SharedLayout, window: int | None, device: torch.device, compiled: bool | None = None):
    """The layout's mask as FlexAttention's block mask, built once per forward (the layout's cache);
    `compiled` (default: on an accelerator) builds it without the L x L mask (`_create_block_mask`)."""
    compiled = device.type != "cpu" if compiled is None else compiled
    key = ("flex", window, str(device))
    cached = layout.mask_cache.masks.get(key)
    if cached is not None:
        return cached
    segment, part = token_ids(layout, device)
    position = layout.position_ids[0].to(device)

    def mask_mod(b, h, q, kv):
        seen = (segment[q] == segment[kv]) & (kv <= q) & ((part[kv] == 0) | (part[kv] == part[q]))
        if window is not None:
            seen = seen & (position[q] - position[kv] < window)
        return seen

    length = layout.shared_tokens
    mask = _create_block_mask(compiled)(mask_mod, None, None, length, length, device=device)
    layout.mask_cache.masks[key] = mask
    return mask


def flex_shared_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: SharedLayout,
                          scaling: float, window: int | None = None, softcap: float | None = None,
                          compiled: bool = True) -> torch.Tensor:
    """query [1, H, L, D], key [1, H_kv, L, D], value [1, H_kv, L, Dv] -> [1, H, L, Dv]; grouped k / v heads
    read as they are (`enable_gqa`). `compiled` False: the eager reference (forward only on the CPU)."""
    score_mod = None
    if softcap is not None:
        cap = float(softcap)

        def score_mod(score, b, h, q, kv):
            return torch.tanh(score / cap) * cap

    flex = _compiled_flex() if compiled else _flex()
    return flex(query, key, value, score_mod=score_mod, block_mask=block_mask(layout, window, query.device),
                scale=scaling, enable_gqa=query.shape[1] != key.shape[1])


__all__ = ["block_mask", "flex_shared_attention", "token_ids"]
