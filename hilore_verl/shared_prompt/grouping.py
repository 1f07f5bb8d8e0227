"""Micro-batches that keep a group's sequences together, so that its prompt is computed once.

verl splits a rank's mini-batch by its own rules (dynamic batch sizes: sequences balanced by length
under `max_token_len_per_gpu`; otherwise fixed-size chunks in order), which scatters a group's
responses over micro-batches (verl's trainer also reorders sequences across ranks by length), so
each micro-batch holds a few responses per prompt and shares little. Here the same bounds are kept
(at most `max_tokens` packed tokens, or at most `size` sequences, per micro-batch) and sequences with
one prompt key are placed together:

    items    = each key's sequences (a key with more than a micro-batch's worth: cut into chunks)
    bins     = max(at_least, ceil(sum of tokens / max_tokens)) micro-batches
    place    = items largest first, each into the bin computing the fewest tokens that it fits
               (a bin computes P_key once per key it holds: what balances the layers' work); one
               more bin when an item fits none
    grouped  = micro-batches never empty: items cut further while there are fewer than the bins

The loss is the same for any split (verl normalises by the mini-batch's global token and sequence
counts), so only the shares of the work change, not the update.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from hilore_verl.shared_prompt.layout import shared_token_count


def _items(keys: Sequence[Hashable], lengths: Sequence[int], fits) -> list[list[int]]:
    """Sequence indices per key (first-seen order), each key's list cut into runs that `fits`."""
    members: dict[Hashable, list[int]] = {}
    for i, key in enumerate(keys):
        members.setdefault(("alone", i) if key is None else ("key", key), []).append(i)
    items = []
    for index in members.values():
        run: list[int] = []
        for i in index:
            if run and not fits(run + [i]):
                items.append(run)
                run = []
            run.append(i)
        items.append(run)
    return items


def _cut(items: list[list[int]], count: int) -> list[list[int]] | None:
    """`items` cut (the one with most sequences in halves, repeatedly) until there are `count`; None
    when there are fewer sequences than that."""
    items = [list(i) for i in items]
    while len(items) < count:
        largest = max(range(len(items)), key=lambda j: len(items[j]))
        if len(items[largest]) < 2:
            return None
        run = items.pop(largest)
        items += [run[:len(run) // 2], run[len(run) // 2:]]
    return items


def group_micro_batches(keys: Sequence[Hashable], lengths: Sequence[int], prompt_lens: Sequence[int],
                        at_least: int = 1, max_tokens: int | None = None,
                        size: int | None = None) -> list[list[int]] | None:
    """Indices (into `keys`) of each micro-batch: every one within `max_tokens` packed tokens (dynamic
    batch sizes) or `size` sequences (fixed), at least `at_least` of them, sequences with an equal key
    (None: shares with nothing) together where the bound allows (module docstring). None when the
    sequences cannot fill `at_least` micro-batches."""
    if (max_tokens is None) == (size is None):
        raise ValueError("group_micro_batches: give max_tokens or size, not both")
    n = len(keys)
    if n == 0 or len(lengths) != n or len(prompt_lens) != n:
        raise ValueError(f"group_micro_batches: {n} keys, {len(lengths)} lengths, {len(prompt_lens)} prompt lengths")
    if max_tokens is not None and max(lengths) > max_tokens:
        raise ValueError(f"a sequence of {max(lengths)} tokens is longer than max_tokens={max_tokens}")

    def tokens(index: list[int]) -> int:
        return sum(lengths[i] for i in index)

    def fits(index: list[int]) -> bool:
        return tokens(index) <= max_tokens if max_tokens is not None else len(index) <= size

    def computed(index: list[int]) -> int:  # the shared layout's row: each key's prompt once
        return shared_token_count([(keys[i], prompt_lens[i], lengths[i] - prompt_lens[i]) for i in index])

    items = _items(keys, lengths, fits)
    if max_tokens is not None:
        count = max(at_least, -(-tokens(list(range(n))) // max_tokens))
    else:
        count = max(at_least, -(-n // size))
    while True:
        ready = _cut(items, count)
        if ready is None:
            return None
        bins: list[list[int]] = [[] for _ in range(count)]
        placed = True
        for item in sorted(ready, key=lambda i: (-computed(i), i[0])):
            open_bins = [b for b in bins if fits(b + item)]
            if not open_bins:
                placed = False
                break
            min(open_bins, key=lambda b: (computed(b), len(b))).extend(item)
        if placed and all(bins):
            return sorted((sorted(b) for b in bins), key=lambda b: b[0])  # in the order they came
        count += 1
        if count > n:
            return None


__all__ = ["group_micro_batches"]
