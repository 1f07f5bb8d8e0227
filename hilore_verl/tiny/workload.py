"""Synthetic GRPO mini-batches in verl's data layout (no verl import).

A batch holds `num_groups` prompts with `group_size` responses each. Prompts are left-padded to
`max_prompt_len`, responses right-padded to `max_response_len` (verl's "left-right" padding):

    input_ids, attention_mask, position_ids : (B, P + R)      B = num_groups * group_size
    prompts (B, P), responses (B, R), response_mask (B, R)
    old_log_probs, advantages (, ref_log_prob) : (B, R), zero outside response_mask

Response lengths are long-tailed (log-normal). A share of groups gets one reward for every
response, so GRPO's group-normalised advantage is exactly zero for all their tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GRPOWorkload:
    num_groups: int = 2
    """Prompts in the batch."""
    group_size: int = 4
    """Responses per prompt (GRPO's G)."""
    max_prompt_len: int = 16
    """P: prompts are left-padded to this length."""
    max_response_len: int = 24
    """R: responses are right-padded to this length."""
    min_prompt_len: int = 4
    min_response_len: int = 2
    response_len_sigma: float = 0.8
    """Spread of the log-normal response length (0: every response as long as the median)."""
    zero_advantage_share: float = 0.5
    """Share of groups whose responses all get the same reward (zero advantage)."""
    vocab_size: int = 512
    with_ref_log_prob: bool = False

    def __post_init__(self):
        if self.num_groups < 1 or self.group_size < 1:
            raise ValueError("num_groups and group_size must be >= 1")
        if not 1 <= self.min_prompt_len <= self.max_prompt_len:
            raise ValueError("need 1 <= min_prompt_len <= max_prompt_len")
        if not 1 <= self.min_response_len <= self.max_response_len:
            raise ValueError("need 1 <= min_response_len <= max_response_len")
        if not 0.0 <= self.zero_advantage_share <= 1.0:
            raise ValueError("zero_advantage_share must be in [0, 1]")

    @property
    def batch_size(self) -> int:
        return self.num_groups * self.group_size


def grpo_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """Outcome advantage per response: (r - group mean) / (group std + eps), as verl's GRPO computes it."""
    r = rewards.view(-1, group_size)
    std = r.std(dim=1, keepdim=True) if group_size > 1 else torch.ones_like(r[:, :1])
    return ((r - r.mean(dim=1, keepdim=True)) / (std + eps)).view(-1)


def make_grpo_batch(workload: GRPOWorkload, seed: int = 0) -> dict[str, torch.Tensor]:
    """A mini-batch in verl's left-right padded layout (see the module docstring)."""
    w = workload
    g = torch.Generator().manual_seed(seed)
    B, P, R = w.batch_size, w.max_prompt_len, w.max_response_len

    # One prompt per group, shared by its G responses.
    prompt_lens = torch.randint(w.min_prompt_len, P + 1, (w.num_groups,), generator=g).repeat_interleave(w.group_size)
    median = (w.min_response_len + R) / 4
    lognormal = torch.exp(torch.randn(B, generator=g) * w.response_len_sigma) * median
    response_lens = lognormal.round().long().clamp(w.min_response_len, R)

    pos = torch.arange(P)
    prompt_mask = (pos >= P - prompt_lens[:, None]).long()  # left padding
    response_mask = (torch.arange(R) < response_lens[:, None]).long()  # right padding
    prompts = torch.randint(1, w.vocab_size, (w.num_groups, P), generator=g).repeat_interleave(w.group_size, 0)
    responses = torch.randint(1, w.vocab_size, (B, R), generator=g)
    prompts, responses = prompts * prompt_mask, responses * response_mask

    input_ids = torch.cat([prompts, responses], dim=1)
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0) * attention_mask

    # Rewards: zero-advantage groups get one reward for all responses, others a random mix.
    num_zero = round(w.zero_advantage_share * w.num_groups)
    zero_groups = torch.randperm(w.num_groups, generator=g)[:num_zero]
    rewards = torch.bernoulli(torch.full((w.num_groups, w.group_size), 0.5), generator=g)
    if w.group_size > 1:  # every other group holds at least one success and one failure
        for group in range(w.num_groups):
            first, second = torch.randperm(w.group_size, generator=g)[:2].tolist()
            rewards[group, first], rewards[group, second] = 1.0, 0.0
    rewards[zero_groups] = 1.0
    rewards = rewards.view(-1)
    advantages = grpo_advantages(rewards, w.group_size)[:, None] * response_mask

    mask_f = response_mask.float()
    batch = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "prompts": prompts,
        "responses": responses,
        "response_mask": response_mask,
        "advantages": advantages.float(),
        "old_log_probs": -torch.rand(B, R, generator=g).mul(4.0) * mask_f,
        "zero_advantage_group": (rewards.view(w.num_groups, -1) == rewards.view(w.num_groups, -1)[:, :1]).all(1),
    }
    if w.with_ref_log_prob:
        batch["ref_log_prob"] = -torch.rand(B, R, generator=g).mul(4.0) * mask_f
    return batch


def response_log_probs(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """log p(response token) under `model` for a left-right padded batch: (B, R), zero where masked.
    The logit at position t predicts token t + 1, so response token j is read at P - 1 + j."""
    P, R = batch["prompts"].shape[1], batch["responses"].shape[1]
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   position_ids=batch["position_ids"], use_cache=False).logits
    logp = torch.log_softmax(logits[:, P - 1 : P + R - 1].float(), dim=-1)  # (B, R, V)
    return logp.gather(-1, batch["responses"][..., None]).squeeze(-1) * batch["response_mask"]


def pack(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The packed layout (verl's `use_remove_padding`): valid tokens of all sequences in one row.

    input_ids, position_ids : (1, T) with T = attention_mask.sum();  cu_seqlens : (B + 1,)
    """
    mask = batch["attention_mask"].bool()
    lengths = mask.sum(dim=1)
    cu_seqlens = torch.zeros(lengths.numel() + 1, dtype=torch.int32)
    cu_seqlens[1:] = lengths.cumsum(0)
    return {
        "input_ids": batch["input_ids"][mask][None],
        "position_ids": batch["position_ids"][mask][None],
        "cu_seqlens": cu_seqlens,
    }


def shard(batch: dict[str, torch.Tensor], rank: int, world_size: int) -> dict[str, torch.Tensor]:
    """This data-parallel rank's contiguous share of the sequences (per-group fields stay whole)."""
    bsz = batch["input_ids"].shape[0]
    if bsz % world_size:
        raise ValueError(f"{bsz} sequences do not split evenly over {world_size} ranks")
    part = slice(rank * bsz // world_size, (rank + 1) * bsz // world_size)
    return {k: (v[part] if v.shape[:1] == (bsz,) else v) for k, v in batch.items()}
