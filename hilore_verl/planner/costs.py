"""Cost model: per unit and option, bytes held until backward and extra time, scaled by tokens.

Measured by `profile` on a probe micro-batch (what each unit's saved tensors take, what a
recomputed unit must still hold, each unit's forward time, codec and host-copy throughput), then
scaled by token count: with k = tokens / probe tokens, a figure f measured on the probe becomes
f ((1 - q) k + q k^2), where q is the share of it found to grow with tokens squared by a second,
smaller probe (a dense attention mask over a packed row, attention's time; 0 on varlen attention).
Per unit u with saved bytes S_u, held-for-recompute bytes H_u (linear), forward time F_u and
compressible share c_u (the rest, e.g. -inf masks, stays exact on the device), so scaled:

    keep        memory S_u                          time 0
    recompute   memory H_u                          time F_u             transient S_u in its backward
    fmt         memory S_u (c_u r_fmt + 1 - c_u)    time 2 S_u / codec_bw    r_fmt = codes + scales + flags per byte
    fmt+offload memory S_u (1 - c_u)                time 2 S_u / codec_bw + 2 S_u c_u r_fmt / host_bw

What a unit keeps exact in every mode (its pinned bytes: a standalone call's inputs, made before it)
is fixed memory, no option of the unit: the profile counts it with the unmanaged bytes.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from hilore_verl.kernels import FORMATS, payload_ratio, quantize
from hilore_verl.planner.solver import Option
from hilore_verl.runtime import Runtime
from hilore_verl.runtime.stats import RuntimeStats
from hilore_verl.units import unit_kind
from hilore_verl.timing import DeviceClock

@dataclass
class UnitProfile:
    name: str
    saved_bytes: float  # what the unit's saved tensors take (keep)
    held_bytes: float  # what the unit holds when recomputed and its neighbours kept (inputs, replayed outputs)
    forward_s: float  # the unit's own forward time (children of other units excluded)
    compressible: float = 1.0  # share of saved bytes a codec can take (the rest, e.g. -inf masks, stays exact)
    saved_quadratic: float = 0.0  # share of saved_bytes that grows with tokens squared (a dense mask over a packed row)
    forward_quadratic: float = 0.0  # the same for forward_s (attention over a packed row)


@dataclass
class CostTable:
    units: list[UnitProfile]
    tokens: int  # the probe micro-batch's token count
    unmanaged_bytes: float  # saved state outside units (residual stream, masks, small tensors)
    element_size: int = 2
    codec_bytes_per_s: float = 1e10
    host_bytes_per_s: float = 2e10
    formats: Sequence[str] = FORMATS
    offload: bool = False
    group_size: int = 64
    region_saving_bytes: float = 0.0
    """Per decoder layer re-run as one region (all its outermost units recomputed): bytes held below the
    sum of its units' recompute figures (the residual stream inside the layer is regenerated, and the
    inner calls hold no inputs of their own)."""
    unmanaged_quadratic: float = 0.0
    """Share of unmanaged_bytes that grows with tokens squared."""

    def scale(self, tokens: int) -> float:
        return tokens / self.tokens

    def grow(self, value: float, quadratic: float, tokens: int) -> float:
        """A figure measured at the probe's tokens, at `tokens`: its quadratic share grows with k^2."""
        k = tokens / self.tokens
        return value * ((1 - quadratic) * k + quadratic * k * k)

    def unmanaged(self, tokens: int) -> float:
        return self.grow(self.unmanaged_bytes, self.unmanaged_quadratic, tokens)

    def options(self, unit: UnitProfile, tokens: int, risk: Callable[[str, str], float] | None = None) -> list[Option]:
        """keep, recompute, then each format (and its offloaded variant when enabled)."""
        S = self.grow(unit.saved_bytes, unit.saved_quadratic, tokens)
        H = unit.held_bytes * self.scale(tokens)  # inputs and outputs held: one row per token
        F = self.grow(unit.forward_s, unit.forward_quadratic, tokens)
        opts = [Option("keep", S, 0.0), Option("recompute", H, F)]
        if S > 0:
            for fmt in self.formats:
                r = risk(unit.name, fmt) if risk else math.inf  # no risk model: lossy is never free
                c = unit.compressible
                codes = S * c * payload_ratio(fmt, self.element_size, self.group_size)
                exact = S * (1 - c)  # kept exact on the device (e.g. -inf masks), offloaded or not
                codec_s = 2 * S / self.codec_bytes_per_s
                opts.append(Option(fmt, codes + exact, codec_s, r))
                if self.offload:
                    opts.append(Option(fmt + "+offload", exact, codec_s + 2 * codes / self.host_bytes_per_s, r))
        return opts

    def transient(self, tokens: int) -> float:
        """Reserve for what backward regenerates or dequantizes at once: the largest unit's saved bytes."""
        return max((self.grow(u.saved_bytes, u.saved_quadratic, tokens) for u in self.units), default=0.0)


def _float_fields(obj) -> list[str]:
    return [f.name for f in dataclasses.fields(obj) if f.type in ("float", float)]


def measured_values(costs: CostTable) -> list[float]:
    """Every measured number of a table in a fixed order (each unit's float fields, then the table's):
    what ranks average so that they plan from the same numbers. A new float field is included."""
    return [getattr(u, n) for u in costs.units for n in _float_fields(u)] + [getattr(costs, n)
                                                                           for n in _float_fields(costs)]


def set_measured_values(costs: CostTable, values) -> None:
    """The inverse of `measured_values`."""
    it = iter(values)
    for obj in [*costs.units, costs]:
        for n in _float_fields(obj):
            setattr(obj, n, float(next(it)))


def _unit_times(runtime: Runtime, run: Callable[[], None], clock: DeviceClock) -> dict[str, float]:
    """Forward time per unit: each unit-module call timed on the device, minus its child unit-module
    calls. Marks are read after the run (CUDA events), so timing adds no synchronization per call there."""
    stack: list[list] = []
    calls: list[list] = []  # [unit name, start mark, end mark, child calls]
    handles = []
    unit_of = runtime.unit_modules

    def pre(module, args):
        if torch.is_grad_enabled() and not runtime.recomputing:
            call = [unit_of[module].name, clock.mark(), None, []]
            if stack:
                stack[-1][1][3].append(call)
            stack.append((module, call))

    def post(module, args, output):
        if not stack or stack[-1][0] is not module:
            return
        _, call = stack.pop()
        call[2] = clock.mark()
        calls.append(call)

    for module in unit_of:
        handles.append(module.register_forward_pre_hook(pre))
        handles.append(module.register_forward_hook(post))
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    totals: dict[str, float] = {}  # only units that ran
    for name, start, end, children in calls:
        elapsed = clock.seconds(start, end)
        own = elapsed - sum(clock.seconds(c[1], c[2]) for c in children if c[2] is not None)
        totals[name] = totals.get(name, 0.0) + own
    return totals


def _throughput(clock: DeviceClock, fn: Callable[[], None], nbytes: int, repeats: int = 3) -> float:
    return nbytes / max(clock.time(fn, repeats), 1e-12)


def _unpinned(stats: RuntimeStats, unit: str, figure: str) -> int:
    """A unit's saved or stored bytes less its pinned ones (kept exact in every mode: fixed memory,
    which `profile` counts with the unmanaged bytes instead of in any option of the unit)."""
    return getattr(stats.units[unit], figure) - stats.units[unit].pinned_bytes


def quadratic_share(small: float, large: float, r: float) -> float:
    """Share q of a figure at the larger probe that grows with tokens squared, from the figure at both
    probes (`r` = small tokens / large tokens): small / large = (1 - q) r + q r^2, q clipped to [0, 1]
    (a fixed part, e.g. per-call overhead, reads as q < 0 and is priced linearly)."""
    if large <= 0 or not 0 < r < 1:
        return 0.0
    return min(max((r - small / large) / (r - r * r), 0.0), 1.0)


def profile(runtime: Runtime, run: Callable[[], None], tokens: int, element_size: int = 2,
            small: tuple[Callable[[], None], int] | None = None, **kwargs) -> CostTable:
    """Measure a CostTable with probe runs of one micro-batch; `run()` does its forward and backward.
    `small`: (run, tokens) of a probe of about half the tokens, on which the kept-layer and GC probes
    run again to find what grows faster than linearly (attention over a packed row: its dense mask and
    its time); without it every figure scales linearly.

    Every probe runs under GC's plan (each decoder layer recomputed as one region; the head kept,
    as HF checkpointing keeps it) except in a probed layer, so a probe holds about GC's peak plus
    one layer's activations. There is one probed layer per layer variant (layers whose units have
    the same groups, units.py: e.g. the dense and the MoE layers of DeepSeek-V3), the middle one of
    its variant; its figures stand for every unit of the same group. Every probe times every unit's
    own forward (CUDA events: no synchronization per call); a unit's time is its fastest. A unit
    that never ran is a unit map that does not fit the model: ValueError.

        1. GC's plan                                what a layer recomputed as one region holds
        2. each probed layer kept (one probe each)  saved bytes per group; unmanaged bytes per layer
        3. the probed layers and the head int8      the compressible share per group
        4. per unit of a probed layer: recomputed, the rest of its layer kept (the head recomputed
           in the first)                            what a recomputed unit still holds
        5. with `small`: 1 and 2 on the small probe the quadratic shares of saved bytes, forward
                                                    times and unmanaged bytes
    """
    plan_before = {u.name: runtime.plan_of(u.name) for u in runtime.units}
    device = next(runtime.model.parameters()).device
    clock = DeviceClock(device)
    group = {u.name: u.group or unit_kind(u.name) for u in runtime.units}
    # one probed layer per layer variant (its units' groups): the middle one of the layers of that variant
    by_variant: dict[tuple, list[int]] = {}
    for index in sorted({u.layer_index for u in runtime.units if u.layer_index is not None}):
        key = tuple(group[u.name] for u in runtime.units if u.layer_index == index)
        by_variant.setdefault(key, []).append(index)
    probed_layers = {found[len(found) // 2]: len(found) for found in by_variant.values()}  # layer -> layers like it
    probed = [u for u in runtime.units if u.layer_index in probed_layers]
    heads = [u for u in runtime.units if u.layer_index is None]
    gc_plan = {u.name: "recompute" for u in runtime.units if u.layer_index is not None}

    # every probe times each unit's forward; a unit's time is its fastest (the least disturbed)
    times: dict[str, float] = {u.name: math.inf for u in runtime.units}
    small_times = dict(times)

    def probe(extra: dict, small_probe: bool = False) -> RuntimeStats:
        runtime.set_plan({**gc_plan, **extra})
        timed = _unit_times(runtime, small[0] if small_probe else run, clock)
        best = small_times if small_probe else times
        best.update({n: min(best[n], t) for n, t in timed.items()})
        return runtime.stats()

    def kept(layer: int) -> dict:
        return {u.name: "keep" for u in probed if u.layer_index == layer}

    held: dict[str, float] = {}
    try:
        whole = probe({})
        keeps = {layer: probe(kept(layer)) for layer in probed_layers}
        if small is not None:
            small_whole = probe({}, small_probe=True)
            small_keeps = {layer: probe(kept(layer), small_probe=True) for layer in probed_layers}
        int8 = probe({u.name: "int8" for u in probed + heads})
        for i, u in enumerate(probed or heads):
            extra = {**kept(u.layer_index), u.name: "recompute"}
            extra.update({h.name: "recompute" for h in heads} if i == 0 else {})
            stats = probe(extra)
            held[group[u.name]] = _unpinned(stats, u.name, "stored_bytes")
            held.update({h.name: _unpinned(stats, h.name, "stored_bytes") for h in heads} if i == 0 else {})
    finally:
        runtime.set_plan(plan_before)
    never = [n for n, t in times.items() if t == math.inf]
    if never:  # a unit map that names modules the model does not call in its training forward
        blocks = sorted({type(u.block).__name__ for u in runtime.units if u.name in never and u.block is not None})
        raise ValueError(f"hilore-verl: units {', '.join(never[:6])}{' ...' if len(never) > 6 else ''} never ran in "
                         f"the training forward: the unit map of {', '.join(blocks) or 'the head'} names modules "
                         "this model does not call (see hilore_verl/unit_maps.py)")
    first = next(iter(keeps.values()), whole)
    r8 = payload_ratio("int8", element_size)
    figures = {}  # group -> (saved bytes, compressible share), from the probed layers and the head
    for u in probed + heads:
        keep = keeps.get(u.layer_index, first)
        saved, stored8 = _unpinned(keep, u.name, "saved_bytes"), _unpinned(int8, u.name, "stored_bytes")
        figures[group[u.name]] = (saved, min(max((1 - stored8 / saved) / (1 - r8), 0.0), 1.0) if saved else 1.0)
    units = [UnitProfile(u.name, figures[group[u.name]][0], held[group[u.name]], times[u.name],
                         figures[group[u.name]][1]) for u in runtime.units]
    # totals held at the end of the forward: every layer kept = GC's plan + its probed layer's difference
    total = lambda st: st.stored_bytes + st.unmanaged_bytes + st.unmanaged_held_bytes + st.index_bytes  # noqa: E731
    keep_all = lambda w, ks: total(w) + sum(n * (total(ks[layer]) - total(w))  # noqa: E731
                                            for layer, n in probed_layers.items())
    unmanaged = max(keep_all(whole, keeps) - sum(u.saved_bytes for u in units), 0.0)  # residual stream, masks, pinned
    unmanaged_q = 0.0
    if small is not None:  # how each figure grew from the small probe to this one
        r = small[1] / tokens
        small_first = next(iter(small_keeps.values()), small_whole)
        saved_small = {group[u.name]: _unpinned(small_keeps.get(u.layer_index, small_first), u.name, "saved_bytes")
                       for u in probed + heads}
        for u in units:
            u.saved_quadratic = quadratic_share(saved_small[group[u.name]], u.saved_bytes, r)
            u.forward_quadratic = quadratic_share(small_times[u.name], u.forward_s, r)
        unmanaged_small = max(keep_all(small_whole, small_keeps)
                              - sum(saved_small[group[u.name]] for u in runtime.units), 0.0)
        unmanaged_q = quadratic_share(unmanaged_small, unmanaged, r)
    saving = 0.0
    if probed_layers and runtime.whole_blocks(gc_plan):  # GC's plan = the units' figures minus a region saving per layer
        summed = sum(u.held_bytes if u.name in gc_plan else u.saved_bytes for u in units) + unmanaged
        saving = max((summed - total(whole)) / runtime.whole_blocks(gc_plan), 0.0)
    # the codec on the activations' dtype and device (element_size 4: fp32, else bf16)
    sample = torch.randn(1024, 1024, device=device, dtype=torch.float32 if element_size == 4 else torch.bfloat16)
    nbytes = sample.numel() * sample.element_size()
    codec = _throughput(clock, lambda: quantize(sample, "int8", 64).dequantize(), 2 * nbytes)
    host = _throughput(clock, lambda: sample.to("cpu", copy=True), nbytes)
    return CostTable(units, tokens, unmanaged, element_size, codec, host, region_saving_bytes=saving,
                     unmanaged_quadratic=unmanaged_q, **kwargs)
