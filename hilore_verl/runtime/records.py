"""What the runtime holds between forward and backward, and how a dropped tensor is regenerated.

A saved tensor is held as one of:
  - `Kept`: a detached alias of the tensor (KEEP, and everything the runtime does not manage);
  - `Checked(Compressed)`: a quantized payload, dequantized on unpack (`offload.Offloaded` when it
    waits in host memory; `finite_checks.Unchecked` around either while its inf / nan check is on its
    way to the host);
  - `Dropped`: a reference to the `CallRecord` of the module call that produced it and where the
    tensor appears in that call (a locator); unpack re-runs the call's `Region` once (a decoder
    block, or the call itself) and hands out the result.
Each checks on unpack that the tensor was not changed in place after it was saved, as autograd
does for tensors saved without hooks, and raises autograd's error if it was.

Locators, all relative to one call of a unit's module:
  ("own", n)          the n-th tensor saved by the module's own code (not inside a child unit's module)
  ("out", path)       the call's output at `path`
  ("child_in", j, p)  the input at path `p` of the call's j-th child unit-module call
A saved view of a boundary tensor (an output or child input) keeps its geometry relative to it.
"""

from __future__ import annotations

import copy

import weakref
from typing import Any, Callable

import torch

from hilore_verl.kernels import QuantizedTensor

Geometry = tuple[torch.Size, tuple[int, ...], int]  # size, stride, storage offset relative to the anchor


def geometry_of(t: torch.Tensor, anchor: torch.Tensor) -> Geometry | None:
    """None when `t` has the anchor's exact view (the common case), else how to re-view the anchor."""
    if t.shape == anchor.shape and t.stride() == anchor.stride() and t.storage_offset() == anchor.storage_offset():
        return None
    return t.shape, t.stride(), t.storage_offset() - anchor.storage_offset()


def apply_geometry(t: torch.Tensor, geometry: Geometry | None) -> torch.Tensor:
    if geometry is None:
        return t
    size, stride, rel = geometry
    return t.as_strided(size, stride, t.storage_offset() + rel)


def storage_id(t: torch.Tensor):
    """The storage's address. Meta tensors (shape-only planning) have no data address: their storage
    object's (the StorageImpl's) address stands in, shared by views and alive as long as any of them.
    (A Python id of `t._base` is not: a base's Python object can die while its views live, and
    `_base` then hands out a new object, whose id another tensor may have had.)"""
    if t.is_meta:
        return "meta", t.untyped_storage()._cdata
    return t.untyped_storage().data_ptr()


def storage_key(t: torch.Tensor) -> tuple:
    """One distinct view at one version: storage, offset, shape, stride, dtype, version counter (a
    tensor changed in place between two saves is two different saved values)."""
    return storage_id(t), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t._version


def version_error(t: torch.Tensor | None, description: str, version: int, expected: int) -> RuntimeError:
    """The error autograd raises for a saved tensor changed in place (hooks turn autograd's own check off)."""
    what = f"{t.type()} {list(t.shape)}" if t is not None else description
    return RuntimeError(
        f"one of the variables needed for gradient computation has been modified by an inplace operation: "
        f"[{what}] is at version {version}; expected version {expected} instead. Hint: enable anomaly "
        f"detection to find the operation that failed to compute its gradient, with "
        f"torch.autograd.set_detect_anomaly(True). (checked by hilore-verl's runtime)")


class Kept:
    """A saved tensor held as it is: a detached alias, which shares the tensor's storage and version
    counter but not its autograd node. Returning the tensor itself from a pack hook ties the node
    that saves a tensor to the tensor's own grad_fn (a cycle through C++ that Python's collector
    cannot free: an abandoned graph would leak), and hooks switch autograd's version check off; both
    are restored here."""

    __slots__ = ("tensor", "version")

    def __init__(self, t: torch.Tensor, alias: bool = True):
        self.tensor = t.detach() if alias else t
        self.version = t._version

    def get(self) -> torch.Tensor:
        if self.tensor._version != self.version:
            raise version_error(self.tensor, "", self.tensor._version, self.version)
        return self.tensor


class VersionWatch:
    """The version counter of a tensor the runtime did not keep (compressed or dropped), watched
    without holding its memory: a detached alias of the tensor's base lives exactly as long as the
    base does, and the counter's last value is read when the base is freed. A change made through a
    view that outlives its base is not seen."""

    __slots__ = ("version", "box", "ref", "dtype", "shape")

    def __init__(self, t: torch.Tensor):
        base = t._base if t._base is not None else t
        self.version = t._version
        self.dtype, self.shape = t.dtype, t.shape  # formatted only for an error (pack is a hot path)
        box = [base.detach(), None]  # [alias while the base lives, the counter's value when it died]

        def freed(_ref, box=box):
            box[1], box[0] = box[0]._version, None

        self.box = box
        self.ref = weakref.ref(base, freed)

    def check(self) -> None:
        alias, final = self.box
        current = alias._version if alias is not None else final
        if current != self.version:
            raise version_error(None, f"{self.dtype} {list(self.shape)}", current, self.version)


class Checked:
    """A compressed payload (or its offloaded copy) with the version watch of the tensor it holds.

    A region's re-run that hands out this payload as a replayed output decodes it; the saves of
    the same payload not yet unpacked in this backward then get that tensor (`shared`) instead of
    decoding their own copy: one decode and one copy in memory while the layer runs backward."""

    __slots__ = ("held", "watch", "saves", "unpacked", "shared")

    def __init__(self, held: Any, watch: VersionWatch):
        self.held = held
        self.watch = watch
        self.saves = 0  # autograd saves holding this payload (set by the runtime)
        self.unpacked = 0
        self.shared: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return self.held.nbytes

    def get(self) -> torch.Tensor:
        self.watch.check()
        self.unpacked += 1
        t = self.shared
        if t is None:
            return self.held.get()
        if self.unpacked >= self.saves:  # its last save in this backward: let it go
            self.shared = None
        return t

    def decode_for_replay(self) -> torch.Tensor:
        self.watch.check()
        t = self.shared if self.shared is not None else self.held.get()
        if self.unpacked < self.saves:  # saves of it are still to come in this backward
            self.shared = t
        return t


class LiveKeyMap:
    """storage key -> value, valid only while the tensor it was stored for is alive.

    Once a tensor is freed, the allocator may give its address to a later tensor of the same
    shape; a plain dict keyed by address would then hand the old value to the new tensor.
    """

    def __init__(self):
        self._items: dict[tuple, tuple[weakref.ref, Any]] = {}

    def get(self, key: tuple) -> Any:
        hit = self._items.get(key)
        if hit is None or hit[0]() is None:
            return None
        return hit[1]

    def put(self, key: tuple, t: torch.Tensor, value: Any) -> None:
        # Watch the base: ops often save a fresh view object (x.view(-1, H)) that dies at once,
        # while the tensor it views, and so the address, stays alive.
        self._items[key] = (weakref.ref(t._base if t._base is not None else t), value)


class Compressed:
    """A quantized payload on the tensor's device; `shape` is the saved tensor's (the payload may
    group a contiguous tensor over its flat elements)."""

    __slots__ = ("payload", "shape")

    def __init__(self, payload: QuantizedTensor, shape: torch.Size):
        self.payload = payload
        self.shape = shape

    @property
    def nbytes(self) -> int:
        return self.payload.nbytes

    def get(self) -> torch.Tensor:
        return self.payload.dequantize().view(self.shape)


class Region:
    """A call re-run as a whole in backward: a decoder block with a top-level unit that recomputes
    (as non-reentrant checkpoint re-runs a layer), or one recompute unit's call elsewhere.

    It holds the call's inputs, RNG and autocast state, and, per unit-module call inside it in
    forward order (pre-order), the module, the size of its subtree of calls and, for a call that
    is not re-run (its units keep or compress), the output to hand out instead. Records are held
    weakly: a record dies with the last handle that needs it, and a region never ties a graph to
    itself through a cycle."""

    __slots__ = ("root", "inputs", "rng", "autocast", "modules", "subtree", "replays", "rng_after", "records",
                 "recompute", "top")

    def __init__(self, root: Any):
        self.root = root  # the block module, or the root record's module / function
        self.inputs: tuple[tuple, dict] | None = None  # args / kwargs with tensors held
        self.rng: dict | None = None
        self.autocast: list[tuple[str, bool, torch.dtype]] = []
        self.modules: list[Any] = []
        self.subtree: list[int] = []  # calls in the subtree of call k, itself included
        self.replays: list[Any] = []  # held output of call k when it is not re-run, else None
        self.rng_after: list[dict | None] = []  # with a held output: the RNG state the call left
        self.records: list[weakref.ref] = []
        self.recompute: Callable[["Region"], None] | None = None  # set by the runtime
        # a block region's own code, as the producer of what it hands its outermost calls (order -1)
        self.top: weakref.ref | None = None

    def add(self, record: "CallRecord") -> None:
        record.region, record.order = self, len(self.modules)
        self.modules.append(record.module)
        self.subtree.append(1)
        self.replays.append(None)
        self.rng_after.append(None)
        self.records.append(weakref.ref(record))

    def live(self):
        """(order, record) for every record still alive; the block's own code is order -1."""
        top = self.top() if self.top is not None else None
        if top is not None:
            yield -1, top
        for k, ref in enumerate(self.records):
            record = ref()
            if record is not None:
                yield k, record


class CallRecord:
    """One forward call of a unit's module inside a region: where to find its tensors again."""

    __slots__ = ("module", "unit", "region", "order", "child_count", "own_count", "regen", "pending", "handles",
                 "rows", "undecided", "__weakref__")

    def __init__(self, module: torch.nn.Module, unit: Any):
        self.module = module
        self.unit = unit
        self.region: Region | None = None
        self.order = -1  # position in the region's calls
        self.child_count = 0  # direct child unit-module calls so far (the j of ("child_in", j, path))
        self.own_count = 0
        self.regen: dict | None = None  # locator -> regenerated tensor, while handles are pending
        self.handles: dict = {}  # locator -> handles dropped for it in forward
        self.pending: dict = {}  # locator -> handles not yet unpacked in this backward
        self.rows: Any = None  # row shapes of the call's float inputs and saves so far (saving.RowShapes)
        self.undecided: list | None = None  # saves whose holding waits for the call's end (saving.Undecided)

    def drop(self, locator: tuple, geometry: Geometry | None, watch: "VersionWatch") -> "Dropped":
        self.handles[locator] = self.handles.get(locator, 0) + 1
        self.pending[locator] = self.pending.get(locator, 0) + 1
        return Dropped(self, locator, geometry, watch)

    def take(self, locator: tuple) -> torch.Tensor:
        if self.regen is None or locator not in self.regen:
            region = self.region
            if locator not in self.pending:  # a further backward through a retained graph: every handle again
                for _, record in region.live():
                    record.pending = dict(record.handles)
            region.recompute(region)  # fills `regen` of every record of the region with pending handles
        t = self.regen[locator]
        left = self.pending.get(locator, 1) - 1
        if left <= 0:  # last handle for it: let it go (a second backward would recompute again)
            self.pending.pop(locator, None)
            self.regen.pop(locator, None)
        else:
            self.pending[locator] = left
        return t


class Dropped:
    __slots__ = ("record", "locator", "geometry", "watch")

    def __init__(self, record: CallRecord, locator: tuple, geometry: Geometry | None, watch: VersionWatch):
        self.record = record
        self.locator = locator
        self.geometry = geometry
        self.watch = watch

    def get(self) -> torch.Tensor:
        self.watch.check()
        return apply_geometry(self.record.take(self.locator), self.geometry)


# The walk below is written out, not torch.utils._pytree's: it runs in every unit call's pre- and
# post-hook, where pytree measured 8x slower per call on a decoder layer's (args, kwargs) (26.5 against
# 3.3 us; map_tensors 18.6 against 4.3 us), and pytree treats namedtuples, transformers' ModelOutput and
# other subclasses unlike the paths the runtime records (it would need an adapter for them).
def tensor_leaves(tree: Any, path: tuple = (), out: list | None = None) -> list[tuple[tuple, torch.Tensor]]:
    """(path, tensor) for every tensor in nested tuples / lists / dicts, in order (a list: the walk runs
    in every unit call's hooks, where nested generators cost more than the walk)."""
    if out is None:
        out = []
    if isinstance(tree, torch.Tensor):
        out.append((path, tree))
    elif isinstance(tree, (tuple, list)):
        for i, item in enumerate(tree):
            if item is not None:
                tensor_leaves(item, path + (i,), out)
    elif isinstance(tree, dict):
        for key, item in tree.items():
            if item is not None:
                tensor_leaves(item, path + (key,), out)
    return out


def map_tree(tree: Any, fn: Callable[[Any], Any], is_leaf: Callable[[Any], bool]) -> Any:
    """Rebuild nested tuples / namedtuples / lists / dicts with `fn` applied to every leaf."""
    if is_leaf(tree):
        return fn(tree)
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        return type(tree)(*(map_tree(x, fn, is_leaf) for x in tree))
    if isinstance(tree, (tuple, list)):
        return type(tree)(map_tree(x, fn, is_leaf) for x in tree)
    if isinstance(tree, dict):
        mapped = {k: map_tree(v, fn, is_leaf) for k, v in tree.items()}
        if type(tree) is dict:
            return mapped
        out = copy.copy(tree)  # a dict subclass keeps its type (a model's ModelOutput: `.logits` still works)
        for k, v in mapped.items():
            out[k] = v
        return out
    return tree


def map_tensors(tree: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    return map_tree(tree, fn, lambda x: isinstance(x, torch.Tensor))
