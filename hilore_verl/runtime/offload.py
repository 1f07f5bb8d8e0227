"""Host offload of compressed payloads: device -> host in forward, host -> device in backward.

One code path for every device. On CUDA: pinned host buffers from a bounded pool, copies on a
side stream ordered against the compute stream by events, and, when backward fetches a payload,
a prefetch of the one offloaded just before it (the next one backward needs). On the CPU the
same calls run synchronously (torch.cpu streams and events are no-ops), which is how the logic is
tested without a GPU.
"""

from __future__ import annotations

import itertools
import weakref
from collections import deque

import torch

from hilore_verl.kernels import QuantizedTensor

MIN_CLASS = 512  # bytes: the smallest buffer
ALIGN = 16  # bytes: where a payload's scales start in its buffer


def size_class(nbytes: int) -> int:
    """The buffer size for `nbytes`: the next power of two (torch's pinned-memory allocator rounds
    every block up to one, so finer classes would hold no less host memory)."""
    return max(MIN_CLASS, 1 << (max(nbytes, 1) - 1).bit_length())


class OffloadPool:
    """Flat host byte buffers (uint8) by size class, each viewed as the dtypes and shapes one payload
    needs, so payloads of equal size and different shapes share buffers. A buffer is reused once the
    copy that last used it has completed (its event). Bounded: before a new buffer is allocated, idle
    buffers are freed, oldest first, until the pool would hold no more than the most it has had in use
    at once; token counts that vary from step to step do not grow host memory."""

    def __init__(self, device: torch.device):
        self.device = device
        self.dm = torch.get_device_module(device.type)
        self.pinned = device.type == "cuda"
        self.stream = self.dm.Stream(device) if self.pinned else self.dm.Stream()  # on the payloads' device
        self.free: dict[int, deque[tuple[int, torch.Tensor, object]]] = {}  # class -> (stamp, buffer, event)
        self.allocated = 0  # buffers ever allocated (reuse keeps this flat across steps)
        self.in_use_bytes = 0  # buffers handed out and not released
        self.idle_bytes = 0
        self.peak_bytes = 0  # the most bytes of host buffers held at once
        self._stamps = itertools.count()  # release order, for freeing the oldest idle buffer first
        self.last: weakref.ref | None = None  # the most recently offloaded payload, for prefetch links

    @property
    def held_bytes(self) -> int:
        """Host buffers held now, in use and idle."""
        return self.in_use_bytes + self.idle_bytes

    def acquire(self, nbytes: int) -> torch.Tensor:
        """A flat uint8 buffer of at least `nbytes`, no longer read or written by any copy."""
        size = size_class(nbytes)
        bucket = self.free.get(size)
        for i, (_, buf, event) in enumerate(bucket or ()):
            if event is None or event.query():
                del bucket[i]
                self.idle_bytes -= size
                self.in_use_bytes += size
                return buf
        # freeing a buffer whose copy still runs is safe: torch's host allocator reuses its block only
        # after the events its copies recorded
        self._free_idle(max(self.peak_bytes - size, self.in_use_bytes) - self.in_use_bytes)
        buf = torch.empty(size, dtype=torch.uint8, pin_memory=self.pinned)
        self.allocated += 1
        self.in_use_bytes += size
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)
        return buf

    def release(self, buf: torch.Tensor, event) -> None:
        """`buf` is idle once `event` (None: now) has completed."""
        size = buf.numel()
        self.free.setdefault(size, deque()).append((next(self._stamps), buf, event))
        self.in_use_bytes -= size
        self.idle_bytes += size

    def _free_idle(self, room: int) -> None:
        """Free idle buffers, oldest first, until at most `room` bytes of them remain."""
        while self.idle_bytes > room:
            size = min((bucket[0][0], s) for s, bucket in self.free.items() if bucket)[1]
            self.free[size].popleft()
            self.idle_bytes -= size

    def offload(self, payload: QuantizedTensor, shape: torch.Size) -> "Offloaded":
        codes, scales = payload.codes, payload.scales
        at = -(-codes.nbytes // ALIGN) * ALIGN
        buf = self.acquire(at + scales.nbytes)
        host_codes = buf[:codes.nbytes].view(codes.dtype).view(codes.shape)
        host_scales = buf[at:at + scales.nbytes].view(scales.dtype).view(scales.shape)
        compute = self.dm.current_stream(self.device)
        with self.dm.stream(self.stream):
            self.stream.wait_stream(compute)  # the payload is written on the compute stream
            host_codes.copy_(codes, non_blocking=True)
            host_scales.copy_(scales, non_blocking=True)  # flags stay behind: tiny, and never decoded
            done = self.dm.Event()
            done.record(self.stream)
        if self.pinned:  # the device payload may be freed now: the allocator waits for the side stream
            codes.record_stream(self.stream)
            scales.record_stream(self.stream)
        handle = Offloaded(self, buf, host_codes, host_scales, payload, shape, done)
        handle.previous = self.last
        self.last = weakref.ref(handle)
        return handle


class Offloaded:
    """A payload in host memory; `get()` brings it back (or takes the prefetched copy) and decodes it."""

    __slots__ = ("pool", "buffer", "host_codes", "host_scales", "flags", "payload_shape", "shape", "dtype", "fmt",
                 "group_size", "to_host", "fetched", "fetch_done", "previous", "__weakref__")

    def __init__(self, pool: OffloadPool, buffer, host_codes, host_scales, payload: QuantizedTensor, shape, to_host):
        self.pool, self.buffer = pool, buffer
        self.host_codes, self.host_scales = host_codes, host_scales
        self.flags = payload.flags  # tiny, stays on the device
        self.payload_shape, self.shape = payload.shape, shape
        self.dtype, self.fmt, self.group_size = payload.dtype, payload.fmt, payload.group_size
        self.to_host = to_host
        self.fetched: QuantizedTensor | None = None
        self.fetch_done = None
        self.previous: weakref.ref | None = None

    def prefetch(self) -> None:
        if self.fetched is not None:
            return
        pool = self.pool
        with pool.dm.stream(pool.stream):
            pool.stream.wait_event(self.to_host)
            codes = self.host_codes.to(pool.device, non_blocking=True, copy=True)
            scales = self.host_scales.to(pool.device, non_blocking=True, copy=True)
            self.fetch_done = pool.dm.Event()
            self.fetch_done.record(pool.stream)
        self.fetched = QuantizedTensor(codes, scales, self.flags, self.payload_shape, self.dtype, self.fmt,
                                       self.group_size)

    def get(self) -> torch.Tensor:
        self.prefetch()
        compute = self.pool.dm.current_stream(self.pool.device)
        compute.wait_event(self.fetch_done)
        if self.pool.pinned:
            self.fetched.codes.record_stream(compute)
            self.fetched.scales.record_stream(compute)
        previous = self.previous() if self.previous is not None else None
        if previous is not None:
            previous.prefetch()  # backward runs in reverse: the payload offloaded before this one is next
        return self.fetched.dequantize().view(self.shape)

    @property
    def nbytes(self) -> int:
        """The payload's bytes (codes, scales, flags), as a payload held on the device counts them."""
        return sum(t.numel() * t.element_size() for t in (self.host_codes, self.host_scales, self.flags))

    def __del__(self):
        try:
            self.pool.release(self.buffer, self.fetch_done or self.to_host)
        except Exception:  # interpreter shutdown
            pass
