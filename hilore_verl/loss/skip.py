"""Sequences the actor update leaves out, and the micro-batches of the rest.

A sequence whose loss term is zero for any log-probs (in GRPO: every advantage 0 under a loss whose
per-token term is proportional to the advantage, no KL loss, no entropy bonus; the framework decides
which, e.g. `integration/actor/loss.py: skip_refusal`) adds exactly nothing to the gradient: its forward
and backward can be left out. What normalises the loss (token and sequence counts of the whole
mini-batch) is left to the framework, which keeps it as computed over every sequence.

Data-parallel ranks must still run the same number of micro-batches (each forward and backward pairs
FSDP collectives with the other ranks'). `form` (`Forming`) splits this rank's kept sequences with the
framework's own split, agrees on the largest count M over ranks, re-splits a rank that has fewer micro-batches
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


class Forming:
    """`form`'s agreement, driven by its caller: `offer` this rank's split of `kept` (the framework's, into
    at least the count asked: 1 at first) until `offer` returns None, then read `layout`. Every rank runs
    the same collectives in the same order: one gather at the first offer, one reduction per agreed count.

        forming, at_least = Forming(zero, lengths, collectives), 1
        while at_least is not None:
            at_least = forming.offer(split(forming.kept, at_least) if forming.kept else [])
    """

    def __init__(self, zero: Sequence[bool], lengths: Sequence[int], collectives):
        self.kept = [i for i, z in enumerate(zero) if not z]
        self._skipped = sorted((i for i, z in enumerate(zero) if z), key=lambda i: lengths[i])
        self._zero, self._lengths, self._collectives = zero, lengths, collectives
        self._totals: tuple[int, int, int, int] | None = None  # skipped sequences, tokens; all sequences, tokens
        self._target = 0  # the micro-batch count every rank runs, as agreed so far
        self._asked = False  # the parts offered next are the re-split `offer` asked for
        self.layout: Layout | None = None

    def offer(self, parts: list[list[int]]) -> int | None:
        """`parts`: this rank's micro-batches of `kept`. The count to split `kept` into at least (the
        caller offers that split next), or None once `layout` is formed: None in it when no rank leaves
        anything out, or a rank could not pair its micro-batches (the framework then splits every
        sequence as always)."""
        if self._totals is None:
            rows = self._collectives.gather([float(len(self._skipped)),
                                             float(sum(self._lengths[i] for i in self._skipped)),
                                             float(len(self._zero)), float(sum(self._lengths)),
                                             float(len(parts))])  # one collective
            self._totals = tuple(int(sum(col)) for col in list(zip(*rows))[:4])
            if self._totals[0] == 0:
                return self._formed(None)
            self._target = max(1, int(max(row[4] for row in rows)))
        while True:
            want = min(self._target, len(self.kept))
            if len(parts) < want and not self._asked:
                self._asked = True  # balanced over as many as the others run
                return want
            self._asked = False
            short = len(parts) < self._target and not self._skipped  # and no skipped sequence to fill with
            high, any_short = self._collectives.reduce([float(len(parts)), float(short)], "max")
            if any_short:  # a rank has too few sequences to pair its collectives: no skip in this mini-batch
                return self._formed(None)
            if int(high) <= self._target:
                break
            self._target = int(high)  # a re-split grew past the count (a token limit): agree again
        fillers = self._target - len(parts)
        return self._formed([list(p) for p in parts] + [[self._skipped[0]] for _ in range(fillers)], fillers)

    def _formed(self, micro_batches: list[list[int]] | None, fillers: int = 0) -> None:
        s_seq, s_tok, n_seq, n_tok = self._totals
        self.layout = (Layout(None, 0, 0, 0, n_seq, n_tok) if micro_batches is None
                       else Layout(micro_batches, fillers, s_seq, s_tok, n_seq, n_tok))


def form(zero: Sequence[bool], lengths: Sequence[int], split: Split, collectives) -> Layout:
    """The micro-batches of this rank's sequences with `zero` (no loss term) left out, `split` being
    the framework's split (`Forming` for a caller that splits between the agreement's steps)."""
    forming, at_least = Forming(zero, lengths, collectives), 1
    while at_least is not None:
        at_least = forming.offer(split(forming.kept, at_least) if forming.kept else [])
    return forming.layout


__all__ = ["Forming", "Layout", "Split", "form"]
