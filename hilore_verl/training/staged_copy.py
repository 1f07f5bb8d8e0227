"""Copies of device tensors into pageable host memory through a small pinned ring, off the training thread.

The optimizer step's undo copy (snapshots.StepSnapshot) is 12 bytes per parameter of the rank's shard
(fp32 parameter and two Adam moments): 10.5 GB per rank for Qwen2.5-7B on 8 GPUs. Held pinned, that is
84 GB of page-locked memory per node beside verl's own offload (and torch's pinned allocator rounds each
block up to a power of two). Here the copies land in pageable buffers of exactly their size, through a
ring of `SLOTS` pinned slots of `SLOT_BYTES` (256 MiB pinned in all, whatever the model's size):

    worker thread, per piece of at most SLOT_BYTES:   device -> slot (side stream, non-blocking)
                                                      slot -> pageable buffer (host, once the piece's
                                                      event has completed, freeing the slot)

The copies are queued behind the work the device had queued when `start` was called (the last
optimizer step) and overlap the mini-batch's forward and backward; `queued()` returns once every
device copy is queued (the worker can queue a piece only when its slot is free, so the ring throttles
it: about bytes / min(PCIe, host memcpy bandwidth) after `start`), `wait_device()` makes the current
stream wait for them on the device, and `finish()` waits until every byte is in its buffer. On the host
(CPU tensors) the same pipeline runs with synchronous copies.
"""

from __future__ import annotations

import collections
import threading

import torch

SLOT_BYTES = 128 * 2**20
SLOTS = 2


def device_module(device: torch.device):
    """The accelerator module (torch.cuda, torch.npu, ...) whose streams copy a tensor on `device`; None for
    the host, where copies are made inline."""
    return None if device.type == "cpu" else torch.get_device_module(device.type)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor's storage span."""
    return t.detach().reshape(-1).view(torch.uint8)


class StagedCopy:
    def __init__(self, slot_bytes: int = SLOT_BYTES, slots: int = SLOTS):
        if slot_bytes < 1 or slots < 1:
            raise ValueError("need slot_bytes >= 1 and slots >= 1")
        self.slot_bytes, self.slots = slot_bytes, slots
        self._rings: dict[torch.device, list[torch.Tensor]] = {}
        self._streams: dict[torch.device, object] = {}
        self._thread: threading.Thread | None = None
        self._queued = threading.Event()
        self._error: BaseException | None = None
        self.done = None  # the device event after the last device copy (None on the host)
        self.device: torch.device | None = None

    @property
    def ring_bytes(self) -> int:
        return sum(s.numel() for ring in self._rings.values() for s in ring)

    @property
    def pinned_bytes(self) -> int:
        """Page-locked host memory the ring holds (0 for host tensors, whose slots are pageable)."""
        return sum(s.numel() for ring in self._rings.values() for s in ring if s.is_pinned())

    def start(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy each (source, destination) pair's bytes, sources on one device, destinations pageable host
        buffers of the same size; returns at once (a worker thread does the copies)."""
        self.finish()  # the last copy, long landed by now
        self._queued.clear()
        self._error, self.done = None, None
        device = pairs[0][0].device if pairs else torch.device("cpu")
        if any(src.device != device for src, _ in pairs):
            raise ValueError("every source of one staged copy must be on one device")
        self.device = device
        dm = device_module(device)
        start = None
        if dm is not None:  # behind the work already queued, which wrote the sources
            start = dm.Event()
            start.record(dm.current_stream(device))
        self._thread = threading.Thread(target=self._run, args=(pairs, device, dm, start), daemon=True,
                                        name="hilore-staged-copy")
        self._thread.start()

    def queued(self) -> None:
        """Wait (on the host) until every device copy is queued; raises the worker's error."""
        if self._thread is not None:
            while not self._queued.wait(0.05):
                if not self._thread.is_alive():
                    break
        self._raise()

    def wait_device(self) -> None:
        """After `queued()`: the current stream waits, on the device, for every device copy."""
        self.queued()
        if self.done is not None:
            device_module(self.device).current_stream(self.device).wait_event(self.done)

    def finish(self) -> None:
        """Wait until every byte is in its destination; raises the worker's error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._raise()

    def _raise(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"hilore-verl: the staged host copy failed: {error}") from error

    def _ring(self, device: torch.device) -> list[torch.Tensor]:
        ring = self._rings.get(device)
        if ring is None:
            pin = device.type != "cpu" and torch.cuda.is_available()
            ring = self._rings[device] = [torch.empty(self.slot_bytes, dtype=torch.uint8, pin_memory=pin)
                                          for _ in range(self.slots)]
        return ring

    def _run(self, pairs, device, dm, start) -> None:
        try:
            ring = self._ring(device)
            stream = None
            if dm is not None:
                stream = self._streams.get(device)
                if stream is None:
                    stream = self._streams[device] = dm.Stream(device)
                stream.wait_event(start)
            pending: collections.deque = collections.deque()  # (slot, event, destination bytes)
            k = 0
            for src, dst in pairs:
                source, target = as_bytes(src), as_bytes(dst)
                if source.numel() != target.numel():
                    raise ValueError(f"a destination of {target.numel()} bytes for {source.numel()}")
                for a in range(0, source.numel(), self.slot_bytes):
                    piece = source[a:a + self.slot_bytes]
                    if len(pending) == self.slots:
                        self._land(pending.popleft())  # frees the slot this piece takes
                    slot = ring[k % self.slots][:piece.numel()]
                    k += 1
                    event = None
                    if dm is None:
                        slot.copy_(piece)
                    else:
                        with dm.stream(stream):
                            slot.copy_(piece, non_blocking=True)
                            event = dm.Event()
                            event.record(stream)
                    pending.append((slot, event, target[a:a + piece.numel()]))
            if dm is not None:
                self.done = dm.Event()
                self.done.record(stream)
            self._queued.set()
            while pending:
                self._land(pending.popleft())
        except BaseException as err:  # handed to the training thread by queued() / finish()
            self._error = err
        finally:
            self._queued.set()

    @staticmethod
    def _land(item) -> None:
        slot, event, target = item
        if event is not None:
            event.synchronize()  # the device copy into the slot has completed
        target.copy_(slot)


__all__ = ["SLOTS", "SLOT_BYTES", "StagedCopy", "as_bytes"]
