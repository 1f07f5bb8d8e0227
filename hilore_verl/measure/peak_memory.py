"""The measured peak of one mini-batch, in the terms of the controller's memory model.

The memory model predicts `static + what the update holds` (planner/controller.py). What is measured:

    CUDA   torch.cuda.max_memory_reserved after reset_peak_memory_stats at the mini-batch's start: the
           caching allocator's segments, what the process holds on the device (static state included,
           so the figure is compared as it is). Not the allocated peak: a budget is device memory,
           and fragmentation (segments the allocator holds but cannot fit a request into) is what
           makes a job run out of memory at "enough" allocated bytes. Segments are rounded (to 2 MiB,
           20 MiB for requests of 1-10 MiB): an overshoot within `DEVICE_NOISE_BYTES` is not acted on;
    CPU    (Linux) the resident high-water mark, reset at the start (/proc/self/clear_refs <- 5), less
           the resident size then, plus the static bytes: what the mini-batch added on top of the
           state it started with. malloc may serve the update from memory it kept from an earlier
           one, so this can read low; it never reads the libraries and the interpreter.

The resident size also moves with what the update does not own (malloc's arenas, Python objects,
pages touched once): on the CPU an overshoot within `HOST_NOISE_BYTES` is not taken as the memory
model's error (`PeakMeter.noise_bytes`; `DEVICE_NOISE_BYTES` on CUDA). Measured here (glibc, torch
2.13): a fresh process's 24 MiB of float64 chunks read 24-27 MiB, and 64-67 MiB in about one run of
three when the chunks came from and went back to malloc's heap (its mmap threshold moves as blocks are
freed); the demo's model, one rank in-process, read 0.068-0.103 GiB from one mini-batch to the next
for a plan predicted at 0.059-0.062 GiB.

Where neither is available (another OS, /proc not writable) `PeakMeter.available` is False with the
reason, and the session plans without the feedback (and says so once).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from hilore_verl.measure import host_memory

CLEAR_REFS = "/proc/self/clear_refs"
AUTOGRAD_ENGINE = "autograd::engine::"  # the profiler's name for the backward's nodes
HOST_NOISE_BYTES = 64 * 2**20
DEVICE_NOISE_BYTES = 20 * 2**20  # the caching allocator's largest segment rounding


class PeakMeter:
    """`start()` before a mini-batch, `read(static_bytes)` after it: its peak in bytes, or None."""

    def __init__(self, cuda: bool | None = None):
        self.cuda = torch.cuda.is_available() and torch.cuda.is_initialized() if cuda is None else cuda
        self.why_not: str | None = None
        self.noise_bytes = float(DEVICE_NOISE_BYTES if self.cuda else HOST_NOISE_BYTES)
        self._start: float | None = None
        if not self.cuda:
            try:
                self._reset_host_peak()
                host_memory.peak_resident_bytes()
            except (OSError, RuntimeError) as err:
                self.why_not = f"the resident high-water mark cannot be reset or read here ({err})"

    @property
    def available(self) -> bool:
        return self.why_not is None

    def start(self) -> None:
        if not self.available:
            return
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
            return
        self._reset_host_peak()
        self._start = float(host_memory.resident_bytes())

    def read(self, static_bytes: float) -> float | None:
        """The peak since `start()` (None if it was not started or cannot be measured)."""
        if not self.available:
            return None
        if self.cuda:
            return float(torch.cuda.max_memory_reserved())
        if self._start is None:
            return None
        added = host_memory.peak_resident_bytes() - self._start
        self._start = None
        return static_bytes + max(added, 0.0)

    @staticmethod
    def _reset_host_peak() -> None:
        with open(CLEAR_REFS, "w") as f:
            f.write("5")


@dataclass
class Allocations:
    """What one call allocated, from the allocator's own events (both devices): `peak`, the most bytes
    alive at once that the call allocated itself (`during` of them freed before it returned: its
    activations and working memory; the rest, `kept`, outlived it: gradients, optimizer state)."""
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
    """With `marker`: `during` at its most in the forward up to its last mark (e.g. the decoder layers);
    the whole forward's without marks there."""
    forward_tail: tuple[tuple[str, float], ...] = ()
    """With `marker`: the forward after its last mark (e.g. the head), per top-level profiler event that
    allocated there, in order: (its name, `during` at its most while it ran)."""
    backward_lead: tuple[tuple[str, float], ...] = ()
    """The same for the backward before its first mark (e.g. the head's backward, before the layers')."""
    backward_body_during: float = 0.0
    """`during` at its most in the backward from its first mark on; the whole backward's without marks."""


def allocations(fn: Callable[[], object], device: torch.device | str = "cpu", marker: str | None = None) -> Allocations:
    """Run `fn()` under torch's profiler with memory events and sum its allocations by address. Frees of
    memory allocated before the call are not counted (they lower nothing the call allocated). An
    allocator that reports nothing (no events at all): RuntimeError, rather than a peak of 0. `marker`:
    the name of profiler ranges (torch.profiler.record_function) that `fn` opens as marks; each phase is
    then split at them (`Allocations.forward_tail`, `backward_lead`)."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    kind = torch.device(device).type
    roots = prof.profiler.kineto_results.experimental_event_tree()
    events, marks, stack = [], [], [(e, False, i) for i, e in enumerate(roots)]
    backward_from = math.inf  # the autograd engine's first allocation: the backward starts there
    while stack:
        e, engine, root = stack.pop()
        engine = engine or e.name.startswith(AUTOGRAD_ENGINE)
        stack.extend((child, engine, root) for child in e.children)
        if marker is not None and e.name == marker:
            marks.append(e.start_time_ns)
        if e.tag == _EventType.Allocation and e.extra_fields.device.type == kind:
            events.append((e.start_time_ns, e.extra_fields.ptr, e.extra_fields.alloc_size, root))
            if engine and e.extra_fields.alloc_size > 0:
                backward_from = min(backward_from, e.start_time_ns)
    if not events:
        raise RuntimeError(f"the profiler reported no {kind} allocations: its memory events are not available here")
    events.sort()
    last: dict[int, int] = {}  # address -> index of its last allocation in the call
    for i, (_, ptr, size, _) in enumerate(events):
        if size > 0:
            last[ptr] = i
        elif ptr in last:
            del last[ptr]  # freed: not kept
    kept_at = set(last.values())
    tail_from = max((t for t in marks if t < backward_from), default=math.inf)  # the forward after its last mark
    lead_to = min((t for t in marks if t >= backward_from), default=backward_from)  # the backward before its first
    live: dict[int, tuple[int, bool]] = {}  # address -> (bytes, kept)
    total = during = peak = peak_during = kept_at_peak = 0
    phases = [[0, 0], [0, 0]]  # forward, backward: [during at its most, kept then]
    body = [0, 0]  # forward up to its last mark, backward from its first: during at its most
    nodes: tuple[dict[int, int], dict[int, int]] = ({}, {})  # forward's tail, backward's lead: root -> during
    for i, (at, ptr, size, root) in enumerate(events):
        if size > 0:
            live[ptr] = (size, i in kept_at)
            total += size
            during += 0 if i in kept_at else size
        elif ptr in live:
            size, kept = live.pop(ptr)
            total -= size
            during -= 0 if kept else size
        peak = max(peak, total)
        if during > peak_during:
            peak_during, kept_at_peak = during, total - during
        backward = at >= backward_from
        phase = phases[backward]
        if during > phase[0]:
            phase[:] = [during, total - during]
        if (at < lead_to) if backward else (at >= tail_from):
            window = nodes[backward]
            window[root] = max(window.get(root, 0), during)
        else:
            body[backward] = max(body[backward], during)
    tail, lead = (tuple((roots[r].name, float(v)) for r, v in sorted(w.items()) if roots[r].tag != _EventType.Allocation)
                  for w in nodes)  # an allocation outside every op is no node: the next node holds it
    return Allocations(float(peak), float(peak_during), float(sum(events[i][2] for i in kept_at)), float(kept_at_peak),
                       float(phases[0][0]), float(phases[1][0]), float(phases[1][1]), float(body[0]), tail, lead,
                       float(body[1]))
