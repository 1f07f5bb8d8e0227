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

    keep        memory S_u + W_u                          time 0
    recompute   memory H_u                                time F_u             transient S_u in its backward
    fmt         memory S_u (c_u r_fmt + 1 - c_u) + W_u    time 2 S_u / codec_bw    r_fmt = codes + scales + flags per byte
    fmt+offload memory S_u (1 - c_u) + W_u                time 2 S_u / codec_bw + 2 S_u c_u r_fmt / host_bw

W_u (not scaled): the low-precision weight copies the unit's calls save under autocast, held as they
are unless the unit recomputes (its re-run casts again).

What a unit keeps exact in every mode (its pinned bytes: a standalone call's inputs, made before it)
is fixed memory, no option of the unit: the profile counts it with the unmanaged bytes.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable, Sequence

from hilore_verl.kernels import FORMATS, payload_ratio
from hilore_verl.planner.solver import Option
from hilore_verl.runtime.plan import KEEP, RECOMPUTE, Mode, UnitPlan


class Tokens(int):
    """A micro-batch's size: the tokens its layers compute, carrying `head`, the rows its head's log-prob
    code computes where the host says they are fewer (log-probs of the response tokens only; None:
    every token). Arithmetic on it gives a plain int, whose head rows are taken at the probe's share."""

    head: int | None

    def __new__(cls, tokens: int, head: int | None = None):
        made = super().__new__(cls, tokens)
        made.head = None if head is None else int(head)
        return made

    def __repr__(self) -> str:
        return f"Tokens({int(self)}, head={self.head})"

    __str__ = int.__repr__  # printed as the count it is


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
    element_size: float = 0.0
    """Its saves' bytes per element, which a codec's payload follows (the head's fp32 log-softmax: 4;
    0: the table's `element_size`)."""
    fixed_bytes: float = 0.0
    """What it holds beside its saves while kept or compressed, whatever the tokens: the low-precision
    weight copies its calls save (autocast's casts), which its re-run makes again when recomputed."""


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
    transient_bytes: float = 0.0
    """What the backward of a pass under GC's plan allocates at once beyond what its forward left held
    (its working memory, what a recomputed layer regenerates), measured at the probe from the
    allocator's events (measure/allocations.py); grows as the units' saved bytes grow. 0: not measured,
    and the reserve is the largest unit's saved bytes."""
    transient_fixed: float = 0.0
    """Share of transient_bytes that does not grow with tokens (low-precision weight copies), measured
    against the small probe."""
    forward_transient_bytes: float = 0.0
    """The same for the forward: the most it allocates beyond what it leaves held (the head's logits and
    log-softmax), measured with transient_bytes. A micro-batch peaks in whichever phase reaches higher:
    the two grow differently (0: not measured, the backward's figure stands for both)."""
    forward_transient_fixed: float = 0.0
    """Share of forward_transient_bytes that does not grow with tokens."""
    head_transient_bytes: float = 0.0
    """The backward's transient while the head's backward runs, before the layers' (planner/transient.py):
    it follows the head's rows, not the layers' tokens, so a phase's transient is the larger of its
    layers' part (transient_bytes, forward_transient_bytes) and its head's. The head's part is the
    larger of two ops' figures: this one, the op that reached highest at the probe, and the `steep`
    one, the op whose figure grows most (a weight gradient's fixed copy tops a small probe, the
    logits' gradient a large micro-batch). 0: not told apart (the layers' figures are the phases')."""
    head_transient_fixed: float = 0.0
    """Share of head_transient_bytes that does not grow with the head's rows."""
    head_transient_steep_bytes: float = 0.0
    head_transient_steep_fixed: float = 0.0
    head_forward_transient_bytes: float = 0.0
    """The same for the forward once the layers have run (the head's logits and log-softmax)."""
    head_forward_transient_fixed: float = 0.0
    head_forward_transient_steep_bytes: float = 0.0
    head_forward_transient_steep_fixed: float = 0.0
    head_forward_base_bytes: float = 0.0
    """Of the forward's head part, the level its ops start from (lm_head's logits): grows with the layers'
    tokens, the ops above it (head_forward_transient_*) with the head's rows. 0: not told apart."""
    head_forward_base_fixed: float = 0.0
    codec_transient: float = 0.0
    """Bytes the codec allocates at once beyond its payload and output, per element it quantizes or
    dequantizes, up to `codec_transient_cap` (planner/bandwidth.codec_working_memory, on a sample at
    least a chunk of the codecs that work in chunks): GC's plan, on which the transients are measured,
    compresses nothing, so a plan that does holds this much more while a compressed unit's saves are
    quantized (forward) and restored (backward), priced on the largest unit's saves."""
    codec_transient_cap: float = 0.0
    gradients_at_peak: float = 1.0
    """Share of the gradients a pass that starts without them (the first micro-batch after zero_grad)
    has allocated when its transient peaks (measured with transient_bytes; 1: not measured)."""
    head_rows: int = 0
    """The probe's rows of the head's log-prob code, where the host said they are fewer than its tokens
    (0: every token): the units outside the layers scale with those rows (`scale`)."""
    keep_pass_s: float = 0.0
    """One forward + backward of the probe with every unit kept, hands-off: the fastest measured pass under
    GC's plan less the table's own price of that plan's recompute (`seconds`), so that the whole pass, its
    backward and the parts outside units included, is measured rather than estimated. 0: not measured."""

    def scale(self, tokens: int, unit: UnitProfile | None = None) -> float:
        """k: `tokens` over the probe's; for a unit outside the layers (the head), its rows over the probe's
        where both are known (`Tokens.head`, `head_rows`): the head of a host that takes log-probs of the
        response tokens only follows them, not the prompts."""
        return self.head_growth(tokens) if unit is not None and not in_layers(unit.name) else tokens / self.tokens

    def grow(self, value: float, quadratic: float, tokens: int, fixed: float = 0.0,
             unit: UnitProfile | None = None) -> float:
        """A figure (of `unit`) measured at the probe's tokens, at `tokens`: its quadratic share grows with
        k^2, its fixed share not at all, the rest with k (`scale`)."""
        k = self.scale(tokens, unit)
        return value * (fixed + (1 - fixed - quadratic) * k + quadratic * k * k)

    def saved(self, unit: UnitProfile, tokens: int) -> float:
        """A unit's saved bytes at `tokens`."""
        return self.grow(unit.saved_bytes, unit.saved_quadratic, tokens, unit=unit)

    def forward(self, unit: UnitProfile, tokens: int) -> float:
        """A unit's forward time at `tokens` (what recomputing it costs)."""
        return self.grow(unit.forward_s, unit.forward_quadratic, tokens, unit.forward_fixed, unit)

    def seconds(self, plan: dict[str, UnitPlan], tokens: int) -> float:
        """What `plan` adds to a pass with every unit kept at `tokens`: recompute, codecs, copies."""
        return sum(next(o.time for o in self.options(u, tokens) if o.plan == plan[u.name]) for u in self.units)

    def pass_seconds(self, plan: dict[str, UnitPlan], tokens: int) -> float:
        """One forward + backward under `plan` at `tokens`, run hands-off: the measured kept pass grown as
        the units' forward time grows (or, not measured, every unit's forward x 3: backward at twice the
        forward), plus what the plan adds (`seconds`)."""
        forward = sum(self.forward(u, tokens) for u in self.units)
        if self.keep_pass_s > 0:
            kept = self.keep_pass_s * forward / max(sum(self.forward(u, self.tokens) for u in self.units), 1e-30)
        else:
            kept = 3 * forward
        return kept + self.seconds(plan, tokens)

    def unmanaged(self, tokens: int) -> float:
        return self.grow(self.unmanaged_bytes, self.unmanaged_quadratic, tokens)

    def options(self, unit: UnitProfile, tokens: int,
                risk: Callable[[str, UnitPlan], float] | None = None) -> list[Option]:
        """keep, recompute, then each format (and its offloaded variant when enabled), at the table's group size."""
        S = self.saved(unit, tokens)
        H = unit.held_bytes * self.scale(tokens, unit)  # its own inputs; its layer's region: `held`
        F = self.forward(unit, tokens)
        W = unit.fixed_bytes  # weight copies: held as they are unless it recomputes
        opts = [Option(KEEP, S + W, 0.0), Option(RECOMPUTE, H, F)]
        if S > 0:
            for fmt in self.formats:
                plan = UnitPlan(Mode.COMPRESS, fmt=fmt, group_size=self.group_size)
                r = risk(unit.name, plan) if risk else math.inf  # no risk model: lossy is never free
                c = unit.compressible
                codes = S * c * self.payload(unit, fmt, self.group_size)
                exact = S * (1 - c)  # kept exact on the device (e.g. -inf masks), offloaded or not
                codec_s = 2 * S / self.codec_bytes_per_s
                opts.append(Option(plan, codes + exact + W, codec_s, r))
                if self.offload:  # offload does not change the error
                    opts.append(Option(dataclasses.replace(plan, offload=True), exact + W,
                                       codec_s + 2 * codes / self.host_bytes_per_s, r))
        return opts

    def held(self, plan: dict[str, UnitPlan], tokens: int) -> float:
        """Bytes the plan's units hold at the end of the forward. A layer with recomputed units R is one
        region: each holds its own inputs, and the layer holds what the re-run replays, once each: a
        kept or compressed unit v's outputs if some u in R needed them alone (replay[v], the largest
        over R; a replayed call's output is held or not, whatever needs it; a recomputed v replays
        nothing), compressed as v's plan compresses, and the region's inputs (replay[""]). Whole
        recomputed layers hold less still (`region_saving_bytes`, the caller's)."""
        held, regions = self.held_by_layer(plan, tokens)
        return held + sum(regions.values())

    def held_by_layer(self, plan: dict[str, UnitPlan], tokens: int) -> tuple[float, dict[str, float]]:
        """`held` in two parts: what the units' options hold (a recomputed unit: its own inputs), and per
        layer with recomputed units what it holds more as one region (`region_bytes`)."""
        k, held = self.scale(tokens), 0.0
        share: dict[str, float] = {}  # unit -> what its plan holds of its saves, per saved byte
        layers: dict[str, list[UnitProfile]] = {}
        for unit in self.units:
            choice = plan.get(unit.name, KEEP)
            layers.setdefault(layer_of(unit.name), []).append(unit)
            if choice == RECOMPUTE:
                held += unit.held_bytes * self.scale(tokens, unit)
                continue
            options = {o.plan: o for o in self.options(unit, tokens)}
            option = options.get(choice, options[KEEP])  # a unit with nothing saved has no lossy option
            held += option.memory
            share[unit.name] = self.stored_share(unit, choice, options[KEEP].memory, option.memory)
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

    def stored_share(self, unit: UnitProfile, choice: UnitPlan, kept: float, memory: float) -> float:
        """What a unit's plan holds of a byte it keeps: its option's share of its saved bytes (`kept`,
        `memory`: its keep option's and its plan's option's memory, weight copies included), or for a
        unit that saves nothing itself (its outputs are held only for a re-run) the format's payload ratio."""
        kept, memory = kept - unit.fixed_bytes, memory - unit.fixed_bytes
        if kept > 0:
            return memory / kept
        if choice.exact:
            return 1.0
        return (1 - unit.compressible) + (0.0 if choice.offload else unit.compressible * self.payload(
            unit, choice.fmt, choice.group_size))

    def payload(self, unit: UnitProfile, fmt: str, group_size: int) -> float:
        """Payload bytes per byte of `unit`'s saves in `fmt` (codes and scales follow the elements)."""
        return payload_ratio(fmt, unit.element_size or self.element_size, group_size)

    def transient(self, tokens: int) -> float:
        """Reserve for what the backward allocates at once beyond what the forward held: the larger of the
        layers' measured `transient_bytes` grown as the units' saved bytes grow (`_grown`) and the head's
        part (`_head_part`), or unmeasured, the largest unit's saved bytes (what backward regenerates
        or dequantizes at once)."""
        if self.transient_bytes > 0 or self.head_transient_bytes > 0:
            return max(self._grown(self.transient_bytes, self.transient_fixed, tokens),
                       self._head_part("head_transient", tokens))
        return max((self.saved(u, tokens) for u in self.units), default=0.0)

    def backward_transient(self, plan: dict[str, UnitPlan], tokens: int) -> float:
        """`transient` for `plan`. The probe's backward (under GC's plan) regenerated a recomputed layer's
        activations at once; a plan that recomputes less of its largest layer regenerates that much less
        (`regenerated`, in the layers' part). GC's plan keeps the head; a head that compresses or
        recomputes makes its saves again for its backward, on top of the head's part (an upper bound: its
        backward's ops need some of them at a time). Unmeasured, `transient` as it is."""
        if self.transient_bytes <= 0 and self.head_transient_bytes <= 0:
            return self.transient(tokens)
        layers = self._grown(self.transient_bytes, self.transient_fixed, tokens)
        layers = max(layers - self.regenerated(None, tokens) + self.regenerated(plan, tokens), 0.0)
        remade = sum(self.saved(u, tokens) for u in self.units if not in_layers(u.name) and plan.get(u.name, KEEP) != KEEP)
        return max(layers + self._codec(plan, tokens, True),
                   self._head_part("head_transient", tokens) + remade + self._codec(plan, tokens, False))

    def regenerated(self, plan: dict[str, UnitPlan] | None, tokens: int) -> float:
        """The most saved bytes one decoder layer's recomputed units make again in backward under `plan`
        (None: GC's, every unit of the layers recomputed)."""
        per_layer: dict[str, float] = {}
        for u in self.units:
            if in_layers(u.name) and (plan is None or plan.get(u.name, KEEP) == RECOMPUTE):
                per_layer[layer_of(u.name)] = per_layer.get(layer_of(u.name), 0.0) + self.saved(u, tokens)
        return max(per_layer.values(), default=0.0)

    def forward_transient(self, tokens: int, plan: dict[str, UnitPlan] | None = None) -> float:
        """The same for the forward (`forward_transient_bytes`, `head_forward_transient_*`); 0 where not
        measured. Measured under GC's plan, which keeps the head and recomputes the layers; for `plan`:
        - the layers' weight copies (autocast's casts, units' `fixed_bytes`) live through GC's forward
          in autocast's cache, held by no save; the copies of layer units `plan` does not recompute
          are held (`held` counts them), so they are not counted twice;
        - a head that does not keep holds less than GC's at the forward's end, but its saves exist as
          GC's do until its call ends (a compressed save is quantized there): what it holds less is
          added to the head's part (an upper bound)."""
        layers = self._grown(self.forward_transient_bytes, self.forward_transient_fixed, tokens)
        head = (self._grown(self.head_forward_base_bytes, self.head_forward_base_fixed, tokens)
                + self._head_part("head_forward_transient", tokens))
        if plan is None:
            return max(layers, head)
        copies = sum(u.fixed_bytes for u in self.units if in_layers(u.name) and plan.get(u.name, KEEP) != RECOMPUTE)
        unheld = sum(self._held_less(u, plan.get(u.name, KEEP), tokens) for u in self.units if not in_layers(u.name))
        return max(layers - copies + self._codec(plan, tokens, True),
                   head - copies + unheld + self._codec(plan, tokens, False), 0.0)

    def _codec(self, plan: dict[str, UnitPlan], tokens: int, layers: bool) -> float:
        """The codec's working memory for the largest saves `plan` compresses in the layers (or outside them)."""
        elements = max((self.saved(u, tokens) / (u.element_size or self.element_size) for u in self.units
                        if in_layers(u.name) == layers and plan.get(u.name, KEEP).mode == Mode.COMPRESS), default=0.0)
        return min(self.codec_transient * elements, self.codec_transient_cap)

    def transient_charge(self, unit: UnitProfile, choice: UnitPlan, tokens: int) -> float:
        """What `choice` for `unit` adds to the phases' transients (`forward_transient`, `backward_transient`)
        beyond its option's memory: for a head that does not keep, the larger of what it holds less
        (its saves exist until its call ends) and its saves (its backward makes them again); 0 in the
        layers. The solver prices it with the option, so that it does not choose a head whose saving the
        transients take back."""
        if in_layers(unit.name) or choice == KEEP:
            return 0.0
        return max(self._held_less(unit, choice, tokens), self.saved(unit, tokens))

    def _held_less(self, unit: UnitProfile, choice: UnitPlan, tokens: int) -> float:
        """What `unit` holds less under `choice` than kept."""
        if choice == KEEP:
            return 0.0
        options = {o.plan: o for o in self.options(unit, tokens)}
        return options[KEEP].memory - options.get(choice, options[KEEP]).memory

    def growth(self, tokens: int) -> float:
        """How the layers' saved bytes grow together from the probe to `tokens` (with their quadratic
        shares): what a transient's share that follows the layers' tokens grows by."""
        layers = [u for u in self.units if in_layers(u.name)]
        saved = sum(u.saved_bytes for u in layers)
        return sum(self.saved(u, tokens) for u in layers) / saved if saved > 0 else self.scale(tokens)

    def head_growth(self, tokens: int) -> float:
        """How the head's rows grow from the probe to `tokens` (`scale` of a unit outside the layers)."""
        rows = getattr(tokens, "head", None)  # a plain count carries none
        return rows / self.head_rows if rows is not None and self.head_rows > 0 else tokens / self.tokens

    def _grown(self, value: float, fixed: float, tokens: int) -> float:
        """A transient measured at the probe, at `tokens`: its share `fixed` as it is, the rest by `growth`."""
        return value * (fixed + (1 - fixed) * self.growth(tokens))

    def _head_part(self, name: str, tokens: int) -> float:
        """The head's part of a phase's transient (`name`: its fields' stem) at `tokens`: the larger of its
        two ops' figures, each grown by the head's rows."""
        g = self.head_growth(tokens)
        return max(getattr(self, f"{name}{part}_bytes") * (fixed + (1 - fixed) * g)
                   for part in ("", "_steep") for fixed in (getattr(self, f"{name}{part}_fixed"),))


def in_layers(name: str) -> bool:
    """Whether unit `name` belongs to a decoder layer (else it lies outside them: the head)."""
    return name.startswith("layers.")


def layer_of(name: str) -> str:
    return name.split(".")[1] if in_layers(name) else name


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
