"""What one call allocates, from the allocator's own events (torch's profiler with memory events), in
the terms of the memory model's transients (planner/transient.py).

A training pass's allocations are summed by address in time order. `during` counts only what the
call also freed (activations, working memory), `kept` what outlived it (gradients). Each phase (the
forward; the backward from the autograd engine's first allocation) has its most `during`, and with
marks (zero-length profiler ranges the caller opens) each phase splits into parts that grow apart:

    forward    up to the head's call (or the last layer mark)   body: the layers, final norm, lm_head
               the head's call and the loss after it             tail: per op, with the level at the
                                                                 call's start and what it left held
    backward   before the head's inputs' gradients are made      lead: per op
               (or the first layer mark)
               from there on                                     body

The tail and the lead are listed per top-level profiler event (an op, or an autograd node), in order:
(its name, `during` at its most while it ran).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch._C._profiler import _EventType

AUTOGRAD_ENGINE = "autograd::engine::"  # the profiler's name for the backward's nodes


@dataclass
class Allocations:
    """What one call allocated: `peak`, the most bytes alive at once that the call allocated itself
    (`during` of them freed before it returned: its activations and working memory; the rest, `kept`,
    outlived it: gradients, optimizer state)."""
    peak: float  # the call's own allocations, kept ones included, at their most
    during: float  # the same counting only what the call also freed
    kept: float  # allocated by the call, alive when it returned
    kept_at_peak: float  # of `kept`, what was allocated already when `during` was at its most
    forward_during: float = 0.0
    """`during` at its most before the autograd engine's first allocation (a training pass's forward);
    the call's `during` where it ran no backward."""
    backward_during: float = 0.0  # `during` at its most from the autograd engine's first allocation on (0: none)
    backward_kept: float = 0.0  # of `kept`, what was allocated already then
    forward_body_during: float = 0.0
    """With marks: `during` at its most in the forward's body (before its tail); the whole forward's
    without marks there."""
    forward_tail: tuple[tuple[str, float], ...] = ()
    """With marks: the forward's tail per top-level profiler event that allocated there, in order: (its
    name, `during` at its most while it ran)."""
    backward_lead: tuple[tuple[str, float], ...] = ()
    """The same for the backward's lead."""
    backward_body_during: float = 0.0
    """`during` at its most in the backward's body; the whole backward's without marks."""
    call_marked: bool = False
    """Whether the tail started at a call mark (then `call_base` and `call_held` are measured)."""
    call_base: float = 0.0
    """`during` when the tail's call started: what the body left alive (its saves, lm_head's logits)."""
    call_held: float = 0.0
    """What the forward allocated from the call's start on and still held when the backward started
    (the saves of the call and of the loss after it)."""


@dataclass
class _Windows:
    tail_from: float  # forward events from here on are the tail's
    lead_to: float  # backward events before here are the lead's
    call_marked: bool


def allocations(fn: Callable[[], object], device: torch.device | str = "cpu", marker: str | None = None,
                call_marks: tuple[str, str] | None = None) -> Allocations:
    """Run `fn()` under torch's profiler with memory events and sum its allocations by address. Frees of
    memory allocated before the call are not counted (they lower nothing the call allocated). An
    allocator that reports nothing (no events at all): RuntimeError, rather than a peak of 0. `marker`:
    the name of the marks `fn` opens at the layers' calls; each phase is then split at them (the tail
    after the forward's last, the lead before the backward's first). `call_marks` (with `marker`): the
    names of the marks at the head's call's start (forward) and where its inputs' gradients are ready
    (backward), which move the split to the head's own ops: the ops between the layers and the call, and
    those between the call's backward and the layers', then count with the bodies."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    roots, events, marks, backward_from = _collect(prof, torch.device(device).type,
                                                   {marker, *(call_marks or ())} - {None})
    windows = _windows(marks, marker, call_marks, backward_from)
    last: dict[int, int] = {}  # address -> index of its last allocation in the call
    for i, (_, ptr, size, _) in enumerate(events):
        if size > 0:
            last[ptr] = i
        elif ptr in last:
            del last[ptr]  # freed: not kept
    kept_at = set(last.values())
    live: dict[int, tuple[int, bool, int]] = {}  # address -> (bytes, kept, when allocated)
    total = during = peak = peak_during = kept_at_peak = 0
    phases = [[0, 0], [0, 0]]  # forward, backward: [during at its most, kept then]
    body = [0, 0]  # forward before its tail, backward after its lead: during at its most
    nodes: tuple[dict[int, int], dict[int, int]] = ({}, {})  # forward's tail, backward's lead: root -> during
    base = held = None
    for i, (at, ptr, size, root) in enumerate(events):
        if base is None and at >= windows.tail_from:
            base = during  # what the body left alive when the tail starts
        if held is None and at >= backward_from:
            held = sum(s for s, k, t in live.values() if not k and t >= windows.tail_from)
        if size > 0:
            live[ptr] = (size, i in kept_at, at)
            total += size
            during += 0 if i in kept_at else size
        elif ptr in live:
            size, kept, _ = live.pop(ptr)
            total -= size
            during -= 0 if kept else size
        peak = max(peak, total)
        if during > peak_during:
            peak_during, kept_at_peak = during, total - during
        backward = at >= backward_from
        phase = phases[backward]
        if during > phase[0]:
            phase[:] = [during, total - during]
        if (at < windows.lead_to) if backward else (at >= windows.tail_from):
            window = nodes[backward]
            window[root] = max(window.get(root, 0), during)
        else:
            body[backward] = max(body[backward], during)
    tail, lead = (tuple((roots[r].name, float(v)) for r, v in sorted(w.items()) if not _is_allocation(roots[r]))
                  for w in nodes)  # an allocation outside every op is no node: the next node holds it
    return Allocations(float(peak), float(peak_during), float(sum(events[i][2] for i in kept_at)), float(kept_at_peak),
                       float(phases[0][0]), float(phases[1][0]), float(phases[1][1]), float(body[0]), tail, lead,
                       float(body[1]), windows.call_marked, float(base or 0) if windows.call_marked else 0.0,
                       float(held or 0) if windows.call_marked else 0.0)


def _collect(prof, kind: str, names: set[str]):
    """(root events, [(time, address, bytes (< 0: a free), root index)] of `kind` in time order, mark name ->
    its times, the autograd engine's first allocation's time: the backward starts there)."""
    roots = prof.profiler.kineto_results.experimental_event_tree()
    events, marks, stack = [], {n: [] for n in names}, [(e, False, i) for i, e in enumerate(roots)]
    backward_from = math.inf
    while stack:
        e, engine, root = stack.pop()
        engine = engine or e.name.startswith(AUTOGRAD_ENGINE)
        stack.extend((child, engine, root) for child in e.children)
        if e.name in marks:
            marks[e.name].append(e.start_time_ns)
        if _is_allocation(e) and e.extra_fields.device.type == kind:
            events.append((e.start_time_ns, e.extra_fields.ptr, e.extra_fields.alloc_size, root))
            if engine and e.extra_fields.alloc_size > 0:
                backward_from = min(backward_from, e.start_time_ns)
    if not events:
        raise RuntimeError(f"the profiler reported no {kind} allocations: its memory events are not available here")
    events.sort()
    return roots, events, marks, backward_from


def _windows(marks: dict[str, list[int]], marker: str | None, call_marks: tuple[str, str] | None,
             backward_from: float) -> _Windows:
    """Where the forward's tail starts and the backward's lead ends (see the module's table)."""
    layer = marks.get(marker, []) if marker is not None else []
    tail_from = max((t for t in layer if t < backward_from), default=math.inf)
    first = min((t for t in layer if t >= backward_from), default=math.inf)  # a layer's re-run or backward
    lead_to = first if first < math.inf else backward_from
    if call_marks is None or tail_from == math.inf:
        return _Windows(tail_from, lead_to, False)
    start = min((t for t in marks[call_marks[0]] if tail_from <= t < backward_from), default=None)
    end = max((t for t in marks[call_marks[1]] if backward_from <= t < first), default=None)
    return _Windows(tail_from if start is None else start, lead_to if end is None else end, start is not None)


def _is_allocation(event) -> bool:
    return event.tag == _EventType.Allocation


__all__ = ["AUTOGRAD_ENGINE", "Allocations", "allocations"]
