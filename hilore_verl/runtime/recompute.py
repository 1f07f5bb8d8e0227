"""Re-running a region in backward: one decoder block (or one unit call) from its held inputs.

The region's root runs again under the RNG and autocast state it first ran with, as
non-reentrant checkpoint re-runs a layer. Its unit-module calls happen in the order they did in
forward; the k-th is matched to the k-th recorded call, and a call that is not re-run (its units
keep or compress) returns its held output instead of running. Per call, what its own code saves
is captured by order, the inputs of its child calls and its outputs by position, and only what a
pending handle still needs is kept, and the re-run stops as soon as it has all of that (the rest
of the block, e.g. its last projection, does not run), as checkpoint's early stop does.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn

from hilore_verl.runtime.plan import Mode
from hilore_verl.runtime.records import Checked, Region, map_tree, tensor_leaves

CACHE_KWARGS = ("past_key_values", "past_key_value")


class Reruns:
    """Which calls run again in backward under a plan, from the units' module structure. Per unit module:
    whether its call runs again (its unit, or a unit called inside it, recomputes). Per block: whether
    it is one region (any of its outermost unit calls runs again: a mixed layer re-runs once, its kept
    and compressed calls replayed). Per outermost call that does not run again: ("replay", module),
    whether a call after it in the block does (its output is then held for the re-run; after the last
    re-run call the re-run has stopped). The last plan list's answer is cached (plans change per
    micro-batch, forwards happen per call)."""

    def __init__(self, units, module_unit: dict[nn.Module, Any]):
        # unit indices whose calls run inside each unit module's call, its own included
        self.subtree = {m: tuple({module_unit[d].index for d in m.modules() if d in module_unit})
                        for m in module_unit}
        self.blocks: dict[nn.Module, list[nn.Module]] = {}  # decoder block -> its outermost unit modules
        for block in {id(u.block): u.block for u in units if u.block is not None}.values():
            mods = [m for u in units if u.block is block for m in u.modules]
            self.blocks[block] = [m for m in mods if not any(p is not m and any(d is m for d in p.modules())
                                                             for p in mods)]
        self._cache: tuple[list | None, dict] = (None, {})

    def of(self, plans: list) -> dict:
        """The rerun map for `plans` (one UnitPlan per unit, by index)."""
        cached_plans, rerun = self._cache
        if cached_plans is not plans:
            rerun = {m: any(plans[i].mode == Mode.RECOMPUTE for i in subtree) for m, subtree in self.subtree.items()}
            for block, tops in self.blocks.items():
                runs = [rerun[m] for m in tops]
                rerun[block] = any(runs)
                last = max((j for j, r in enumerate(runs) if r), default=-1)
                rerun.update({("replay", m): j < last for j, m in enumerate(tops) if not runs[j]})
            self._cache = (plans, rerun)
        return rerun

    def whole_blocks(self, plans: list) -> int:
        """Blocks whose every outermost unit call runs again: those hold only their inputs."""
        rerun = self.of(plans)
        return sum(bool(tops) and all(rerun[m] for m in tops) for tops in self.blocks.values())


@dataclass
class HeldInput:
    """A tensor a later recompute needs: held by its producer's mode, plus its requires_grad."""
    value: Any  # tensor, Compressed, Offloaded or Dropped
    requires_grad: bool


class _Frame:
    __slots__ = ("order", "held", "own", "children")

    def __init__(self, order: int, held: Any):
        self.order, self.held, self.own, self.children = order, held, 0, 0


class Replay:
    """State of one region's re-run: which recorded call runs now and what it captures."""

    def __init__(self, region: Region):
        self.region = region
        self.cursor = 0
        self.frames: list[_Frame] = []
        self.top = _Frame(-1, None)  # the block's own code: the parent of its outermost calls
        self.wanted = {k: record.pending for k, record in region.live() if record.pending}
        self.regen: dict[int, dict] = {k: {} for k in self.wanted}
        self.missing = sum(len(w) for w in self.wanted.values())
        self.done = False

    def _capture(self, order: int, locator: tuple, t: torch.Tensor) -> None:
        regen = self.regen[order]
        if locator not in regen:
            self.missing -= 1
        regen[locator] = t

    def _stop_if_done(self) -> None:
        if self.missing <= 0:
            self.done = True
            raise _Done

    def _diverged(self, module) -> RuntimeError:
        name = type(self.region.root).__name__ if isinstance(self.region.root, nn.Module) else "a function"
        return RuntimeError(f"hilore-verl: recomputing {name} in backward diverged from its forward at unit call "
                            f"{self.cursor} ({type(module).__name__}): the forward must make the same module calls "
                            "when run again with the same inputs and RNG state")

    def pre(self, module, args, kwargs) -> None:
        k, region = self.cursor, self.region
        if k >= len(region.modules) or region.modules[k] is not module:
            raise self._diverged(module)
        held = region.replays[k]
        self.cursor = k + (region.subtree[k] if held is not None else 1)  # a replayed call's children do not run
        parent = self.frames[-1] if self.frames else self.top
        if parent.held is None:
            j, parent.children = parent.children, parent.children + 1
            wanted = self.wanted.get(parent.order)
            if wanted is not None:
                for path, t in tensor_leaves((args, kwargs)):
                    if ("child_in", j, path) in wanted:
                        self._capture(parent.order, ("child_in", j, path), t.detach())
        self.frames.append(_Frame(k, held))
        self._stop_if_done()

    def post(self, output) -> None:
        if self.done:  # the re-run is stopping: post hooks run as _Done unwinds
            if self.frames:
                self.frames.pop()
            return
        frame = self.frames.pop()
        wanted = self.wanted.get(frame.order)
        if wanted is not None and frame.held is None:
            for path, t in tensor_leaves(output):
                if ("out", path) in wanted:
                    self._capture(frame.order, ("out", path), t.detach())
            self._stop_if_done()

    def pack(self, t: torch.Tensor) -> "_NotForBackward":
        """Capture a save of the re-run. The re-run's own graph is never differentiated (its outputs
        are detached), so its nodes get a placeholder: holding `t` there would tie an output to its
        own grad_fn through C++ (a cycle Python's collector cannot see) and leak every re-run."""
        frame = self.frames[-1] if self.frames else None
        if frame is not None and frame.held is None:  # a call's own code: its n-th save, as in forward
            n, frame.own = frame.own, frame.own + 1
            wanted = self.wanted.get(frame.order)
            if wanted is not None and ("own", n) in wanted:
                self._capture(frame.order, ("own", n), t.detach() if t.requires_grad else t)
                self._stop_if_done()
        return _NOT_FOR_BACKWARD

    def replayed_output(self, module) -> Any:
        """The held output to return instead of running `module`, or None to run it. The RNG is left
        as the call left it in forward (a replayed dropout draws nothing; what runs after it must
        draw what it drew in forward)."""
        if self.frames and self.frames[-1].held is not None and self.region.modules[self.frames[-1].order] is module:
            set_rng(self.region.rng_after[self.frames[-1].order])
            return materialize(self.frames[-1].held)
        return None

    def finish(self, stopped: bool) -> None:
        """Hand each pending record what it needs; a call the re-run did not make is an error."""
        if not stopped and (self.missing > 0 or self.cursor != len(self.region.modules)):
            module = self.region.modules[self.cursor] if self.cursor < len(self.region.modules) else self.region.root
            raise self._diverged(module)
        for k, record in self.region.live():
            if k in self.regen:
                record.regen = self.regen[k]


class _Done(Exception):
    """Raised inside the re-run once every tensor it is needed for has been captured."""


class _NotForBackward:
    """What a re-run's graph holds instead of its saved tensors."""

    __slots__ = ()

    def get(self):
        raise RuntimeError("hilore-verl: a recompute's internal graph was differentiated; it is not meant to be")


_NOT_FOR_BACKWARD = _NotForBackward()


def rerun(region: Region, replay: Replay, pack: Callable, unpack: Callable) -> None:
    """Run the region's root again; each pending record of the region gets its regenerated tensors."""
    args, kwargs = materialize(region.inputs)
    for key in CACHE_KWARGS:  # recompute must never touch an inference cache
        if kwargs.get(key) is not None:
            kwargs[key] = None
    if "use_cache" in kwargs:
        kwargs["use_cache"] = False
    stopped = False
    with ExitStack() as stack:
        devices = [d for d in region.rng if d != "cpu"]
        stack.enter_context(torch.random.fork_rng(devices=devices, device_type="cuda" if devices else "cpu"))
        set_rng(region.rng)
        for device_type, enabled, dtype in region.autocast:
            stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled))
        stack.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, unpack))
        stack.enter_context(torch.enable_grad())
        try:
            if isinstance(region.root, nn.Module):
                region.root(*args, **kwargs)
            else:  # a function run through Runtime.call: no module hooks
                replay.pre(region.root, args, kwargs)
                replay.post(region.root(*args, **kwargs))
        except _Done:
            stopped = True
    replay.finish(stopped)


def materialize(held_tree):
    """Tensors back from what `HeldInput`s hold, detached, with their original requires_grad."""
    return map_tree(held_tree, _materialize_one, lambda x: isinstance(x, HeldInput))


def _materialize_one(held: HeldInput) -> torch.Tensor:
    value = held.value
    if isinstance(value, Checked):  # shared with the saves of the same payload still to be unpacked
        t = value.decode_for_replay().detach()
    else:
        t = (value if isinstance(value, torch.Tensor) else value.get()).detach()
    return t.requires_grad_(held.requires_grad) if held.requires_grad else t


def rng_state(inputs) -> dict:
    """CPU generator state, and each CUDA device's the inputs live on."""
    state = {"cpu": torch.get_rng_state()}
    for _, t in tensor_leaves(inputs):
        if t.is_cuda and t.device.index not in state:
            state[t.device.index] = torch.cuda.get_rng_state(t.device)
    return state


def rng_like(state: dict) -> dict:
    """The generators' states now, for the devices of `state` (what `rng_state` captured)."""
    return {d: torch.get_rng_state() if d == "cpu" else torch.cuda.get_rng_state(d) for d in state}


def set_rng(state: dict | None) -> None:
    for d, value in (state or {}).items():
        if d == "cpu":
            torch.set_rng_state(value)
        else:
            torch.cuda.set_rng_state(value, d)


def autocast_state() -> list[tuple[str, bool, torch.dtype]]:
    return [(d, True, torch.get_autocast_dtype(d)) for d in ("cpu", "cuda") if torch.is_autocast_enabled(d)]
