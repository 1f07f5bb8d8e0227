"""One packed micro-batch in the shared-prompt layout: each GRPO group's prompt once, then its responses.

A group whose n sequences carry the same prompt tokens is laid out as

    prompt (P tokens, positions 0..P-1) | response 0 (positions P..P+R_0-1) | ... | response n-1

and every sequence that cannot share (no group id, or a group whose prompts differ) is laid out as a
group of one: its prompt, then its response, which is exactly the ordinary layout. A group of one
therefore needs no special case anywhere: the attention treats every segment the same way.

Scoring convention, identical to the ordinary forward: response token j of a sequence is predicted by
the logits at the position before it, i.e. by the prompt's last position for j = 0 (shared by all the
group's responses) and by the response's own position j-1 otherwise. A sequence with an empty prompt
(P = 0) has no predictor for its first response token; the ordinary forward would not score that token
either, so such sequences are rejected with a ValueError rather than silently returning fewer values.

    layout = SharedLayout.build([(group_id, prompt_ids, response_ids), ...])
    layout.input_ids        # [1, L]   one packed row
    layout.position_ids     # [1, L]   positions as each sequence would see them unshared
    layout.predict_index    # [T]      row position whose logits predict each response token
    layout.target_ids       # [T]      the response tokens, input order, concatenated
    layout.unshared_index   # [N]      row position of every token of the ordinary packed layout
                            #          (each sequence's prompt then response, input order)
    layout.split(values)    # [T] -> one 1-D tensor per input sequence
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import torch

# (group id or None, prompt token ids [P], response token ids [R])
SequenceSpec = tuple[Hashable | None, torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class ShareRule:
    """Whether a group's one prompt is worth its segment's attention square. Sharing saves (n - 1) P
    tokens of the layers' linear work, and its attention (one masked square per segment) computes
    (P + sum R)^2 query-key pairs where per-sequence causal kernels compute about sum (P + R_i)^2 / 2:

        share  iff  ((P + sum R)^2 - sum (P + R_i)^2 / 2) * flops_per_pair <= (n - 1) P * flops_per_token

    so a short prompt before many long responses (P -> 0) is laid out as before, never slower."""

    flops_per_token: float  # the layers' linear work per token: 2 x a decoder layer's parameters
    flops_per_pair: float  # attention work per query-key pair: 4 x heads x head dim (QK^T and PV)

    @classmethod
    def of(cls, model) -> "ShareRule":
        """From a transformers causal LM: its first decoder layer's parameters, its heads."""
        config = model.config
        layer = model.get_decoder().layers[0]
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(2.0 * sum(p.numel() for p in layer.parameters()), 4.0 * config.num_attention_heads * head_dim)

    def pays(self, prompt_len: int, response_lens: Sequence[int]) -> bool:
        n = len(response_lens)
        if n < 2:
            return False
        extra = (prompt_len + sum(response_lens)) ** 2 - sum((prompt_len + r) ** 2 for r in response_lens) / 2
        return extra * self.flops_per_pair <= (n - 1) * prompt_len * self.flops_per_token


@dataclass(frozen=True)
class GroupSpan:
    """One segment of the packed row: a prompt and the responses that attend to it."""

    start: int  # offset of the prompt's first token in the row
    prompt_len: int  # P >= 1
    response_lens: tuple[int, ...]  # R_i, in the order they follow the prompt
    shared: bool  # False: a lone sequence of an unshareable group (or of no group)

    @property
    def length(self) -> int:
        return self.prompt_len + sum(self.response_lens)

    @property
    def end(self) -> int:
        return self.start + self.length


@dataclass
class SharedLayout:
    """A micro-batch packed in the shared-prompt layout (see the module docstring)."""

    input_ids: torch.Tensor  # [1, L] long
    position_ids: torch.Tensor  # [1, L] long
    groups: list[GroupSpan]  # segments in row order; attention never crosses a segment boundary
    predict_index: torch.Tensor  # [T] long, T = sum of all response lengths
    target_ids: torch.Tensor  # [T] long
    unshared_index: torch.Tensor  # [N] long, N = unshared_tokens: ordinary packed position -> row position
    response_lens: list[int]  # per input sequence, input order; splits the [T] tensors
    fallback_groups: int  # groups (ids) laid out unshared because their prompts differ
    ungrouped: int  # sequences without a group id, laid out unshared
    unshared_tokens: int  # sum over sequences of P_i + R_i: the ordinary layout's size
    # segment masks, built once per forward and reused by every layer (see attention.py); a plain object,
    # so that FSDP2's input casting, which rebuilds dataclasses and dicts per layer, passes it on as is
    mask_cache: "MaskCache" = field(default_factory=lambda: MaskCache(), repr=False, compare=False)

    @property
    def shared_tokens(self) -> int:
        """L, the tokens one forward of this layout computes."""
        return int(self.input_ids.shape[1])

    @property
    def shared_groups(self) -> int:
        """Segments holding a prompt computed once for more than one response."""
        return sum(1 for g in self.groups if g.shared and len(g.response_lens) > 1)

    def split(self, values: torch.Tensor) -> list[torch.Tensor]:
        """[T, ...] per response token, input order -> one [R_i, ...] tensor per input sequence."""
        return list(torch.split(values, self.response_lens, dim=0))

    def to(self, device: torch.device | str) -> "SharedLayout":
        """The same layout with its tensors on `device` (the mask cache starts empty)."""
        return SharedLayout(
            input_ids=self.input_ids.to(device),
            position_ids=self.position_ids.to(device),
            groups=list(self.groups),
            predict_index=self.predict_index.to(device),
            target_ids=self.target_ids.to(device),
            unshared_index=self.unshared_index.to(device),
            response_lens=list(self.response_lens),
            fallback_groups=self.fallback_groups,
            ungrouped=self.ungrouped,
            unshared_tokens=self.unshared_tokens,
        )

    @classmethod
    def build(cls, sequences: Sequence[SequenceSpec], device: torch.device | str | None = None,
              rule: ShareRule | None = None) -> "SharedLayout":
        """Pack `sequences` (group id, prompt ids [P], response ids [R]); groups keep first-seen order;
        with a `rule`, a group it does not pay to share is laid out unshared."""
        if len(sequences) == 0:
            raise ValueError("SharedLayout.build needs at least one sequence")
        prompts, responses = _token_ids(sequences)
        segments, fallback, ungrouped = _segments(sequences, prompts, responses, rule)
        ids, pos, groups, predict, where = _packed(segments, prompts, responses)
        layout = cls(
            input_ids=torch.cat(ids).unsqueeze(0),
            position_ids=torch.cat(pos).unsqueeze(0),
            groups=groups,
            predict_index=torch.cat(predict),
            target_ids=torch.cat(responses),
            unshared_index=torch.cat(where),
            response_lens=[r.numel() for r in responses],
            fallback_groups=fallback,
            ungrouped=ungrouped,
            unshared_tokens=sum(p.numel() + r.numel() for p, r in zip(prompts, responses)),
        )
        return layout.to(device) if device is not None else layout

    def segment_mask(self, group: int, sliding_window: int | None, device: torch.device) -> torch.Tensor:
        """[L_g, L_g] bool, True where query row may attend to key column within segment `group`.

        A row sees keys at or before its own position that are either prompt tokens or tokens of its own
        response (prompt rows: the prompt causally); with a sliding window, only keys whose position
        (the unshared sequence's) is less than `sliding_window` behind the row's. Cached per forward.
        """
        key = (group, sliding_window, str(device))
        mask = self.mask_cache.masks.get(key)
        if mask is not None:
            return mask
        g = self.groups[group]
        # segment id per token: 0 for the prompt, i + 1 for response i (made on the host)  # [L_g]
        seg = torch.repeat_interleave(torch.arange(len(g.response_lens) + 1),
                                      torch.tensor((g.prompt_len, *g.response_lens))).to(device, non_blocking=True)
        pos = self.position_ids[0, g.start : g.end].to(device)  # [L_g]
        behind = pos[:, None] - pos[None, :]  # [L_g, L_g] query position minus key position
        same = (seg[None, :] == 0) | (seg[None, :] == seg[:, None])
        mask = same & (behind >= 0)
        if sliding_window is not None:
            mask = mask & (behind < sliding_window)
        self.mask_cache.masks[key] = mask
        return mask


def shared_token_count(sequences: Sequence[tuple[Hashable | None, int, int]], rule: ShareRule | None = None) -> int:
    """L, the row `SharedLayout.build` lays out, from (prompt key, P, R) per sequence and without building
    it: each key's prompt once (where `rule` shares it), every response, and a sequence without a key
    whole. Keys are the prompts themselves (equal keys, equal prompts), as the engine and the bench
    group them.

        L = sum over shared keys of P_key + sum over the others' sequences of P_i + sum of all R_i"""
    groups: dict[Hashable, tuple[int, list[int]]] = {}
    total = 0
    for key, prompt_len, response_len in sequences:
        if key is None:
            total += int(prompt_len) + int(response_len)
        else:
            groups.setdefault(key, (int(prompt_len), []))[1].append(int(response_len))
    for prompt_len, responses in groups.values():
        shared = rule is None or rule.pays(prompt_len, responses)
        total += sum(responses) + prompt_len * (1 if shared else len(responses))
    return total


class MaskCache:
    """Segment masks by (segment, window, device); shared by every copy of a layout."""

    def __init__(self) -> None:
        self.masks: dict = {}


def _token_ids(sequences: Sequence[SequenceSpec]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each sequence's prompt and response ids as 1-D long host tensors; an empty prompt is refused."""
    prompts: list[torch.Tensor] = []
    responses: list[torch.Tensor] = []
    for i, (_, prompt, response) in enumerate(sequences):
        prompt = torch.as_tensor(prompt).reshape(-1).long().cpu()
        response = torch.as_tensor(response).reshape(-1).long().cpu()
        if prompt.numel() == 0:
            raise ValueError(
                f"sequence {i} has an empty prompt: its first response token has no position to be "
                "predicted from (the ordinary forward does not score it either); give every sequence "
                "at least one prompt token, e.g. a BOS token"
            )
        prompts.append(prompt)
        responses.append(response)
    return prompts, responses


def _segments(sequences: Sequence[SequenceSpec], prompts: list[torch.Tensor], responses: list[torch.Tensor],
              rule: ShareRule | None) -> tuple[list[tuple[list[int], bool]], int, int]:
    """(segments as (sequence indices, shared), groups that fell back for differing prompts, sequences
    without a group id): each group id's members in first-seen order, shared where their prompts are one
    and the rule (if any) says it pays; a sequence without an id stands alone."""
    members: dict[Hashable, list[int]] = {}
    segments: list[tuple[list[int], bool]] = []
    order: list[object] = []
    for i, (gid, _, _) in enumerate(sequences):
        if gid is None:
            order.append(("alone", i))
        else:
            if gid not in members:
                members[gid] = []
                order.append(("group", gid))
            members[gid].append(i)
    fallback = 0
    ungrouped = 0
    for kind, key in order:
        if kind == "alone":
            segments.append(([key], False))
            ungrouped += 1
            continue
        idx = members[key]
        first = prompts[idx[0]]
        if rule is not None and not rule.pays(first.numel(), [responses[j].numel() for j in idx]):
            segments.extend(([j], False) for j in idx)
        elif all(torch.equal(prompts[j], first) for j in idx[1:]):
            segments.append((idx, True))
        else:
            segments.extend(([j], False) for j in idx)
            fallback += 1
    return segments, fallback, ungrouped


def _packed(segments: list[tuple[list[int], bool]], prompts: list[torch.Tensor], responses: list[torch.Tensor]):
    """The row's pieces, segment by segment (its prompt once, then its responses): token ids, positions,
    group spans, and per sequence the row positions predicting its response tokens and holding its tokens."""
    ids: list[torch.Tensor] = []
    pos: list[torch.Tensor] = []
    groups: list[GroupSpan] = []
    predict = [torch.empty(0, dtype=torch.long)] * len(prompts)
    where = [torch.empty(0, dtype=torch.long)] * len(prompts)  # each sequence's tokens in the row
    offset = 0
    for idx, shared in segments:
        prompt = prompts[idx[0]]
        p = prompt.numel()
        ids.append(prompt)
        pos.append(torch.arange(p))
        cursor = offset + p  # the first response's first token
        for j in idx:
            r = responses[j].numel()
            ids.append(responses[j])
            pos.append(torch.arange(p, p + r))
            # token 0 <- the prompt's last position; token k > 0 <- the response's position k-1
            own = torch.arange(cursor, cursor + max(r - 1, 0))
            predict[j] = torch.cat([torch.tensor([offset + p - 1]), own])[:r]
            where[j] = torch.cat([torch.arange(offset, offset + p), torch.arange(cursor, cursor + r)])
            cursor += r
        groups.append(GroupSpan(offset, p, tuple(responses[j].numel() for j in idx), shared))
        offset = cursor
    return ids, pos, groups, predict, where
