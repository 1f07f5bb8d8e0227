"""Profiling: the probe runs that measure a CostTable (planner/costs.py) on a model's runtime
(`profile`); the figures and how they scale with tokens are the cost model's (costs.py).

Every probe runs under GC's plan (each decoder layer recomputed as one region; the head kept,
as HF checkpointing keeps it) except in a probed layer, so a probe holds about GC's peak plus
one layer's activations. There is one probed layer per layer variant (layers whose units have
the same groups, units.py: e.g. the dense and the MoE layers of DeepSeek-V3), the middle one of
its variant; its figures stand for every unit of the same group. Every probe times every unit's
own forward (CUDA events: no synchronization per call); a unit's time is its fastest. A unit
that never ran is a unit map that does not fit the model: ValueError.

    1. GC's plan                                what a layer recomputed as one region holds
    2. each probed layer kept (one probe each)  saved bytes and weight copies per group; unmanaged
                                                bytes per layer
    3. the probed layers and the head int8      the compressible share per group
    4. per unit of a probed layer: recomputed, the rest of its layer kept
                                                what a recomputed unit still holds, and what its
                                                layer (one region) holds more for it: its inputs,
                                                the kept calls' outputs the re-run replays
       per head unit: recomputed                what the model holds more than with it kept
    5. with `small`: 1 and 2 on the small probe the quadratic shares of saved bytes and forward
                                                times (attention cores only: QUADRATIC_KINDS)
                                                and of unmanaged bytes; per group, the fixed
                                                share of forward times (against 1 and 2's own
                                                times, their spread as the noise)
    6. 1 again, its allocations followed        what a pass allocates at once beyond what its
       (planner/transient.py; with `small`,     forward held, per phase in the layers and in the
       on the small probe too)                  head, the shares that do not grow, and the share
                                                of the gradients allocated by then

Then, when the model had HF checkpointing (`runtime.checkpoint_plan()`), that plan through the runtime
and hands-off, twice each: the runtime's overhead; the fastest GC pass (that hands-off one, or probe 1
through the hooks) less the table's price of its recompute is the kept pass. Then codec and host-copy bandwidths, on samples
the size of the largest unit's saved bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from hilore_verl.kernels import payload_ratio
from hilore_verl.measure.allocations import Allocations
from hilore_verl.planner.bandwidth import bandwidths
from hilore_verl.planner.costs import CostTable, Tokens, UnitProfile, in_layers
from hilore_verl.planner.growth import fixed_share, group_times, quadratic_share
from hilore_verl.planner.transient import fit, followed
from hilore_verl.planner.pass_times import keep_pass_seconds, runtime_overhead
from hilore_verl.runtime import KEEP, RECOMPUTE, Mode, Runtime, UnitPlan
from hilore_verl.runtime.stats import RuntimeStats
from hilore_verl.model.units import RecoveryUnit, name_in_layer
from hilore_verl.measure.timing import DeviceClock

QUADRATIC_KINDS = ("attn_core",)  # units whose figures may grow with tokens squared (dense attention)


def _unit_times(runtime: Runtime, run: Callable[[], None], clock: DeviceClock) -> tuple[dict[str, float], float]:
    """Forward time per unit: each unit-module call timed on the device, minus its child unit-module
    calls; and the whole run's. Marks are read after the run (CUDA events), so timing adds no
    synchronization per call there."""
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
        begin = clock.mark()
        run()
        end = clock.mark()
    finally:
        for h in handles:
            h.remove()
    totals: dict[str, float] = {}  # only units that ran
    for name, start, end, children in calls:
        elapsed = clock.seconds(start, end)
        own = elapsed - sum(clock.seconds(c[1], c[2]) for c in children if c[2] is not None)
        totals[name] = totals.get(name, 0.0) + own
    return totals, clock.seconds(begin, end)


def _unpinned(stats: RuntimeStats, unit: str, figure: str) -> int:
    """A unit's saved or stored bytes less its pinned ones (kept exact in every mode: fixed memory,
    which `profile` counts with the unmanaged bytes instead of in any option of the unit)."""
    return getattr(stats.units[unit], figure) - stats.units[unit].pinned_bytes


def _total(stats: RuntimeStats) -> int:
    """Everything a probe's forward left held: units' stored bytes, unmanaged and index tensors."""
    return stats.stored_bytes + stats.unmanaged_bytes + stats.unmanaged_held_bytes + stats.index_bytes


def _outside(stats: RuntimeStats) -> int:
    """What a probe's forward left held outside every unit (weight copies are their units')."""
    copies = sum(u.copy_bytes for u in stats.units.values())
    return stats.unmanaged_bytes - copies + stats.unmanaged_held_bytes + stats.index_bytes


@dataclass
class _Probes:
    """The probe runs' setup, and the unit times every run adds to (a unit's time is its fastest)."""

    runtime: Runtime
    run: Callable[[], None]
    small_run: Callable[[], None] | None
    clock: DeviceClock
    group: dict[str, str]  # unit -> group
    probed_layers: dict[int, int]  # probed layer -> layers like it
    gc_plan: dict[str, UnitPlan]
    probed: list[RecoveryUnit] = field(init=False)  # the probed layers' units
    heads: list[RecoveryUnit] = field(init=False)  # the units outside the layers
    times: dict[str, float] = field(init=False)  # unit -> its fastest forward (inf: never ran)
    small_times: dict[str, float] = field(init=False)  # the same over the small probe's runs
    runs: dict[bool, list[dict[str, float]]] = field(init=False)  # probes 1 and 2's unit times, by size
    gc_passes: list[float] = field(init=False)  # probe 1's whole forward + backward (through the hooks)

    def __post_init__(self):
        self.probed = [u for u in self.runtime.units if u.layer_index in self.probed_layers]
        self.heads = [u for u in self.runtime.units if u.layer_index is None]
        self.times = {u.name: math.inf for u in self.runtime.units}
        self.small_times = dict(self.times)
        self.runs = {False: [], True: []}
        self.gc_passes = []

    def probe(self, extra: dict, small_probe: bool = False, pair: bool = False) -> RuntimeStats:
        """One run under GC's plan with `extra` on top; its unit times fold into the fastest so far."""
        self.runtime.set_plan({**self.gc_plan, **extra})
        timed, seconds = _unit_times(self.runtime, self.small_run if small_probe else self.run, self.clock)
        if not extra and not small_probe:
            self.gc_passes.append(seconds)
        best = self.small_times if small_probe else self.times
        best.update({n: min(best[n], t) for n, t in timed.items()})
        if pair or small_probe:
            self.runs[small_probe].append(timed)
        return self.runtime.stats()

    def kept(self, layer: int) -> dict:
        return {u.name: KEEP for u in self.probed if u.layer_index == layer}


@dataclass
class _ProbeStats:
    """What the probe runs left held (the module's docstring numbers them), and the runtime's overhead."""

    whole: RuntimeStats  # 1: GC's plan
    keeps: dict[int, RuntimeStats]  # 2: each probed layer kept
    int8: RuntimeStats  # 3: the probed layers and the head int8
    held: dict[str, float]  # 4: per group (and head unit), what recomputing it still holds
    replay: dict[str, dict[str, float]]  # 4: per group, what its layer holds more for it, by holder
    small_whole: RuntimeStats | None  # 5: 1 on the small probe
    small_keeps: dict[int, RuntimeStats] | None  # 5: 2 on the small probe
    overhead: float  # `runtime_overhead`: the runtime's hooks over HF checkpointing run hands-off
    hands_off: float  # that hands-off pass's seconds (0: the model had no checkpointing)
    allocations: tuple[Allocations | None, Allocations | None]  # 1 again, its allocations followed; small too


def profile(runtime: Runtime, run: Callable[[], None], tokens: int, element_size: int = 2,
            small: tuple[Callable[[], None], int] | None = None, quadratic: bool = True,
            head_rows: tuple[int, int | None] | None = None, **kwargs) -> CostTable:
    """Measure a CostTable with probe runs of one micro-batch; `run()` does its forward and backward.
    `small`: (run, tokens) of a probe of about half the tokens, on which the kept-layer and GC probes
    run again to find what grows faster than linearly (attention over a packed row: its dense mask and
    its time) and the fixed per-call part of unit times; without it every figure scales linearly.
    `quadratic` False: the second probe prices the fixed parts only (where its sequences are laid out
    unlike the micro-batches', e.g. sharing one prompt, growth between the two probes is not growth
    with tokens). `head_rows`: the rows the head's log-prob code computes in the probe and the small
    probe, where the host says they are fewer than the tokens (the response tokens): the units outside
    the layers scale with those (CostTable.scale).
    The probes: the module's docstring.
    """
    device = next(runtime.model.parameters()).device
    probes = _plan_probes(runtime, run, small, DeviceClock(device))
    stats = _run_probes(probes)
    _check_every_unit_ran(runtime, probes.times)
    units = _unit_profiles(probes, stats, element_size)
    unmanaged = max(_held_all_kept(probes, stats.whole, stats.keeps)
                    - sum(u.saved_bytes + u.fixed_bytes for u in units), 0.0)  # residual stream, masks, pinned
    unmanaged_q = 0.0
    if small is not None:  # how each figure grew from the small probe to this one
        r_head = small[1] / tokens if head_rows is None or not head_rows[1] else head_rows[1] / head_rows[0]
        unmanaged_q = _growth_shares(probes, stats, units, unmanaged, small[1] / tokens, quadratic, r_head)
    saving = _region_saving(probes, stats.whole, units, tokens, unmanaged, element_size)
    codec, host, codec_memory, sampled = bandwidths(probes.clock, device, max((u.saved_bytes for u in units),
                                                                          default=0.0), element_size)
    table = CostTable(units, tokens, unmanaged, element_size, codec, host, region_saving_bytes=saving,
                      unmanaged_quadratic=unmanaged_q, runtime_overhead_s=stats.overhead,
                      head_rows=head_rows[0] if head_rows is not None else 0, codec_transient=codec_memory / sampled,
                      codec_transient_cap=codec_memory, **kwargs)
    gc_pass = (stats.hands_off, runtime.checkpoint_plan()) if stats.hands_off else (min(probes.gc_passes), probes.gc_plan)
    table.keep_pass_s = keep_pass_seconds(table, tokens, *gc_pass)
    large_pass, small_pass = stats.allocations
    fit(table, large_pass, _total(stats.whole), small_pass, _total(stats.small_whole) if small_pass else 0.0,
        Tokens(small[1], head_rows[1] if head_rows else None) if small is not None else None)
    return table


def _plan_probes(runtime: Runtime, run: Callable[[], None], small: tuple[Callable[[], None], int] | None,
                 clock: DeviceClock) -> _Probes:
    """Which layers the probes measure: one per layer variant, the middle one of the layers of that variant."""
    group = {u.name: u.group or name_in_layer(u.name) for u in runtime.units}
    # a layer variant: the groups of its units, in order
    by_variant: dict[tuple, list[int]] = {}
    for index in sorted({u.layer_index for u in runtime.units if u.layer_index is not None}):
        key = tuple(group[u.name] for u in runtime.units if u.layer_index == index)
        by_variant.setdefault(key, []).append(index)
    probed_layers = {found[len(found) // 2]: len(found) for found in by_variant.values()}  # layer -> layers like it
    gc_plan = {u.name: RECOMPUTE for u in runtime.units if u.layer_index is not None}
    return _Probes(runtime, run, small[0] if small is not None else None, clock, group, probed_layers, gc_plan)


def _run_probes(probes: _Probes) -> _ProbeStats:
    """What probes 1 to 5 leave held, and the runtime's overhead; the plan in force before is restored."""
    runtime = probes.runtime
    plan_before = {u.name: runtime.plan_of(u.name) for u in runtime.units}
    small_whole = small_keeps = None
    try:
        whole = probes.probe({}, pair=True)
        keeps = {layer: probes.probe(probes.kept(layer), pair=True) for layer in probes.probed_layers}
        if probes.small_run is not None:
            small_whole = probes.probe({}, small_probe=True)
            small_keeps = {layer: probes.probe(probes.kept(layer), small_probe=True) for layer in probes.probed_layers}
        int8 = probes.probe({u.name: UnitPlan(Mode.COMPRESS, fmt="int8") for u in probes.probed + probes.heads})
        held, replay = _probe_recomputed(probes, whole, keeps)
        overhead, hands_off = runtime_overhead(runtime, probes.run, probes.clock)
        large = followed(runtime, probes.gc_plan, probes.run, probes.clock.device)
        small = (followed(runtime, probes.gc_plan, probes.small_run, probes.clock.device)
                 if large is not None and probes.small_run is not None else None)
    finally:
        runtime.set_plan(plan_before)
    return _ProbeStats(whole, keeps, int8, held, replay, small_whole, small_keeps, overhead, hands_off, (large, small))


def _probe_recomputed(probes: _Probes, whole: RuntimeStats, keeps: dict[int, RuntimeStats]
                      ) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """Probe 4: what each recomputed unit still holds, and what its layer (one region) holds more for it."""
    group = probes.group
    held: dict[str, float] = {}
    replay: dict[str, dict[str, float]] = {}
    for u in probes.probed:
        stats = probes.probe({**probes.kept(u.layer_index), u.name: RECOMPUTE})
        held[group[u.name]] = _unpinned(stats, u.name, "stored_bytes")
        # what its layer holds more for it, by holder: the kept calls' outputs it replays, its inputs
        keep = keeps[u.layer_index]
        # (signed: a save of the region's input that a kept unit made is counted outside units in a region)
        replay[group[u.name]] = {v.name.split(".", 2)[2]: float(_unpinned(stats, v.name, "stored_bytes")
                                                                - _unpinned(keep, v.name, "stored_bytes"))
                                 for v in probes.probed if v.layer_index == u.layer_index and v is not u}
        replay[group[u.name]][""] = float(_outside(stats) - _outside(keep))
    for h in probes.heads:  # what the model holds with the head recomputed, under GC: kept, it held its
        # saves and its weight copies (which a recomputed head casts again)
        stats = probes.probe({h.name: RECOMPUTE})
        held[h.name] = max(_total(stats) - _total(whole) + _unpinned(whole, h.name, "stored_bytes")
                           + whole.units[h.name].copy_bytes, 0)
    return held, replay


def _check_every_unit_ran(runtime: Runtime, times: dict[str, float]) -> None:
    """Whether every unit ran in some probe: one that never did is a unit map that does not fit the model."""
    never = [n for n, t in times.items() if t == math.inf]
    if never:  # a unit map that names modules the model does not call in its training forward
        blocks = sorted({type(u.block).__name__ for u in runtime.units if u.name in never and u.block is not None})
        raise ValueError(f"hilore-verl: units {', '.join(never[:6])}{' ...' if len(never) > 6 else ''} never ran in "
                         f"the training forward: the unit map of {', '.join(blocks) or 'the head'} names modules "
                         "this model does not call (see hilore_verl/model/unit_maps.py)")


def _unit_profiles(probes: _Probes, stats: _ProbeStats, element_size: int) -> list[UnitProfile]:
    """Per unit, its group's saved bytes and compressible share (probes 2 and 3), held bytes and replay (4)."""
    group = probes.group
    first = next(iter(stats.keeps.values()), stats.whole)
    # group -> (saved bytes, compressible share, weight copies, element size), from the probed layers and the head
    figures = {}
    for u in probes.probed + probes.heads:
        keep = stats.keeps.get(u.layer_index, first)
        saved, stored8 = _unpinned(keep, u.name, "saved_bytes"), _unpinned(stats.int8, u.name, "stored_bytes")
        elements = keep.units[u.name].saved_elements
        size = keep.units[u.name].saved_bytes / elements if elements else float(element_size)
        r8 = payload_ratio("int8", size)
        figures[group[u.name]] = (saved, min(max((1 - stored8 / saved) / (1 - r8), 0.0), 1.0) if saved else 1.0,
                                  float(keep.units[u.name].copy_bytes), size)
    return [UnitProfile(u.name, figures[group[u.name]][0], stats.held[group[u.name]], probes.times[u.name],
                        figures[group[u.name]][1], replay=dict(stats.replay.get(group[u.name], {})),
                        fixed_bytes=figures[group[u.name]][2], element_size=figures[group[u.name]][3])
            for u in probes.runtime.units]


def _held_all_kept(probes: _Probes, whole: RuntimeStats, keeps: dict[int, RuntimeStats]) -> int:
    """The total held at the end of the forward with every layer kept (probes 1 and 2, at one size)."""
    # every layer kept = GC's plan + its probed layer's difference
    return _total(whole) + sum(n * (_total(keeps[layer]) - _total(whole)) for layer, n in probes.probed_layers.items())


def _growth_shares(probes: _Probes, stats: _ProbeStats, units: list[UnitProfile], unmanaged: float, r: float,
                   quadratic: bool, r_head: float) -> float:
    """Probe 5: each unit's quadratic and fixed shares (set on `units`); the unmanaged bytes' quadratic share.
    `r`: the small probe's tokens over the probe's; `r_head`: the same for the head's rows (units outside
    the layers)."""
    group, runtime = probes.group, probes.runtime
    small_first = next(iter(stats.small_keeps.values()), stats.small_whole)
    saved_small = {group[u.name]: _unpinned(stats.small_keeps.get(u.layer_index, small_first), u.name, "saved_bytes")
                   for u in probes.probed + probes.heads}
    # the fixed share per group, from the same probes at both sizes (their fastest, and their spread as noise)
    sized = [group_times({u.name: group[u.name] for u in units}, probes.runs[size]) for size in (True, False)]
    grows = quadratic_share if quadratic else (lambda *_: 0.0)
    kind = {u.name: u.kind for u in runtime.units}
    for u in units:
        # only attention over a packed row grows with tokens squared: in any other unit a figure that
        # grew faster than the tokens is the two probes' different sequences (e.g. the head's share
        # of response tokens), not growth, and a k^2 term would scale it up many times
        q = grows if kind[u.name] in QUADRATIC_KINDS else (lambda *_: 0.0)
        u.saved_quadratic = q(saved_small[group[u.name]], u.saved_bytes, r)
        u.forward_quadratic = q(probes.small_times[u.name], u.forward_s, r)
        (t1, noise1), (t2, noise2) = (by_group[group[u.name]] for by_group in sized)
        ru = r if in_layers(u.name) else r_head
        u.forward_fixed = 0.0 if u.forward_quadratic else fixed_share(t1, t2, ru, noise1 + noise2)
    unmanaged_small = max(_held_all_kept(probes, stats.small_whole, stats.small_keeps)
                          - sum(saved_small[group[u.name]] for u in runtime.units), 0.0)
    return grows(unmanaged_small, unmanaged, r)


def _region_saving(probes: _Probes, whole: RuntimeStats, units: list[UnitProfile], tokens: int, unmanaged: float,
                   element_size: int) -> float:
    """Bytes a layer recomputed as one region holds less than its units' figures add up to (probe 1)."""
    runtime, gc_plan = probes.runtime, probes.gc_plan
    if not (probes.probed_layers and runtime.whole_blocks(gc_plan)):
        return 0.0
    # GC's plan = the units' figures minus a region saving per layer
    table = CostTable(units, tokens, unmanaged, element_size)
    gc_costs = {u.name: RECOMPUTE if u.name in gc_plan else KEEP for u in units}
    return max((table.held(gc_costs, tokens) + unmanaged - _total(whole)) / runtime.whole_blocks(gc_plan), 0.0)
