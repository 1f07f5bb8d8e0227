"""Plain-PyTorch references that verl's engine and hilore-verl are held to (single process, no verl)."""

from __future__ import annotations

import torch


def ppo_clip_loss(log_prob, old_log_prob, advantages, response_mask, clip_ratio=0.2, clip_ratio_c=3.0):
    """PPO's dual-clip surrogate, token-mean over every response token of the batch, written out."""
    ratio = torch.exp((log_prob - old_log_prob).clamp(-20.0, 20.0))
    clipped = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(1 - clip_ratio, 1 + clip_ratio))
    dual = torch.minimum(clipped, -advantages * clip_ratio_c)
    per_token = torch.where(advantages < 0, dual, clipped)
    mask = response_mask.to(per_token.dtype)
    return (per_token * mask).sum() / mask.sum()
