"""Which sequences the first step probes: whole sequences up to a token bound.

Profiling and calibration run about sixteen forward + backward passes of one probe micro-batch
before any plan exists. On all of a large micro-batch's tokens those passes would take many
steps, and a probe that keeps one layer's activations would go past GC's peak on exactly the
jobs that need GC. So the probe is a few whole sequences of a micro-batch (always at least one),
at most `probe_token_bound` tokens: the configured bound (hilore.profile_tokens) and 1/8 of the
tokens a rank trains on in the step, so the ~18 probe passes cost about two steps' work (the profile
takes two sequences up to twice that where one alone would fit: `profile_indices`). The cost
table scales its figures from the probe's tokens (`CostTable.grow`; `half_probe` gives the second,
smaller probe that measures what grows faster than linearly, and the fixed per-call part of unit
times that a small probe on a GPU is bound by), and the risk model is calibrated against the
probe's own exposure.

    lengths  = [180, 75, 240, 96]          # tokens per sequence
    priority = [0.0, 2.1, 0.4, 1.7]        # e.g. each sequence's exposure (calibration)
    probe_indices(lengths, 300, priority)  # -> [1, 3]: the most exposed that fit, in their order
"""

from __future__ import annotations

from typing import Sequence

STEP_SHARE = 8  # the probe takes at most 1 / STEP_SHARE of a step's tokens
MIN_PROBE_TOKENS = 64  # ... but never fewer than this (or the step's tokens): room for a half probe


def probe_token_bound(profile_tokens: int, step_tokens: int) -> int:
    """Tokens the probe may take: `profile_tokens` (0: no fixed bound) and step_tokens / STEP_SHARE, at
    least MIN_PROBE_TOKENS (of the step's). A step of a few hundred tokens would otherwise probe a single
    short sequence, which leaves no second probe to tell a unit's per-call time from its per-token time
    (its per-call time would then be priced as growing with tokens)."""
    share = max(int(step_tokens) // STEP_SHARE, min(MIN_PROBE_TOKENS, int(step_tokens)), 1)
    return min(profile_tokens, share) if profile_tokens > 0 else share


def probe_indices(lengths: Sequence[int], max_tokens: int, priority: Sequence[float] | None = None) -> list[int]:
    """Indices (ascending) of whole sequences with at most `max_tokens` tokens in all: taken in order
    of `priority` (highest first; default: as they come), skipping any that would not fit, and at
    least the first of that order. `max_tokens` 0: every sequence."""
    if len(lengths) == 0:
        raise ValueError("probe_indices: no sequences")
    if max_tokens < 0:
        raise ValueError(f"probe_indices: max_tokens must be >= 0, got {max_tokens}")
    if max_tokens == 0:
        return list(range(len(lengths)))
    order = list(range(len(lengths)))
    if priority is not None:
        if len(priority) != len(lengths):
            raise ValueError(f"probe_indices: {len(priority)} priorities for {len(lengths)} sequences")
        order.sort(key=lambda i: -float(priority[i]))  # stable: equal priorities keep their order
    chosen, total = [], 0
    for i in order:
        if not chosen or total + int(lengths[i]) <= max_tokens:
            chosen.append(i)
            total += int(lengths[i])
    return sorted(chosen)


def profile_indices(lengths: Sequence[int], max_tokens: int) -> list[int]:
    """The profile's probe: `probe_indices` in the sequences' order; where that is one sequence of
    several, the two shortest instead when they total at most 2 * max_tokens. A probe of one sequence
    has no half probe (`half_probe`), and its fixed parts (autocast's weight copies) would then scale
    with the tokens; two bring one, for at most twice the bound's work. Longer ones stay one sequence
    (the log says so: calibration._profile).

        profile_indices([71, 66, 90, 80], 73)  # -> [0, 1]: 71 alone fits the bound, 71 + 66 <= 146
        profile_indices([300, 240], 73)        # -> [0]: 540 > 146
    """
    index = probe_indices(lengths, max_tokens)
    if len(index) > 1 or len(lengths) < 2 or max_tokens == 0:
        return index
    pair = sorted(range(len(lengths)), key=lambda i: int(lengths[i]))[:2]  # stable: equal lengths in order
    return sorted(pair) if sum(int(lengths[i]) for i in pair) <= 2 * max_tokens else index


def half_probe(lengths: Sequence[int], index: Sequence[int]) -> list[int] | None:
    """Of the probe's sequences `index`, the longest ones that fit in half its tokens, taken longest first
    and skipping any that would not fit (the profile's second, smaller probe, see profiling.profile):
    as close to half as whole sequences allow, so that a probe of two uneven sequences still has one.
    None for a probe of one sequence, where nothing smaller is whole: then every figure scales linearly."""
    half = sum(int(lengths[i]) for i in index) // 2
    chosen, total = [], 0
    for i in sorted(index, key=lambda i: -int(lengths[i])):  # stable: equal lengths keep their order
        if 0 < int(lengths[i]) and total + int(lengths[i]) <= half:
            chosen.append(i)
            total += int(lengths[i])
    return sorted(chosen) or None
