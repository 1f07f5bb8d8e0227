"""Sequences the actor update leaves out, and the micro-batches of the rest.

A sequence whose loss term is zero for any log-probs (in GRPO: every advantage 0 under a loss whose
per-token term is proportional to the advantage, no KL loss, no entropy bonus; the framework decides
which, e.g. `integration/actor/loss.py: skip_refusal`) adds exactly nothing to the gradient: its forward
and backward can be left out. What normalises the loss (token and sequence counts of the whole
mini-batch) is left to the framework, which keeps it as computed over every sequence.

Data-parallel ranks must still run the same number of micro-batches (each forward and backward pairs
FSDP collectives with the other ranks'). `form` splits this rank's kept sequences with the framework's
own split, agrees on the largest count M over ranks, re-splits a rank that has fewer micro-batches
into min(M, kept) and pads what is still missing with filler micro-batches: one skipped sequence
each (this rank's shortest), whose loss term is zero, so the update is unchanged. Free of verl and
torch.distributed: reductions go through the session's `Collectives`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

# split(kept sequence indices, at least this many micro-batches) -> micro-batches (lists of indices)
Split = Callable[[list[int], int], list[list[int]]]


@dataclass
class Layout:
    """This rank's micro-batches (sequence indices into its mini-batch) and the skip over all ranks."""

    micro_batches: list[list[int]] | None  # None: nothing left out (the framework's own split)
    fillers: int  # trailing micro-batches of one skipped sequence each, on this rank
    sequences: int  # sequences skipped, all ranks
    tokens: int  # their tokens
    total_sequences: int  # sequences in the mini-batch, all ranks
    total_tokens: int

    def metrics(self) -> dict[str, float]:
        return {"hilore/skip/sequences": float(self.sequences), "hilore/skip/tokens": float(self.tokens),
                "hilore/skip/token_share": self.tokens / self.total_tokens if self.total_tokens else 0.0,
                "hilore/skip/filler_micro_batches": float(self.fillers)}


def form(zero: Sequence[bool], lengths: Sequence[int], split: Split, collectives) -> Layout:
    """The micro-batches of this rank's sequences with `zero` (no loss term) left out. `micro_batches` is
    None when no rank leaves anything out, or a rank could not pair its micro-batches: the framework
    then splits every sequence as always (and nothing is skipped)."""
    kept = [i for i, z in enumerate(zero) if not z]
    skipped = sorted((i for i, z in enumerate(zero) if z), key=lambda i: lengths[i])
    parts = split(kept, 1) if kept else []
    rows = collectives.gather([float(len(skipped)), float(sum(lengths[i] for i in skipped)), float(len(zero)),
                               float(sum(lengths)), float(len(parts))])  # one collective
    s_seq, s_tok, n_seq, n_tok = (sum(col) for col in list(zip(*rows))[:4])
    nothing = Layout(None, 0, 0, 0, int(n_seq), int(n_tok))
    if s_seq == 0:
        return nothing
    target = max(1, int(max(row[4] for row in rows)))
    while True:
        if len(parts) < min(target, len(kept)):
            parts = split(kept, min(target, len(kept)))  # balanced over as many as the others run
        short = len(parts) < target and not skipped  # short of the count, and no skipped sequence to fill with
        high, any_short = collectives.reduce([float(len(parts)), float(short)], "max")
        if any_short:  # a rank has too few sequences to pair its collectives: no skip in this mini-batch
            return nothing
        if int(high) <= target:
            break
        target = int(high)  # a re-split grew past the count (a token limit): agree again
    fillers = target - len(parts)
    micro_batches = [list(p) for p in parts] + [[skipped[0]] for _ in range(fillers)]
    return Layout(micro_batches, fillers, int(s_seq), int(s_tok), int(n_seq), int(n_tok))


def chunks(index: list[int], size: int, at_least: int) -> list[list[int]]:
    """`index` in order, in max(ceil(len / size), at_least) near-equal parts of at most `size` (at most
    len(index) parts): the split of a fixed micro-batch size."""
    count = min(len(index), max(-(-len(index) // size), at_least))
    base, extra = divmod(len(index), count)
    out, start = [], 0
    for k in range(count):
        end = start + base + (k < extra)
        out.append(index[start:end])
        start = end
    return out


__all__ = ["Layout", "Split", "chunks", "form"]
