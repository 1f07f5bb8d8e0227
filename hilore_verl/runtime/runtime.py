"""The recovery-unit runtime: executes a Plan on a model's saved activations. It decides nothing.

Hooks, installed once by `attach` and removed by `detach`:
  - on the root module: enter / leave a saved-tensor hook context for each grad-enabled forward
    (`runtime/hook_scope.py`: off inside the calls of a training plan where they could only keep);
  - on every unit module: forward pre/post hooks that keep a stack of call frames, record each call
    (inputs and RNG state when its unit recomputes) and register the call's inputs and outputs by
    storage, so a saved tensor is attributed to the unit that *produced* it, wherever it is saved;
  - a thin `forward` wrapper on every unit module, which during a recompute returns the output
    held for a child call instead of running it again (selective recompute).

Pack and unpack (`runtime/saving.py`, `SavedTensors`, one per runtime): each save held by its producer's mode.
Recompute (`runtime/recompute.py`): a dropped tensor's region re-runs once in backward.

A forward runs under the plan in force when it started (`set_plan` during a forward applies to the
next one). A forward or backward that raises leaves the runtime ready for the next step; what it
held is freed with its graph (nothing the runtime holds ties a graph to itself).
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Mapping, Union

import torch
import torch.nn as nn

from hilore_verl.runtime.config import RuntimeConfig
from hilore_verl.runtime.forward import Forward
from hilore_verl.runtime.hook_scope import HookScope
from hilore_verl.runtime.install import Installed
from hilore_verl.runtime.plan import KEEP, RECOMPUTE, Mode, Plan, PlanValue, UnitPlan
from hilore_verl.runtime.recompute import HeldInput, Replay, Reruns, autocast_state, rerun, rng_like, rng_state
from hilore_verl.runtime.records import CallRecord, Dropped, Region, map_tensors
from hilore_verl.runtime.saving import SavedTensors, unpack
from hilore_verl.runtime.stats import RuntimeStats, StepStats
from hilore_verl.model.units import RecoveryUnit, find_units


class Runtime:
    """Executes a Plan on a model's recovery units. Create with `hilore_verl.attach(model)`."""

    def __init__(self, model: nn.Module, units: list[RecoveryUnit], config: RuntimeConfig):
        self.model = model
        self.units = units
        self.config = config
        self._by_name = {u.name: u for u in units}
        self._module_unit: dict[nn.Module, RecoveryUnit] = {m: u for u in units for m in u.modules}
        self._reruns = Reruns(units, self._module_unit)
        self._plans: list[UnitPlan] = [UnitPlan()] * len(units)
        self._hands_off = False  # every unit kept under a training plan: forwards run as the plain model's
        self._measure = True  # forwards count the bytes they save (`stats()`); set_plan(measure=False): not
        self._measuring = 0  # open `measured()` scopes: their forwards count whatever set_plan said
        self._installed = Installed()
        self._fwd: Forward | None = None
        self._hook_ctx: HookScope | None = None
        self._replay: Replay | None = None
        self._rehooked = False  # unit hooks re-installed for a recompute after detach
        self.saving = SavedTensors(self)  # the saved-tensor hooks and what they hold (runtime/saving.py)
        self._forwards = 0  # grad-enabled forwards so far: part of each stochastic-rounding seed
        self._last: RuntimeStats = StepStats.empty(units).summary(self._plans)
        self.attached = False

    # ------------------------------------------------------------------ public API
    def set_plan(self, plan: Union[Plan, Mapping[str, PlanValue]], measure: bool = True,
                 hands_off: bool = True) -> None:
        """Swap the plan; takes effect at the next forward. Raises ValueError, leaving the old plan, on bad input.

        `measure=False` (a training plan, whose byte accounting nobody reads): forwards count no bytes
        (`stats()` still describes the last forward that was measured), and, with `hands_off`, a plan that
        keeps every unit runs its forwards without the runtime's saved-tensor hooks and call records, as
        the plain model does, and a plan that is exactly HF gradient checkpointing (every unit of each
        layer whose checkpointing `attach` took over recomputed, every other unit kept) runs as HF
        checkpointing, also without the runtime. `hands_off=False` runs those plans through the runtime
        too (what its hooks cost, measured against the plain runs)."""
        # a compressed tensor whose size the plan's group does not divide takes a group that fits, or stays
        # exact (saving.py, `SavedTensors._quantize`): any hidden size takes any group size
        resolved = Plan.of(plan).resolve([u.name for u in self.units])
        self._plans = resolved
        checkpoint = self.checkpoint_plan()
        as_checkpoint = checkpoint is not None and all(
            p == checkpoint[u.name] for u, p in zip(self.units, resolved))
        self._measure = measure
        self._hands_off = not measure and hands_off and (as_checkpoint or all(p.mode == Mode.KEEP for p in resolved))
        self._installed.checkpointing(not measure and hands_off and as_checkpoint)

    def checkpoint_plan(self) -> dict[str, UnitPlan] | None:
        """The plan that is exactly HF gradient checkpointing as the model had it before `attach` (each unit
        of a checkpointed layer RECOMPUTE, every other unit KEEP); None when no layer was checkpointed."""
        checkpointed = {id(m) for m, _, _ in self._installed.gc_state}
        if not checkpointed:
            return None
        return {u.name: RECOMPUTE if u.block is not None and id(u.block) in checkpointed else KEEP
                for u in self.units}

    def plan_of(self, name: str) -> UnitPlan:
        """The plan in force for one unit."""
        unit = self._by_name.get(name)
        if unit is None:
            raise ValueError(f"unknown unit {name!r}; valid: {', '.join(u.name for u in self.units)}")
        return self._plans[unit.index]

    def whole_blocks(self, plan: Union[Plan, Mapping[str, PlanValue]]) -> int:
        """How many decoder blocks re-run whole under `plan` (every outermost unit call of the block runs
        again): those hold only their inputs, as a checkpointed layer does."""
        return self._reruns.whole_blocks(Plan.of(plan).resolve([u.name for u in self.units]))

    @property
    def hands_off(self) -> bool:
        """Whether forwards now run without the runtime (a training plan that keeps every unit)."""
        return self._hands_off

    @property
    def unit_modules(self) -> dict[nn.Module, RecoveryUnit]:
        """Every module that belongs to a unit, and its unit (for profiling hooks)."""
        return dict(self._module_unit)

    @property
    def recomputing(self) -> bool:
        """Whether a unit is being re-run in backward right now (its forward calls are not the step's)."""
        return self._replay is not None

    @property
    def forwards(self) -> int:
        """Grad-enabled forwards so far; part of every stochastic-rounding seed. An exact retry of a
        step sets it back to its value at the start of the step (same seeds, same rounding)."""
        return self._forwards

    @forwards.setter
    def forwards(self, value: int) -> None:
        self._forwards = int(value)

    @property
    def host_waits(self) -> int:
        """Times settling an inf / nan check waited for the device so far (0 on the CPU, where checks are
        read at once; on a GPU, waits mean the checks' copies had not landed when they were needed)."""
        return self.saving.check_waits.n

    def stats(self) -> RuntimeStats:
        """Bytes per unit for the last grad-enabled forward measured (`set_plan`'s `measure`): what saved
        tensors would take, what is stored (pending inf / nan checks settled first), and the offload pools'
        host bytes."""
        return self.saving.settled_stats()

    @contextlib.contextmanager
    def measured(self):
        """Forwards inside count their bytes (`stats()`) whatever `set_plan`'s `measure` says: what a
        training plan holds, for a report. A hands-off forward still runs without the runtime."""
        self._measuring += 1
        try:
            yield
        finally:
            self._measuring -= 1

    def reset(self) -> None:
        """Abandon a forward that did not finish (an exception mid-forward): the next forward starts
        clean. Graphs already built keep what they hold and can still run backward."""
        if self._hook_ctx is not None:
            self._hook_ctx.close()
            self._hook_ctx = None
        self._fwd = None
        self._replay = None

    def detach(self) -> None:
        """Remove every hook and wrapper and restore HF gradient checkpointing as it was. A graph
        built before still runs backward (its recomputes re-install the unit hooks for their run)."""
        self._installed.remove()
        self.reset()
        self.attached = False
        _ATTACHED.discard(self.model)

    # ------------------------------------------------------------------ installation
    def _install(self) -> None:
        self._installed.take_over_gradient_checkpointing(u.block for u in self.units if u.block is not None)
        self._installed.hook_root(self.model, self._root_pre, self._root_post)
        self._installed.hook_units(self._module_unit, self._unit_pre, self._unit_post, self._replaying_forward)
        self._installed.hook_blocks(self._reruns.blocks, self._block_pre, self._block_post)
        self.attached = True

    @contextlib.contextmanager
    def _unit_hooks_for_recompute(self):
        """After `detach`, a graph built before still needs the unit hooks while a recompute runs."""
        if self.attached or self._rehooked:  # attached, or an outer recompute installed them
            yield
            return
        temporary = Installed()
        temporary.hook_units(self._module_unit, self._unit_pre, self._unit_post, self._replaying_forward)
        self._rehooked = True
        try:
            yield
        finally:
            self._rehooked = False
            temporary.remove()

    def _replaying_forward(self, module: nn.Module, forward):
        def forward_or_replay(*args, **kwargs):
            replay = self._replay
            if replay is not None:
                output = replay.replayed_output(module)
                if output is not None:
                    return output
            return forward(*args, **kwargs)

        return forward_or_replay

    # ------------------------------------------------------------------ forward hooks
    def _root_pre(self, module, args):
        if torch.is_grad_enabled() and self._replay is None and self._fwd is None and not self._hands_off:
            self._open_forward("root")

    def _root_post(self, module, args, output):
        if self._fwd is not None and self._fwd.owner == "root" and self._replay is None:
            self._close_forward(merge=False)

    def _open_forward(self, owner: str) -> None:
        self._forwards += 1
        self.saving.compressions = 0
        counted = self._measure or self._measuring > 0
        self._fwd = Forward(plans=self._plans, owner=owner, stats=StepStats.empty(self.units) if counted else None,
                            rerun=self._reruns.of(self._plans))
        self._hook_ctx = HookScope(self.saving.pack, unpack)

    def _close_forward(self, merge: bool) -> None:
        fwd = self._fwd
        if self.saving.checks:
            self.saving.settle_checks(wait=False)
        try:
            if fwd.stats is not None:
                summary = fwd.stats.summary(fwd.plans)  # now, while the held tensors are alive
                self._last = self._last.merged(summary) if merge else summary
        finally:
            self.reset()

    def _open_region(self, root, args, kwargs) -> Region:
        region = Region(root)
        region.inputs = map_tensors((args, kwargs), lambda t: HeldInput(self.saving.hold(t), t.requires_grad))
        region.rng = rng_state((args, kwargs))
        region.autocast = autocast_state()
        region.recompute = self._rerun
        return region

    def _block_pre(self, module, args, kwargs):
        fwd = self._fwd
        if fwd is not None and self._replay is None and fwd.region is None and fwd.rerun.get(module):
            fwd.register_inputs(args, kwargs, None, None, None)  # the block's inputs: held, never dropped
            region = fwd.region = self._open_region(module, args, kwargs)
            fwd.top = CallRecord(module, None)  # what the block's own code hands its outermost calls
            fwd.top.region = region
            region.top = weakref.ref(fwd.top)

    def _block_post(self, module, args, kwargs, output):
        fwd = self._fwd
        if fwd is not None and self._replay is None and fwd.region is not None and fwd.region.root is module:
            fwd.region = fwd.top = None

    def _unit_pre(self, module, args, kwargs):
        if self._replay is not None:
            self._replay.pre(module, args, kwargs)
        if self._fwd is not None:
            self._enter(module, self._module_unit[module], args, kwargs)

    def _unit_post(self, module, args, kwargs, output):
        if self._replay is not None:
            self._replay.post(output)
        elif self._fwd is not None:
            self._exit(module, output)
            if self.saving.checks:  # exact copies whose checks have landed are let go at each unit's end
                self.saving.settle_checks(wait=False)

    def _enter(self, fn, unit: RecoveryUnit, args, kwargs) -> None:
        """Open a call frame of `unit` for `fn` (a unit module, or a function passed to `call`)."""
        fwd = self._fwd
        parent = fwd.frames[-1] if fwd.frames else None
        record = CallRecord(fn, unit)
        producer = parent if parent is not None else fwd.top  # inside a block region, its own code
        child_index = None
        if producer is not None:
            child_index, producer.child_count = producer.child_count, producer.child_count + 1
        kept_made = fwd.register_inputs(args, kwargs, producer, unit, child_index, record)
        if fwd.region is None and fwd.plans[unit.index].mode == Mode.RECOMPUTE:  # the call is its own region
            fwd.region = self._open_region(fn, args, kwargs)
        if fwd.region is not None:
            fwd.region.add(record)
        self._hook_ctx.enter(len(fwd.frames), not (kept_made and fwd.quiet_keep[unit.index]))
        fwd.frames.append(record)

    def _exit(self, fn, output) -> None:
        fwd = self._fwd
        frames = fwd.frames
        if frames and frames[-1].module is fn:  # the innermost call, as every call that did not fail
            depth = len(frames) - 1
        else:
            depth = next((i for i in range(len(frames) - 1, -1, -1) if frames[i].module is fn), None)
        if depth is None:  # its pre-hook failed before the frame opened; the forward is failing
            return
        record = fwd.frames[depth]
        del fwd.frames[depth:]  # frames above it belong to calls an exception cut short
        self._hook_ctx.leave(depth)
        if record.undecided:
            self.saving.decide(record, fwd)
        if record.unit.layer_index is None and not fwd.frames:
            fwd.tail = record.unit  # e.g. a final logit soft-cap the model applies after lm_head
        if not fwd.register_outputs(output, record):  # the caller's own code may save them: through the hooks
            self._hook_ctx.enter(depth - 1, True)
        region = record.region
        if region is None:
            return
        region.subtree[record.order] = len(region.modules) - record.order
        if region.root is fn:  # a call that is its own region ends here
            fwd.region = None
            return
        parent = fwd.frames[-1] if fwd.frames else None
        if fwd.runs_again(fn, record.unit):
            return
        reached = fwd.rerun.get(("replay", fn), True) if parent is None else fwd.runs_again(parent.module, parent.unit)
        if reached:
            # the re-run reaches this call: hand out its output instead of running it, unless part of
            # the output is itself dropped (then the call runs again); restore the RNG state after it
            dropped = []

            def hold(t):
                value = self.saving.hold(t)
                dropped.append(isinstance(value, Dropped))
                return HeldInput(value, t.requires_grad)

            held = map_tensors(output, hold)
            if not any(dropped):
                region.replays[record.order] = held
                region.rng_after[record.order] = rng_like(region.rng)

    @contextlib.contextmanager
    def tracking(self):
        """Account saved tensors of code that drives unit modules directly (not through the root
        module's forward), e.g. decoder layers run one by one. No-op inside a root forward."""
        if self._fwd is not None or not torch.is_grad_enabled() or self._hands_off:
            yield
            return
        self._open_forward("tracking")
        try:
            yield
        finally:
            self._close_forward(merge=False)

    def call(self, unit_name: str, fn, *args, **kwargs):
        """Run `fn(*args, **kwargs)` as part of a unit: what it saves is kept, compressed or recomputed
        (by calling `fn` again) as that unit's plan says. For code outside the model's forward that
        belongs to a unit, e.g. the log-prob computation over the vocabulary, which is part of "head"."""
        unit = self._by_name.get(unit_name)
        if unit is None:
            raise ValueError(f"unknown unit {unit_name!r}; valid: {', '.join(u.name for u in self.units)}")
        if not torch.is_grad_enabled() or self._replay is not None or (self._hands_off and self._fwd is None):
            return fn(*args, **kwargs)
        standalone = self._fwd is None
        if standalone:
            self._open_forward("call")
            self._fwd.inputs_of = unit  # e.g. the logits verl's log-prob code saves: made by lm_head, the head's
        try:
            self._enter(fn, unit, args, kwargs)
            output = None
            try:
                output = fn(*args, **kwargs)
            finally:
                self._exit(fn, output)
        finally:
            if standalone:
                self._close_forward(merge=True)
        return output

    # ------------------------------------------------------------------ recompute
    def _rerun(self, region: Region) -> None:
        replay = Replay(region)
        outer, self._replay = self._replay, replay
        try:
            with self._unit_hooks_for_recompute():
                rerun(region, replay, replay.pack, unpack)  # the re-run's saves are the replay's
        finally:
            self._replay = outer


_ATTACHED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


def attach(model: nn.Module, config: RuntimeConfig | None = None) -> Runtime:
    """Find the model's recovery units and install the runtime's hooks; every unit starts on "keep"."""
    if model in _ATTACHED:
        raise ValueError(f"a hilore-verl runtime is already attached to this {type(model).__name__}; "
                         "call detach() on it first")
    runtime = Runtime(model, find_units(model), config or RuntimeConfig())
    try:
        runtime._install()
    except Exception:
        runtime.detach()
        raise
    _ATTACHED.add(model)
    return runtime
