"""Cost model: per unit and option, bytes held until backward and extra time, scaled by tokens.

Measured by `profile` on a probe micro-batch (what each unit's saved tensors take, what a
recomputed unit must still hold, each unit's forward time, codec and host-copy throughput), then
scaled by token count: with k = tokens / probe tokens, a figure f measured on the probe becomes
f ((1 - q) k + q k^2), where q is the share of it found to grow with tokens squared by a second,
smaller probe (a dense attention mask over a packed row, attention's time; 0 on varlen attention).
A forward time may instead have a fixed share a (per-call overhead: a GPU's launches, which bound a
small probe), F (a + (1 - a) k), so that the probe's overhead is not scaled up with the tokens.
Codec and host-copy bandwidths are fitted as t = t0 + bytes / bw at sizes of the probe's largest
unit (at least 64 MiB on a GPU), the copies as the offload makes them (pinned, on a side stream).
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
from hilore_verl.timing import DeviceClock, fit_bandwidth

@dataclass
class UnitProfile:
    name: str
    saved_bytes: float  # what the unit's saved tensors take (keep)
    held_bytes: float  # what the unit itself holds when recomputed, its layer's other units kept (its inputs)
    forward_s: float  # the unit's own forward time (children of other units excluded)
    compressible: float = 1.0  # share of saved bytes a codec can take (the rest, e.g. -inf masks, stays exact)
    replay: dict[str, float] = dataclasses.field(default_factory=dict)
    """What its layer holds more when it alone is recomputed (the layer is then one region), by the unit
    of the layer that holds it (its name past "layers.<i>."; "" for outside every unit, the region's
    inputs): the outputs of kept calls the re-run replays."""
    saved_quadratic: float = 0.0  # share of saved_bytes that grows with tokens squared (a dense mask over a packed row)
    forward_quadratic: float = 0.0  # the same for forward_s (attention over a packed row)
    forward_fixed: float = 0.0  # share of forward_s that does not grow with tokens (per-call overhead, launches)


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
    runtime_overhead_s: float = 0.0
    """Per micro-batch: what running a plan through the runtime's hooks costs over the same exact plan run
    hands-off (HF checkpointing), measured at the probe; priced as fixed (it follows the saved-tensor count)."""

    def scale(self, tokens: int) -> float:
        return tokens / self.tokens

    def grow(self, value: float, quadratic: float, tokens: int, fixed: float = 0.0) -> float:
        """A figure measured at the probe's tokens, at `tokens`: its quadratic share grows with k^2, its
        fixed share not at all, the rest with k."""
        k = tokens / self.tokens
        return value * (fixed + (1 - fixed - quadratic) * k + quadratic * k * k)

    def forward(self, unit: UnitProfile, tokens: int) -> float:
        """A unit's forward time at `tokens` (what recomputing it costs)."""
        return self.grow(unit.forward_s, unit.forward_quadratic, tokens, unit.forward_fixed)

    def unmanaged(self, tokens: int) -> float:
        return self.grow(self.unmanaged_bytes, self.unmanaged_quadratic, tokens)

    def options(self, unit: UnitProfile, tokens: int, risk: Callable[[str, str], float] | None = None) -> list[Option]:
        """keep, recompute, then each format (and its offloaded variant when enabled)."""
        S = self.grow(unit.saved_bytes, unit.saved_quadratic, tokens)
        H = unit.held_bytes * self.scale(tokens)  # its own inputs; its layer's region: `held`
        F = self.forward(unit, tokens)
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

    def held(self, plan: dict[str, str], tokens: int) -> float:
        """Bytes the plan's units hold at the end of the forward. A layer with recomputed units R is one
        region: each holds its own inputs, and the layer holds what the re-run replays, once each: a
        kept or compressed unit v's outputs if some u in R needed them alone (replay[v], the largest
        over R; a replayed call's output is held or not, whatever needs it; a recomputed v replays
        nothing), compressed as v's plan compresses, and the region's inputs (replay[""]). Whole
        recomputed layers hold less still (`region_saving_bytes`, the caller's)."""
        held, regions = self.held_by_layer(plan, tokens)
        return held + sum(regions.values())

    def held_by_layer(self, plan: dict[str, str], tokens: int) -> tuple[float, dict[str, float]]:
        """`held` in two parts: what the units' options hold (a recomputed unit: its own inputs), and per
        layer with recomputed units what it holds more as one region (`region_bytes`)."""
        k, held = self.scale(tokens), 0.0
        share: dict[str, float] = {}  # unit -> what its plan holds of its saves, per saved byte
        layers: dict[str, list[UnitProfile]] = {}
        for unit in self.units:
            choice = plan.get(unit.name, "keep")
            layers.setdefault(layer_of(unit.name), []).append(unit)
            if choice == "recompute":
                held += unit.held_bytes * k
                continue
            options = {o.name: o for o in self.options(unit, tokens)}
            option = options.get(choice, options["keep"])  # a unit with nothing saved has no lossy option
            held += option.memory
            share[unit.name] = self.stored_share(unit, choice, options["keep"].memory, option.memory)
        return held, {layer: self.region_bytes(members, share, k) for layer, members in layers.items()
                      if any(u.name not in share for u in members)}

    def region_bytes(self, members: list[UnitProfile], share: dict[str, float], k: float) -> float:
        """What a layer with recomputed units (those of `members` not in `share`, the others' plans holding
        `share` of each byte they keep) holds more as one region, at token scale k: per holder v (a
        unit of the layer that is not recomputed), the outputs the re-run replays, if some recomputed u
        needed them alone (replay[v], the largest over them; held or not, whatever needs it), as v's
        plan holds them; and the region's inputs (replay[""]): the unit whose own recompute exposed
        them most (their first saver) holds them otherwise, aliased when it keeps, but exact beside its
        payload when it compresses."""
        recomputed = [u for u in members if u.name not in share]
        if not recomputed:
            return 0.0
        layer = layer_of(members[0].name)
        held = 0.0
        for part in {p for u in recomputed for p in u.replay if p}:
            holder = f"layers.{layer}.{part}"
            if holder in share:
                held += max(u.replay.get(part, 0.0) for u in recomputed) * share[holder]
        inputs = max(u.replay.get("", 0.0) for u in recomputed)
        owner = max(members, key=lambda u: u.replay.get("", 0.0))
        if owner.name in share:  # the inputs' first saver is not recomputed: aliased by what it stores
            inputs = max(inputs, owner.replay.get("", 0.0) * (1.0 - share[owner.name]))
        return (held + inputs) * k

    def stored_share(self, unit: UnitProfile, choice: str, kept: float, memory: float) -> float:
        """What a unit's plan holds of a byte it keeps: its option's share of its saved bytes, or for a unit
        that saves nothing itself (its outputs are held only for a re-run) the format's payload ratio."""
        if kept > 0:
            return memory / kept
        fmt, _, offload = choice.partition("+")
        if fmt not in FORMATS:
            return 1.0
        return (1 - unit.compressible) + (0.0 if offload else unit.compressible * payload_ratio(
            fmt, self.element_size, self.group_size))

    def transient(self, tokens: int) -> float:
        """Reserve for what backward regenerates or dequantizes at once: the largest unit's saved bytes."""
        return max((self.grow(u.saved_bytes, u.saved_quadratic, tokens) for u in self.units), default=0.0)


def layer_of(name: str) -> str:
    return name.split(".")[1] if name.startswith("layers.") else name


def _float_fields(obj) -> list[str]:
    return [f.name for f in dataclasses.fields(obj) if f.type in ("float", float)]


def measured_values(costs: CostTable) -> list[float]:
    """Every measured number of a table in a fixed order (each unit's float fields and replay bytes, then
    the table's): what ranks average so that they plan from the same numbers. A new float field is included."""
    values = []
    for u in costs.units:
        values += [getattr(u, n) for n in _float_fields(u)] + [u.replay[p] for p in sorted(u.replay)]
    return values + [getattr(costs, n) for n in _float_fields(costs)]


def set_measured_values(costs: CostTable, values) -> None:
    """The inverse of `measured_values`."""
    it = iter(values)
    for u in costs.units:
        for n in _float_fields(u):
            setattr(u, n, float(next(it)))
        u.replay = {p: float(next(it)) for p in sorted(u.replay)}
    for n in _float_fields(costs):
        setattr(costs, n, float(next(it)))


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


SAMPLE_MIN_BYTES = 64 * 2**20  # off the CPU: smaller calls are launch-bound, their fit ill-conditioned
SAMPLE_MAX_BYTES = 512 * 2**20
CPU_SAMPLE_ELEMENTS = 1024 * 1024  # the CPU is bandwidth-bound at a few MiB: keep its probe cheap
REPEATS = 3


def _parts(clock: DeviceClock) -> int:
    """How `fit_bandwidth` splits the sample: a quarter off the CPU; on the CPU, where a call's fixed
    time is small against a few MiB and two sizes' difference is mostly noise, one size (parts 1)."""
    return 1 if clock.device.type == "cpu" else 4


def sample_bytes(device: torch.device, largest: float, element_size: int) -> int:
    """Size of the codec and host-copy samples: on the CPU a fixed 1M elements; elsewhere the probe's
    `largest` unit's saved bytes, at least SAMPLE_MIN_BYTES, at most SAMPLE_MAX_BYTES and an eighth of
    the device's free memory (the codec's output and the copies' buffers come on top). A whole number
    of 4 rows of 1024 elements (the fit's smaller size is a quarter)."""
    row = 4 * 1024 * element_size
    if device.type == "cpu":
        return CPU_SAMPLE_ELEMENTS * element_size
    module = torch.get_device_module(device.type)
    free = module.mem_get_info(device)[0] if hasattr(module, "mem_get_info") else 8 * SAMPLE_MAX_BYTES
    return max(int(min(max(largest, SAMPLE_MIN_BYTES), SAMPLE_MAX_BYTES, free // 8)) // row, 1) * row


def codec_bandwidth(clock: DeviceClock, sample: torch.Tensor) -> float:
    """Activation bytes per second of quantize + dequantize (int8), counted twice (the table prices a
    unit's codec time as 2 S / codec_bytes_per_s): the slope of `fit_bandwidth` over `sample` and its
    first quarter, so that a call's launch overhead is not read as low bandwidth (on the CPU: the
    sample's throughput)."""
    row = sample[0].numel() * sample.element_size()

    def seconds(nbytes: int) -> float:
        part = sample[: nbytes // row]
        return clock.time(lambda: quantize(part, "int8", 64).dequantize(), REPEATS)

    return 2 * fit_bandwidth(seconds, sample.numel() * sample.element_size(), _parts(clock))[0]


def host_buffer(like: torch.Tensor, pinned: bool) -> torch.Tensor:
    return torch.empty(like.shape, dtype=like.dtype, pin_memory=pinned)


def host_bandwidth(clock: DeviceClock, sample: torch.Tensor) -> float:
    """Bytes per second one way between the device and the host, as the runtime's offload copies
    (runtime/offload.py): into a pinned host buffer and back, non-blocking on a side stream, timed by
    events on that stream; on the CPU synchronous copies (the offload's path there). The slope of
    `fit_bandwidth` over the round trip of `sample` and of its first quarter (on the CPU: the
    sample's throughput)."""
    side = clock.module.Stream() if clock.events else None
    host, back = host_buffer(sample, pinned=clock.events), torch.empty_like(sample)
    flat = [t.view(-1) for t in (sample, host, back)]

    def seconds(nbytes: int) -> float:
        src, buf, dst = (t[: nbytes // sample.element_size()] for t in flat)

        def trip():
            buf.copy_(src, non_blocking=clock.events)  # forward: to the host
            dst.copy_(buf, non_blocking=clock.events)  # backward: back to the device

        return clock.time(trip, REPEATS, stream=side)

    return 2 * fit_bandwidth(seconds, sample.numel() * sample.element_size(), _parts(clock))[0]


def _unpinned(stats: RuntimeStats, unit: str, figure: str) -> int:
    """A unit's saved or stored bytes less its pinned ones (kept exact in every mode: fixed memory,
    which `profile` counts with the unmanaged bytes instead of in any option of the unit)."""
    return getattr(stats.units[unit], figure) - stats.units[unit].pinned_bytes


def _total(stats: RuntimeStats) -> int:
    """Everything a probe's forward left held: units' stored bytes, unmanaged and index tensors."""
    return stats.stored_bytes + stats.unmanaged_bytes + stats.unmanaged_held_bytes + stats.index_bytes


def _outside(stats: RuntimeStats) -> int:
    """What a probe's forward left held outside every unit."""
    return stats.unmanaged_bytes + stats.unmanaged_held_bytes + stats.index_bytes


def quadratic_share(small: float, large: float, r: float) -> float:
    """Share q of a figure at the larger probe that grows with tokens squared, from the figure at both
    probes (`r` = small tokens / large tokens): small / large = (1 - q) r + q r^2, q clipped to [0, 1]
    (a fixed part, e.g. per-call overhead, reads as q < 0: `fixed_share` prices it)."""
    if large <= 0 or not 0 < r < 1:
        return 0.0
    return min(max((r - small / large) / (r - r * r), 0.0), 1.0)


def fixed_share(small: float, large: float, r: float, noise: float = 0.0) -> float:
    """Share a of a figure at the larger probe that does not grow with tokens (per-call overhead: a
    GPU's launches, or the host's module calls, which bound a small probe), from the figure at both
    probes: small / large = a + (1 - a) r, where the figure grew less than linearly (r < small /
    large) by more than `noise` (the ratio's relative uncertainty). A figure that did not grow at all
    (small / large >= 1) is all fixed: a = 1. Otherwise 0, priced linearly as without a second
    probe: growth at least linear is the quadratic share's, and growth that noise cannot tell from
    linear is not measured. (Pricing a fixed cost linearly would scale a tiny probe's call overhead
    with the tokens of a micro-batch many times its size.)"""
    if large <= 0 or not 0 < r < 1:
        return 0.0
    ratio = small / large
    if not r < ratio * (1 - noise):
        return 0.0
    return min((ratio - r) / (1 - r), 1.0)


def _group_times(group: dict[str, str], runs: list[dict[str, float]]) -> dict[str, tuple[float, float]]:
    """Per group (`group`: unit -> group), over `runs` (unit -> time, one per probe) of its units' summed
    times: (the fastest, the spread (slowest - fastest) / fastest), inf where a unit did not run."""
    totals: dict[str, list[float]] = {}
    for timed in runs:
        per: dict[str, float] = {}
        for name, g in group.items():
            per[g] = per.get(g, 0.0) + timed.get(name, math.inf)
        for g, t in per.items():
            totals.setdefault(g, []).append(t)
    out = {}
    for g, ts in totals.items():
        lo, hi = min(ts), max(ts)
        out[g] = (lo, (hi - lo) / lo if 0 < lo and math.isfinite(hi) else math.inf)
    return out


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
        4. per unit of a probed layer: recomputed, the rest of its layer kept
                                                    what a recomputed unit still holds, and what its
                                                    layer (one region) holds more for it: its inputs,
                                                    the kept calls' outputs the re-run replays
           per head unit: recomputed                what the model holds more than with it kept
        5. with `small`: 1 and 2 on the small probe the quadratic shares of saved bytes, forward
                                                    times and unmanaged bytes; per group, the fixed
                                                    share of forward times (against 1 and 2's own
                                                    times, their spread as the noise)

    Then, when the model had HF checkpointing (`runtime.checkpoint_plan()`), that plan through the runtime
    and hands-off, twice each: the runtime's overhead. Then codec and host-copy bandwidths, on samples
    the size of the largest unit's saved bytes.
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
    runs: dict[bool, list[dict[str, float]]] = {False: [], True: []}  # probes 1 and 2's unit times, by size

    def probe(extra: dict, small_probe: bool = False, pair: bool = False) -> RuntimeStats:
        runtime.set_plan({**gc_plan, **extra})
        timed = _unit_times(runtime, small[0] if small_probe else run, clock)
        best = small_times if small_probe else times
        best.update({n: min(best[n], t) for n, t in timed.items()})
        if pair or small_probe:
            runs[small_probe].append(timed)
        return runtime.stats()

    def kept(layer: int) -> dict:
        return {u.name: "keep" for u in probed if u.layer_index == layer}

    held: dict[str, float] = {}
    replay: dict[str, dict[str, float]] = {}
    try:
        whole = probe({}, pair=True)
        keeps = {layer: probe(kept(layer), pair=True) for layer in probed_layers}
        if small is not None:
            small_whole = probe({}, small_probe=True)
            small_keeps = {layer: probe(kept(layer), small_probe=True) for layer in probed_layers}
        int8 = probe({u.name: "int8" for u in probed + heads})
        for u in probed:
            stats = probe({**kept(u.layer_index), u.name: "recompute"})
            held[group[u.name]] = _unpinned(stats, u.name, "stored_bytes")
            # what its layer holds more for it, by holder: the kept calls' outputs it replays, its inputs
            keep = keeps[u.layer_index]
            # (signed: a save of the region's input that a kept unit made is counted outside units in a region)
            replay[group[u.name]] = {v.name.split(".", 2)[2]: float(_unpinned(stats, v.name, "stored_bytes")
                                                                    - _unpinned(keep, v.name, "stored_bytes"))
                                     for v in probed if v.layer_index == u.layer_index and v is not u}
            replay[group[u.name]][""] = float(_outside(stats) - _outside(keep))
        for h in heads:  # what the model holds more with the head recomputed than with it kept, under GC
            stats = probe({h.name: "recompute"})
            held[h.name] = max(_total(stats) - _total(whole) + _unpinned(whole, h.name, "stored_bytes"), 0)
        overhead = runtime_overhead(runtime, run, clock)
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
                         figures[group[u.name]][1], replay=dict(replay.get(group[u.name], {}))) for u in runtime.units]
    # totals held at the end of the forward: every layer kept = GC's plan + its probed layer's difference
    total = _total
    keep_all = lambda w, ks: total(w) + sum(n * (total(ks[layer]) - total(w))  # noqa: E731
                                            for layer, n in probed_layers.items())
    unmanaged = max(keep_all(whole, keeps) - sum(u.saved_bytes for u in units), 0.0)  # residual stream, masks, pinned
    unmanaged_q = 0.0
    if small is not None:  # how each figure grew from the small probe to this one
        r = small[1] / tokens
        small_first = next(iter(small_keeps.values()), small_whole)
        saved_small = {group[u.name]: _unpinned(small_keeps.get(u.layer_index, small_first), u.name, "saved_bytes")
                       for u in probed + heads}
        # the fixed share per group, from the same probes at both sizes (their fastest, and their spread as noise)
        sized = [_group_times({u.name: group[u.name] for u in units}, runs[size]) for size in (True, False)]
        for u in units:
            u.saved_quadratic = quadratic_share(saved_small[group[u.name]], u.saved_bytes, r)
            u.forward_quadratic = quadratic_share(small_times[u.name], u.forward_s, r)
            (t1, noise1), (t2, noise2) = (by_group[group[u.name]] for by_group in sized)
            u.forward_fixed = 0.0 if u.forward_quadratic else fixed_share(t1, t2, r, noise1 + noise2)
        unmanaged_small = max(keep_all(small_whole, small_keeps)
                              - sum(saved_small[group[u.name]] for u in runtime.units), 0.0)
        unmanaged_q = quadratic_share(unmanaged_small, unmanaged, r)
    saving = 0.0
    if probed_layers and runtime.whole_blocks(gc_plan):  # GC's plan = the units' figures minus a region saving per layer
        table = CostTable(units, tokens, unmanaged, element_size)
        gc_costs = {u.name: "recompute" if u.name in gc_plan else "keep" for u in units}
        saving = max((table.held(gc_costs, tokens) + unmanaged - total(whole)) / runtime.whole_blocks(gc_plan), 0.0)
    # the codec on the activations' dtype and device (element_size 4: fp32, else bf16), at their sizes
    dtype = torch.float32 if element_size == 4 else torch.bfloat16
    nbytes = sample_bytes(device, max((u.saved_bytes for u in units), default=0.0), dtype.itemsize)
    sample = torch.randn(nbytes // (1024 * dtype.itemsize), 1024, device=device, dtype=dtype)
    codec, host = codec_bandwidth(clock, sample), host_bandwidth(clock, sample)
    return CostTable(units, tokens, unmanaged, element_size, codec, host, region_saving_bytes=saving,
                     unmanaged_quadratic=unmanaged_q, runtime_overhead_s=overhead, **kwargs)


def runtime_overhead(runtime: Runtime, run: Callable[[], None], clock: DeviceClock) -> float:
    """Seconds a pass of HF checkpointing's plan takes through the runtime's hooks over the same plan run
    hands-off (the fastest of two each, interleaved); 0 when the model had no checkpointing to compare."""
    plan = runtime.checkpoint_plan()
    if plan is None:
        return 0.0
    best = {True: math.inf, False: math.inf}
    for _ in range(2):
        for hooked in (True, False):
            runtime.set_plan(plan, measure=hooked)
            start = clock.mark()
            run()
            best[hooked] = min(best[hooked], clock.seconds(start, clock.mark()))
    return max(best[True] - best[False], 0.0)
