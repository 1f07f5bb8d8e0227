"""What one grad-enabled forward records: the plans it runs under, its call frames, and the registry
of boundary tensors by storage (who produced each input and output of a unit call, so a saved tensor is
attributed to its producer wherever it is saved), with its stats and the regions it records. The
runtime (runtime.py) opens one per forward and drops it when the forward ends.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from hilore_verl.runtime.plan import Mode, UnitPlan
from hilore_verl.runtime.records import CallRecord, LiveKeyMap, Region, storage_id, tensor_leaves
from hilore_verl.runtime.saving import FLOAT_DTYPES, RowShapes, is_parameter_like
from hilore_verl.runtime.stats import StepStats
from hilore_verl.model.units import RecoveryUnit


@dataclass(slots=True)
class Entry:
    """A registered boundary tensor: who produced it and where to find it again."""
    unit: RecoveryUnit | None  # None: produced outside every unit (embedding, rotary tables, residual stream)
    record: CallRecord | None
    locator: tuple | None
    anchor: Any  # weakref to the registered tensor


@dataclass
class Forward:
    """State of one grad-enabled forward of the root module (or of `tracking` / a standalone `call`)."""
    plans: list[UnitPlan]  # the plan in force when the forward started
    owner: str = "root"
    frames: list[CallRecord] = field(default_factory=list)
    registry: dict[int, Entry] = field(default_factory=dict)
    compressed: LiveKeyMap = field(default_factory=LiveKeyMap)
    # storage made outside units -> (the unit that adopted it or None, whether it is held exact as a recomputed
    # call's input): saving._adopted
    adopted: LiveKeyMap = field(default_factory=LiveKeyMap)
    stats: StepStats | None = None  # None: a forward nobody reads the byte accounting of (Runtime.set_plan)
    rerun: dict = field(default_factory=dict)  # module (or block) -> whether it runs again in backward
    region: Region | None = None  # the region being recorded
    top: CallRecord | None = None  # a block region's own code
    tail: RecoveryUnit | None = None  # the head, once its outermost call returned: code after it is its own
    inputs_of: RecoveryUnit | None = None  # a standalone `call`'s unit: its inputs made outside it are its own
    rows_needed: bool = field(init=False)  # a unit compresses: calls note their row shapes (saving.is_row_statistic)
    # per unit: kept, in a forward that counts nothing and notes no rows (no stats, no unit compresses): a save
    # in its call that no other mode owns is kept as it is, without the other checks (saving.pack)
    plain_keep: list[bool] = field(init=False)
    # per unit: kept, in a forward that counts nothing: its calls that only such units fed run without the
    # saved-tensor hooks (hook_scope.py; `kept_made`)
    quiet_keep: list[bool] = field(init=False)

    def __post_init__(self):
        self.rows_needed = any(p.mode == Mode.COMPRESS for p in self.plans)
        self.quiet_keep = [self.stats is None and p.mode == Mode.KEEP for p in self.plans]
        self.plain_keep = [not self.rows_needed and keep for keep in self.quiet_keep]

    def register(self, t: torch.Tensor, unit: RecoveryUnit | None, record: CallRecord | None, locator) -> Entry:
        """`t` was made by `unit`'s call `record` (None: outside every unit); the first producer wins
        (a module may return a view of its input). Returns the entry that stands."""
        ptr = storage_id(t)
        entry = self.registry.get(ptr)
        if entry is not None and entry.anchor() is not None:
            return entry
        entry = self.registry[ptr] = Entry(unit, record, locator, weakref.ref(t))
        return entry

    def register_inputs(self, args, kwargs, producer: CallRecord | None, unit, child_index,
                        record: CallRecord | None = None) -> bool:
        """A call's float inputs, as the j-th child inputs of their producing call; without a producer
        they were made outside every unit (kept as they are). The block's own code has no unit: its
        tensors go by the unit they are handed to. Their shapes are the first rows `record`'s per-row
        statistics can describe (saving.is_row_statistic). Returns whether every one of them is
        `kept_made`."""
        kept_made = True
        for path, t in tensor_leaves((args, kwargs)):
            if t.dtype in FLOAT_DTYPES and not t.is_nested and not is_parameter_like(t):
                if record is not None and self.rows_needed:
                    if record.rows is None:
                        record.rows = RowShapes()
                    record.rows.note(t.shape)
                if producer is None:
                    entry = self.register(t, None, None, None)
                else:
                    entry = self.register(t, producer.unit or unit, producer, ("child_in", child_index, path))
                kept_made = kept_made and self.kept_made(t, entry)
        return kept_made

    def kept_made(self, t: torch.Tensor, entry: Entry) -> bool:
        """Whether a save of `t` (registered as `entry`) in a `quiet_keep` unit's call would be kept as it
        is, whoever saved it first: made by a `quiet_keep` unit, or outside every unit and either the input
        of a standalone call (kept by its unit) or adopted already by a `quiet_keep` unit (saving._adopted:
        a call without the hooks adopts nothing, which would hand the tensor to a later saver's mode)."""
        if entry.unit is not None:
            return self.quiet_keep[entry.unit.index]
        if self.inputs_of is not None:
            return True
        owner = (self.adopted.get((storage_id(t),)) or (None,))[0]
        return owner is not None and self.quiet_keep[owner.index]

    def register_outputs(self, output, record: CallRecord) -> bool:
        """The float tensors of `output`, made by `record`'s call (unless made before: a view of an input).
        Returns whether every one of them is `kept_made`."""
        kept_made = True
        for path, t in tensor_leaves(output):
            if t.dtype in FLOAT_DTYPES and not t.is_nested:
                entry = self.register(t, record.unit, record, ("out", path))
                kept_made = kept_made and self.kept_made(t, entry)
        return kept_made

    def runs_again(self, fn, unit: RecoveryUnit) -> bool:
        """Whether the call of `fn` (a unit module, or a block) runs again in backward."""
        rerun = self.rerun.get(fn)
        return rerun if rerun is not None else self.plans[unit.index].mode == Mode.RECOMPUTE

    def counter(self, saved: bool):
        """How a save (`saved`) or a tensor held only for a recompute is counted: `StepStats.add` or
        `add_held`, or not at all in a forward without stats."""
        if self.stats is None:
            return uncounted
        return self.stats.add if saved else self.stats.add_held

    def lookup(self, t: torch.Tensor) -> Entry | None:
        """Who made `t`'s storage in this forward (None: not registered, or its tensor is gone)."""
        entry = self.registry.get(storage_id(t))
        if entry is None:
            return None
        return entry if entry.anchor() is not None else None


def uncounted(*args, **kwargs) -> None:
    """A count in a forward without stats: nothing counted (the counted-at value is None)."""
    return None
