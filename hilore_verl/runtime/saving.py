"""The runtime's saved-tensor hooks: how each tensor autograd saves is held until backward.

Pack: parameters (and their views or casts), non-float, nested and small tensors are kept as they
are, except that a cast of a weight made inside a recomputed call (autocast's bf16 copy) is made
again by the re-run instead of held. Everything else is handled by its producer unit's mode
(`Runtime._lookup` finds the producer; a tensor made outside every unit and saved by a unit's call
goes by the first unit that saves it, `_adopted`): KEEP holds the tensor, COMPRESS a quantized payload (per-row
statistics and non-finite tensors stay exact and are counted), RECOMPUTE a `Dropped` handle on the
producing call. Unpack: each holder checks the tensor was not changed in place since it was saved,
then hands it out (decoded or regenerated).

On an asynchronous device (CUDA) the inf / nan check of a payload is not read at pack time, which
would wait for the device once per tensor: its result is copied to the host without blocking and
the tensor is held as `Unchecked` (tensor and payload) until the copy lands; pending checks are
polled at each later compressed save, and settled, waiting, by unpack and by `Runtime.stats()`.
"""

from __future__ import annotations

import operator
from collections import deque

import torch
import torch.nn as nn

from hilore_verl.kernels import GROUP_SIZES, quantize
from hilore_verl.runtime.offload import OffloadPool
from hilore_verl.runtime.plan import Mode, UnitPlan
from hilore_verl.runtime.finite_checks import Unchecked, WaitCount
from hilore_verl.runtime.records import (Checked, Compressed, Kept, VersionWatch, geometry_of,
                                         storage_id, storage_key)

# a plan's group size, then each smaller one (`SavedTensors._quantize`), computed once: it runs per save
FINER_FIRST = {g: (g, *sorted((s for s in GROUP_SIZES if s < g), reverse=True)) for g in GROUP_SIZES}

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
KEEP_MODE, COMPRESS_MODE, RECOMPUTE_MODE = Mode.KEEP, Mode.COMPRESS, Mode.RECOMPUTE  # compared by identity in pack
# exact copies held beside their payloads while inf / nan checks are on their way to the host, at most
PENDING_EXACT_BYTES = 256 * 2**20
PAD = 128  # a statistic's token dim may be padded by less than this (SDPA's efficient kernel: to 32)


def defers_checks(device: torch.device) -> bool:
    """Whether payloads on `device` have their inf / nan check deferred (reading it would wait for
    the device); on the CPU it is read at once."""
    return device.type not in ("cpu", "meta")


class RowShapes:
    """The row shapes of the float tensors one call's code has saved so far: for a saved (..., D)
    tensor, its leading dims (without size-1 dims, in any order) and, for 3+ dims, its dims before
    the last two with the one before last (a token dim a statistic may pad)."""

    __slots__ = ("rows", "leads")

    def __init__(self):
        self.rows: set[tuple] = set()
        self.leads: dict[tuple, set[int]] = {}

    def note(self, shape: torch.Size) -> None:
        if len(shape) >= 2 and shape[-1] > 1:
            self.rows.add(tuple(sorted(d for d in shape[:-1] if d != 1)))
            if len(shape) >= 3:
                self.leads.setdefault(tuple(shape[:-2]), set()).add(shape[-2])

    def has_row_of(self, shape: torch.Size) -> bool:
        """Whether `shape` holds one value per row of a tensor noted before."""
        if tuple(sorted(d for d in shape if d != 1)) in self.rows:
            return True
        tokens = self.leads.get(tuple(shape[:-1])) if len(shape) >= 2 else None
        return tokens is not None and any(t <= shape[-1] < t + PAD for t in tokens)


def is_row_statistic(t: torch.Tensor, rows: RowShapes | None) -> bool:
    """A per-row statistic, kept exact under compression, told by what produced it: a keepdim reduction
    (last dim 1: a norm's reciprocal RMS or mean, cuDNN attention's log-sum-exp), or a non-differentiable
    output of an op of the call (autograd marks it so: it does not require grad) that holds one value per
    row of a float tensor the call took or saved (SDPA's, flash-attn's and FlexAttention's fp32
    log-sum-exp (B, H, T), padded (B, H, ceil32(T)), or (H, total) for a (total, H, D) query; a fused
    norm's (rows,) rstd). `rows` is the call's so far; `Runtime` decides an own save that is not yet
    known for one again at the call's end (`Undecided`), so the order in which an op saves its tensors
    does not matter. A group of such values mixes unrelated rows: one outlier (a padding token's
    1 / sqrt(eps)) would spoil its whole group, and the softmax backward exponentiates the log-sum-exp's
    error. At most 1 / D of the tensor it describes, so the rule costs little memory where it errs."""
    shape = t.shape
    if len(shape) == 0:
        return False
    return shape[-1] == 1 or (not t.requires_grad and rows is not None and rows.has_row_of(shape))


class Undecided:
    """An own save of a compressed unit's call that may yet prove to be a per-row statistic (it does not
    require grad, and no tensor of its rows was seen yet: an op that saves its log-sum-exp before the
    query it describes). Held exact until the call ends, when `Runtime` decides with every row of the
    call known (`_decide`): kept exact and counted as a statistic, or compressed as the plan says. Never
    decided (a call cut short by an error): the exact tensor."""

    __slots__ = ("kept", "watch", "held", "key")

    def __init__(self, t: torch.Tensor, key):
        self.kept, self.watch, self.held, self.key = Kept(t), VersionWatch(t), None, key  # versions at pack time

    @property
    def tensor(self) -> torch.Tensor:
        return self.kept.tensor

    def get(self) -> torch.Tensor:
        return (self.held if self.held is not None else self.kept).get()


def parameter_kind(t: torch.Tensor) -> str | None:
    """"leaf": a parameter or a view of one (static memory); "copy": an autocast cast of one or a view
    of that (a linear under autocast saves the transposed view of its weight's bf16 cast); None:
    anything else. Neither kind grows with tokens or is ever compressed."""
    base = t._base
    if base is not None:
        t = base  # a view's storage is its base's
    # a plain tensor is never a parameter: only a subclass carries Parameter's flag (`isinstance` on
    # Parameter runs a Python metaclass check, where most saves are plain tensors)
    if type(t) is not torch.Tensor and isinstance(t, nn.Parameter):
        return "leaf"
    fn = t.grad_fn
    if type(fn) is _TO_COPY:
        nxt = fn.next_functions
        if nxt and type(nxt[0][0]) is _ACCUMULATE_GRAD:
            return "copy"
    return None


def _cast_nodes() -> tuple[type, type]:
    """The autograd node types of a cast of a leaf: (ToCopyBackward0, AccumulateGrad)."""
    with torch.enable_grad():
        fn = torch.zeros(1, requires_grad=True).to(torch.float64).grad_fn
    return type(fn), type(fn.next_functions[0][0])


_TO_COPY, _ACCUMULATE_GRAD = _cast_nodes()


def is_parameter_like(t: torch.Tensor) -> bool:
    return parameter_kind(t) is not None


# The saved-tensor unpack hook: every holder `pack` returns hands its tensor out with `get` (a C-level
# call of it: one Python frame per unpack, not two).
unpack = operator.methodcaller("get")


class SavedTensors:
    """The runtime's saved-tensor hooks (`pack`; `unpack` above) and what they hold beyond one forward: the
    offload pools, the inf / nan checks not settled yet. One per `Runtime`, which installs `pack` for each
    grad-enabled forward; it reads the runtime's forward state (its registry and plans), changes none of it."""

    def __init__(self, runtime):
        self.rt = runtime
        self.pools: dict[torch.device, OffloadPool] = {}
        self.checks: deque = deque()  # inf / nan checks of compressed tensors not settled yet (finite_checks.FiniteCheck)
        self.pending_exact = 0  # bytes their exact copies hold beyond the payloads
        self.check_waits = WaitCount()
        self.compressions = 0  # in the current forward: part of each stochastic-rounding seed
        self.min_bytes = runtime.config.min_bytes  # smaller saves are kept as they are (RuntimeConfig, frozen)

    def _managed(self, t: torch.Tensor) -> bool:
        return (not t.is_nested and t.dtype in FLOAT_DTYPES
                and t.numel() * t.element_size() >= self.min_bytes and not is_parameter_like(t))

    def pack(self, t: torch.Tensor):
        """The saved-tensor pack hook of a forward (a re-run's saves go to `Replay.pack`). Every save
        passes here, so the common one (a float activation, made by a unit) takes the fewest steps."""
        fwd = self.rt._fwd
        frame = fwd.frames[-1] if fwd.frames else None
        own_index = None
        if frame is not None:
            own_index = frame.own_count
            frame.own_count = own_index + 1
        if t.is_nested:
            return Kept(t)
        if frame is not None and fwd.plain_keep[frame.unit.index]:
            # made in this kept call (a parameter, a copy, anything) or by another kept unit: kept, as below
            entry = fwd.lookup(t)
            if entry is None or (entry.unit is not None and fwd.plain_keep[entry.unit.index]):
                return Kept(t)
        kind = parameter_kind(t)
        if kind is not None or t.dtype not in FLOAT_DTYPES or t.nbytes < self.min_bytes:
            return self._unmanaged(t, kind, frame, own_index, fwd)
        entry = fwd.lookup(t)  # (looked up twice only where a kept call saves another mode's tensor)
        if entry is not None:
            unit, record, locator = entry.unit, entry.record, entry.locator
            geometry = geometry_of(t, entry.anchor()) if record is not None else None
        elif frame is not None:
            unit, record, locator, geometry = frame.unit, frame, ("own", own_index), None
        else:
            unit = None
        if frame is not None and fwd.rows_needed:  # what tells a later save of a per-row statistic
            if frame.rows is None:
                frame.rows = RowShapes()
            frame.rows.note(t.shape)
        if unit is None:
            return self._outside_units(t, entry, frame, own_index, fwd)
        return self._store(t, unit, record, locator, geometry, fwd)

    def _unmanaged(self, t: torch.Tensor, kind: str | None, frame, own_index, fwd):
        """A parameter, a weight copy, or a non-float or small tensor: kept as it is, except what a
        recomputed call's re-run makes again."""
        if frame is not None and fwd.plans[frame.unit.index].mode is RECOMPUTE_MODE:
            if kind == "copy":  # a weight copy made inside a recomputed call (never compressed)
                return self._store(t, frame.unit, frame, ("own", own_index), None, fwd)
            if kind is None and t.dtype not in FLOAT_DTYPES and t.nbytes >= self.min_bytes:
                # an integer or bool tensor (MoE routing indices, masks): not counted as the unit's saved
                # bytes (stats count them as index bytes)
                return frame.drop(("own", own_index), None, VersionWatch(t))
        leaf = kind == "leaf"
        kept = Kept(t, alias=not leaf)  # a parameter is a leaf: no cycle to break
        if fwd.stats is not None:  # they watch what lives as long as the graph; a weight copy is its call's unit's
            fwd.stats.add_unmanaged(kept.tensor, leaf, frame.unit if kind == "copy" and frame is not None else None)
        return kept

    def _outside_units(self, t: torch.Tensor, entry, frame, own_index, fwd):
        """A float tensor made outside every unit (or before this forward)."""
        if fwd.inputs_of is not None:
            # an input of a standalone call, made before it (in the closed forward): the call's unit owns
            # the save, kept exact in every mode (the call cannot make it again): counted as pinned, so the
            # planner reserves no backward transient for it and no codec saving
            return self._keep(t, fwd.inputs_of, fwd, pinned=True)
        if fwd.tail is not None:
            # the model's own code after the head (Gemma-2's final logit soft-cap): the head's, kept or
            # compressed as its plan says; it cannot run again, so under recompute it is kept
            if fwd.plans[fwd.tail.index].mode is RECOMPUTE_MODE:
                return self._keep(t, fwd.tail, fwd)
            return self._store(t, fwd.tail, None, None, None, fwd)
        if entry is not None and frame is not None:
            held = self._adopted(t, frame, own_index, fwd)
            if held is not None:
                return held
        kept = Kept(t)
        if fwd.stats is not None:
            fwd.stats.add_unmanaged(kept.tensor, False)
        return kept

    def _adopted(self, t: torch.Tensor, frame, own_index, fwd):
        """How `t`, made outside every unit (the residual stream, rotary tables) and saved by `frame`'s
        call, is held: as a save of the first unit whose call saved its storage in this forward (one
        tensor, one owner, one mode), counted as that unit's. Kept or compressed by the owner's plan;
        when the owner recomputes, dropped if this is the owner's own call (its re-run takes `t` as an
        input and saves it again). None (`t` stays outside units, kept as it is) where the owner
        recomputes and another unit's call saves it, or where the owner compresses and `t` is held exact
        already as a recomputed call's input (a payload beside it would save nothing)."""
        adopted = fwd.adopted
        key = (storage_id(t),)
        owner, held_exact = adopted.get(key) or (None, False)
        if owner is None:
            owner = frame.unit
            adopted.put(key, t, (owner, held_exact))
        mode = fwd.plans[owner.index].mode
        if mode == Mode.RECOMPUTE:
            if owner is not frame.unit:
                return None
            return self._store(t, owner, frame, ("own", own_index), None, fwd)
        if mode == Mode.COMPRESS and held_exact:
            return None
        return self._store(t, owner, None, None, None, fwd)

    @staticmethod
    def _keep(t, unit, fwd, pinned: bool = False) -> Kept:
        """Hold `t` exact as `unit`'s saved tensor, whatever the unit's mode."""
        kept = Kept(t)
        if fwd.stats is not None:
            fwd.stats.add(unit, storage_key(t), kept.tensor, stored=t.numel() * t.element_size(), pinned=pinned)
        return kept

    def _store(self, t, unit, record, locator, geometry, fwd, saved: bool = True):
        """Hold `t` by its producer unit's mode. `saved`: autograd saves it (else the runtime holds it
        only to re-run a call later; counted as held, not saved)."""
        plan = fwd.plans[unit.index]
        if plan.mode is KEEP_MODE:
            kept = Kept(t)
            if fwd.stats is not None:
                fwd.counter(saved)(unit, storage_key(t), kept.tensor, stored=t.numel() * t.element_size())
            return kept
        if plan.mode is COMPRESS_MODE:
            key = storage_key(t)
            rows = fwd.frames[-1].rows if saved and fwd.frames else None
            statistic = is_row_statistic(t, rows)
            if (not statistic and saved and locator is not None and locator[0] == "own" and not t.requires_grad
                    and fwd.compressed.get(key) is None):
                undecided = Undecided(t, key)  # decided at the call's end (`_decide`)
                if record.undecided is None:
                    record.undecided = []
                record.undecided.append(undecided)
                return undecided
            return self._compress(t, unit, key, plan, statistic, fwd.counter(saved), saved, fwd)
        handle = record.drop(locator, geometry, VersionWatch(t))
        if fwd.stats is not None:
            fwd.counter(saved)(unit, storage_key(t), t, stored=0)
        return handle

    def decide(self, record, fwd) -> None:
        """At the end of `record`'s call: its undecided saves, with every row of the call known."""
        for undecided in record.undecided:
            t, plan = undecided.tensor, fwd.plans[record.unit.index]
            held = self._compress(t, record.unit, undecided.key, plan, is_row_statistic(t, record.rows),
                                  fwd.counter(True), True, fwd, undecided.watch)
            if isinstance(held, Kept):
                held.version = undecided.kept.version  # an in-place change since the save is still caught
            undecided.held = held
        record.undecided = None

    def _compress(self, t, unit, key, plan, statistic: bool, count, saved: bool, fwd, watch=None):
        """Hold `t` as a compressed unit's save: a statistic or a tensor the codec cannot take (non-finite,
        or no group fits) exact and counted; else its payload (shared by every save of its storage)."""
        self.settle_checks(wait=False)
        held = fwd.compressed.get(key)
        if held is None:
            payload = None if statistic else self._quantize(t, plan)
            deferred = payload is not None and defers_checks(t.device)
            if payload is None or (not deferred and payload.has_nonfinite):  # kept exact, and counted
                kept = Kept(t)
                count(unit, key, kept.tensor, stored=t.numel() * t.element_size(), statistic=statistic,
                      nonfinite=payload is not None, incompressible=payload is None and not statistic)
                return kept
            stored = (self._offload_pool(t.device).offload(payload, t.shape) if plan.offload
                      else Compressed(payload, t.shape))
            held = Checked(self._unchecked(t, payload, stored) if deferred else stored, watch or VersionWatch(t))
            fwd.compressed.put(key, t, held)
        held.saves += int(saved)
        charge = count(unit, key, t, stored=held.nbytes)
        if charge is not None and isinstance(held.held, Unchecked):
            held.held.charge(fwd.stats, charge)
        return held

    def _quantize(self, t: torch.Tensor, plan: UnitPlan):
        """Groups run along the last dim; a contiguous tensor whose last dim does not fit the group is
        grouped over its flat elements. Where neither fits the plan's group, the largest smaller group
        size that does (finer groups: a smaller error, a few more scale bytes), so that whether a
        tensor compresses does not turn on its row count (logits over a vocabulary of 4000 with an odd
        number of rows fit 32 and not 64). None when no group fits (the tensor is then kept exact)."""
        for g in FINER_FIRST[plan.group_size]:
            if t.shape[-1] % g == 0:
                source = t
            elif t.is_contiguous() and t.numel() % g == 0:
                source = t.view(-1, g)
            else:
                continue
            self.compressions += 1
            seed = hash((self.rt.config.seed, self.rt._forwards, self.compressions)) & 0x7FFFFFFF
            return quantize(source.detach(), plan.fmt, g, stochastic=plan.stochastic, seed=seed)
        return None

    def _unchecked(self, t: torch.Tensor, payload, stored) -> Unchecked:
        """`t` and its payload `stored`, held until the payload's inf / nan check reaches the host."""
        flag = torch.empty((), dtype=torch.bool, pin_memory=t.device.type == "cuda")
        flag.copy_(payload.any_nonfinite(), non_blocking=True)
        dm = torch.get_device_module(t.device.type)
        done = dm.Event()
        done.record(dm.current_stream(t.device))  # after the copy, on the stream that queued it
        held = Unchecked(t, stored, flag, done, self.check_waits)
        self.checks.append(held.check)
        self.pending_exact += held.check.delta
        return held

    def settle_checks(self, wait: bool) -> None:
        """Settle pending checks in order, up to the first whose copy has not landed (all, if `wait`).
        While the exact copies they hold beyond their payloads pass PENDING_EXACT_BYTES, the oldest is
        waited for: the host is then that far ahead of the device, so the wait leaves it work queued."""
        checks = self.checks
        while checks and checks[0].settle(wait or self.pending_exact > PENDING_EXACT_BYTES):
            self.pending_exact -= checks.popleft().delta

    def settled_stats(self):
        """The last forward's stats with every pending check settled and the offload pools' bytes now."""
        self.settle_checks(wait=True)
        stats = self.rt._last
        stats.offload_pool_bytes = sum(pool.held_bytes for pool in self.pools.values())
        stats.offload_pool_peak_bytes = sum(pool.peak_bytes for pool in self.pools.values())
        return stats

    def _offload_pool(self, device: torch.device) -> OffloadPool:
        pool = self.pools.get(device)
        if pool is None:
            pool = self.pools[device] = OffloadPool(device)
        return pool

    def hold(self, t: torch.Tensor):
        """How a tensor needed for a later recompute is held: by its producer's mode."""
        entry = self.rt._fwd.lookup(t) if self._managed(t) else None
        if entry is None or entry.unit is None or entry.record is None:
            kept = Kept(t, alias=not isinstance(t, nn.Parameter))
            if self.rt._fwd.stats is not None:
                self.rt._fwd.stats.add_unmanaged_held(kept.tensor)
            if entry is not None and entry.unit is None:  # a later save by a compressed unit shares it
                adopted, key = self.rt._fwd.adopted, (storage_id(t),)
                owner, _ = adopted.get(key) or (None, False)
                adopted.put(key, t, (owner, True))
            return kept
        return self._store(t, entry.unit, entry.record, entry.locator, geometry_of(t, entry.anchor()), self.rt._fwd,
                           saved=False)
