"""Byte accounting of one forward: what each unit's saved tensors would take and what is stored.

A saved tensor is counted once per distinct view (storage, offset, shape, stride, dtype), however
many ops save it; its bytes are its logical size (numel x element size). "Stored" is that size
for kept tensors, the payload (codes + scales) for compressed ones and 0 for dropped ones. A
compressed tensor whose inf / nan check settles after the forward (an asynchronous device) is
corrected where it was counted when the check settles (`StepStats.flagged`); `Runtime.stats()`
settles every pending check first.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

from hilore_verl.runtime.records import LiveKeyMap, storage_key


@dataclass
class UnitStats:
    mode: str
    saved_bytes: int = 0
    """What the unit's saved tensors would take if kept."""
    stored_bytes: int = 0
    """What is actually held for them until backward."""
    held_bytes: int = 0
    """Part of stored_bytes held only so that a recomputed call can run again (not saved by autograd)."""
    tensors: int = 0
    nonfinite: int = 0
    """Tensors kept exact instead of compressed because they held inf / nan."""
    incompressible: int = 0
    """Tensors kept exact because neither their last dim nor their size is a multiple of the group size."""
    pinned_bytes: int = 0
    """Part of saved_bytes kept exact in every mode: a standalone call's inputs made before it (verl's
    logits in its log-prob code), which re-running the call cannot make again."""
    statistic_bytes: int = 0
    """Part of stored_bytes kept exact by rule under compression: per-row statistics (a norm's
    reciprocal RMS, attention's log-sum-exp), see `saving.is_row_statistic`."""
    saved_elements: int = 0
    """Elements of its saved tensors (saved_bytes / saved_elements: their mean element size, which a
    codec's payload follows: codes and scales per element)."""
    copy_bytes: int = 0
    """Low-precision copies of parameters (autocast's casts) its calls saved while it keeps or compresses:
    part of the unmanaged bytes (held as they are), of a size that does not follow the tokens; a
    recomputed unit's re-run makes them again, so it holds none."""

    def plus(self, other: "UnitStats") -> "UnitStats":
        return UnitStats(other.mode, **{f.name: getattr(self, f.name) + getattr(other, f.name)
                                        for f in fields(self) if f.name != "mode"})


@dataclass
class RuntimeStats:
    units: dict[str, UnitStats]
    unmanaged_bytes: int
    """Float saved tensors outside every unit or below the size threshold (kept as they are); no parameters."""
    parameter_saves: int
    """Saves of parameters (and their views / casts): never touched."""
    unmanaged_held_bytes: int = 0
    """Unattributed tensors (e.g. the residual stream) held only as inputs of recomputed calls."""
    index_bytes: int = 0
    """Integer and bool tensors saved for backward (MoE routing indices, masks): kept as they are."""
    offload_pool_bytes: int = 0
    """Host buffers the offload pools hold when `stats()` is called (in use and idle), all devices."""
    offload_pool_peak_bytes: int = 0
    """The most host buffers each pool has held at once since attach, summed over devices."""

    def __post_init__(self):
        # the StepStats summed up here (not a field: plain data for asdict); they correct `units`
        # when a deferred inf / nan check settles
        self.sources: list[StepStats] = []

    @property
    def saved_bytes(self) -> int:
        return sum(u.saved_bytes for u in self.units.values())

    @property
    def stored_bytes(self) -> int:
        return sum(u.stored_bytes for u in self.units.values())

    def merged(self, other: "RuntimeStats") -> "RuntimeStats":
        """Both accountings added up (a forward and the unit calls that follow it in the same step)."""
        units = {name: u.plus(other.units[name]) for name, u in self.units.items()}
        sources = self.sources + other.sources
        for step in sources:
            step.outputs.append(units)
        merged = RuntimeStats(units, self.unmanaged_bytes + other.unmanaged_bytes,
                              self.parameter_saves + other.parameter_saves,
                              self.unmanaged_held_bytes + other.unmanaged_held_bytes,
                              self.index_bytes + other.index_bytes)
        merged.sources = sources
        return merged

    def table(self) -> str:
        rows = [f"{'unit':24} {'mode':14} {'saved MiB':>10} {'stored MiB':>10}"]
        for name, u in self.units.items():
            rows.append(f"{name:24} {u.mode:14} {u.saved_bytes / 2**20:10.3f} {u.stored_bytes / 2**20:10.3f}")
        rows.append(f"{'total':24} {'':14} {self.saved_bytes / 2**20:10.3f} {self.stored_bytes / 2**20:10.3f}")
        rows.append(f"{'outside units':24} {'keep':14} {self.unmanaged_bytes / 2**20:10.3f} "
                    f"{self.unmanaged_bytes / 2**20:10.3f}")
        rows.append(f"{'index tensors':24} {'keep':14} {self.index_bytes / 2**20:10.3f} {self.index_bytes / 2**20:10.3f}")
        if self.offload_pool_peak_bytes:
            rows.append(f"offload pool (host): {self.offload_pool_bytes / 2**20:.3f} MiB held, "
                        f"{self.offload_pool_peak_bytes / 2**20:.3f} MiB at most")
        return "\n".join(rows)


@dataclass
class StepStats:
    names: list[str]
    saved: list[int] = field(default_factory=list)
    stored: list[int] = field(default_factory=list)
    tensors: list[int] = field(default_factory=list)
    nonfinite: list[int] = field(default_factory=list)
    incompressible: list[int] = field(default_factory=list)
    pinned: list[int] = field(default_factory=list)
    statistic: list[int] = field(default_factory=list)
    copies: list[int] = field(default_factory=list)
    elements: list[int] = field(default_factory=list)
    unmanaged_bytes: int = 0
    parameter_saves: int = 0
    index_bytes: int = 0
    seen: LiveKeyMap = field(default_factory=LiveKeyMap)
    held: LiveKeyMap = field(default_factory=LiveKeyMap)
    saved_whole: LiveKeyMap = field(default_factory=LiveKeyMap)  # storage address -> a save holds it whole
    held_items: list = field(default_factory=list)  # [key, unit index or None, stored bytes, counted by summary]
    outputs: list = field(default_factory=list)  # the `units` of each RuntimeStats made from this

    @classmethod
    def empty(cls, units) -> "StepStats":
        n = len(units)
        return cls([u.name for u in units], *([0] * n for _ in range(9)))

    def add(self, unit, key: tuple, t: torch.Tensor, stored: int, nonfinite: bool = False,
            incompressible: bool = False, pinned: bool = False, statistic: bool = False):
        """Count one saved tensor; returns where it was counted (for `flagged`), None if it already was."""
        if self.seen.get(key) is not None:
            return None
        self.seen.put(key, t, True)
        size = t.numel() * t.element_size()
        if stored == size:
            self.saved_whole.put((key[0],), t, True)
        i = unit.index
        self.saved[i] += size
        self.elements[i] += t.numel()
        self.stored[i] += stored
        self.tensors[i] += 1
        self.nonfinite[i] += int(nonfinite)
        self.incompressible[i] += int(incompressible)
        self.pinned[i] += size if pinned else 0
        self.statistic[i] += size if statistic else 0
        return i

    def add_unmanaged(self, t: torch.Tensor, is_parameter: bool, copy_of=None) -> None:
        """Count a tensor saved outside every unit's accounting; `copy_of`: the unit whose call saved it,
        where it is a low-precision copy of a parameter (counted in the unit's `copy_bytes` too)."""
        if is_parameter:
            self.parameter_saves += 1
            return
        if t.is_nested:
            return
        key = storage_key(t)
        if self.seen.get(key) is None:
            self.seen.put(key, t, True)
            self.saved_whole.put((key[0],), t, True)
            if t.is_floating_point():
                self.unmanaged_bytes += t.numel() * t.element_size()
                if copy_of is not None:
                    self.copies[copy_of.index] += t.numel() * t.element_size()
            else:
                self.index_bytes += t.numel() * t.element_size()

    def add_held(self, unit, key: tuple, t: torch.Tensor, stored: int, nonfinite: bool = False,
                 incompressible: bool = False, statistic: bool = False):
        """Count a tensor held only for a recompute; returns its item (for `flagged`), None if counted."""
        if self.held.get(key) is not None:
            return None
        self.held.put(key, t, True)
        item = [key, unit.index, stored, False]
        self.held_items.append(item)
        return item

    def add_unmanaged_held(self, t: torch.Tensor) -> None:
        if t.is_nested or not t.is_floating_point():
            return
        key = storage_key(t)
        if self.held.get(key) is None:
            self.held.put(key, t, True)
            self.held_items.append([key, None, t.numel() * t.element_size(), False])

    def flagged(self, charge, delta: int) -> None:
        """A deferred check found inf / nan in a tensor counted at `charge` (what `add` or `add_held`
        returned): it is kept exact, `delta` bytes more than its payload. Summaries already made
        from this step are corrected too."""
        if isinstance(charge, int):  # a save
            self.stored[charge] += delta
            self.nonfinite[charge] += 1
            for units in self.outputs:
                unit = units[self.names[charge]]
                unit.stored_bytes += delta
                unit.nonfinite += 1
            return
        charge[2] += delta  # held only for a recompute
        if charge[3]:
            for units in self.outputs:
                unit = units[self.names[charge[1]]]
                unit.held_bytes += delta
                unit.stored_bytes += delta

    def summary(self, plans) -> RuntimeStats:
        units = {name: UnitStats(str(plans[i]), saved_bytes=self.saved[i], stored_bytes=self.stored[i],
                                 tensors=self.tensors[i], nonfinite=self.nonfinite[i],
                                 incompressible=self.incompressible[i], pinned_bytes=self.pinned[i],
                                 statistic_bytes=self.statistic[i], copy_bytes=self.copies[i],
                                 saved_elements=self.elements[i])
                 for i, name in enumerate(self.names)}
        unmanaged_held = 0
        for item in self.held_items:
            key, index, stored, _ = item
            if self.saved_whole.get((key[0],)) is not None or (index is not None and self.seen.get(key) is not None):
                continue  # a save holds the same storage whole, or the same payload: already counted there
            if index is None:
                unmanaged_held += stored
            else:
                item[3] = True
                unit = units[self.names[index]]
                unit.held_bytes += stored
                unit.stored_bytes += stored
        self.outputs.append(units)
        stats = RuntimeStats(units, self.unmanaged_bytes, self.parameter_saves, unmanaged_held, self.index_bytes)
        stats.sources = [self]
        return stats
