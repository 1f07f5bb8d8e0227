"""Host offload of compressed payloads: device -> host in forward, host -> device in backward.

One code path for every device. On CUDA: pinned host buffers from a reusable pool, copies on a
side stream ordered against the compute stream by events, and, when backward fetches a payload,
a prefetch of the one offloaded just before it (the next one backward needs). On the CPU the
same calls run synchronously (torch.cpu streams and events are no-ops), which is how the logic is
tested without a GPU.
"""

from __future__ import annotations

import weakref

import torch

from hilore_verl.kernels import QuantizedTensor


class OffloadPool:
    """Host buffers by size, reused once the copy that last used them has completed."""

    def __init__(self, device: torch.device):
        self.device = device
        self.dm = torch.get_device_module(device.type)
        self.stream = self.dm.Stream()
        self.pinned = device.type == "cuda"
        self.free: dict[tuple[int, torch.dtype], list[tuple[torch.Tensor, object]]] = {}
        self.allocated = 0  # buffers ever allocated (reuse keeps this flat across steps)
        self.last: weakref.ref | None = None  # the most recently offloaded payload, for prefetch links

    def buffer(self, like: torch.Tensor) -> torch.Tensor:
        bucket = self.free.get((like.numel(), like.dtype), [])
        for i, (buf, event) in enumerate(bucket):
            if event is None or event.query():
                del bucket[i]
                return buf
        self.allocated += 1
        return torch.empty(like.shape, dtype=like.dtype, pin_memory=self.pinned)

    def release(self, buf: torch.Tensor, event) -> None:
        self.free.setdefault((buf.numel(), buf.dtype), []).append((buf, event))

    def offload(self, payload: QuantizedTensor, shape: torch.Size) -> "Offloaded":
        compute = self.dm.current_stream()
        host_codes, host_scales = self.buffer(payload.codes), self.buffer(payload.scales)
        with self.dm.stream(self.stream):
            self.stream.wait_stream(compute)  # the payload is written on the compute stream
            host_codes.copy_(payload.codes, non_blocking=True)
            host_scales.copy_(payload.scales, non_blocking=True)  # flags stay behind: checked before offload
            done = self.dm.Event()
            done.record(self.stream)
        if self.pinned:  # the device payload may be freed now: the allocator waits for the side stream
            payload.codes.record_stream(self.stream)
            payload.scales.record_stream(self.stream)
        handle = Offloaded(self, host_codes, host_scales, payload, shape, done)
        handle.previous = self.last
        self.last = weakref.ref(handle)
        return handle


class Offloaded:
    """A payload in host memory; `get()` brings it back (or takes the prefetched copy) and decodes it."""

    __slots__ = ("pool", "host_codes", "host_scales", "flags", "payload_shape", "shape", "dtype", "fmt", "group_size",
                 "to_host", "fetched", "fetch_done", "previous", "__weakref__")

    def __init__(self, pool: OffloadPool, host_codes, host_scales, payload: QuantizedTensor, shape, to_host):
        self.pool = pool
        self.host_codes, self.host_scales = host_codes, host_scales
        self.flags = payload.flags  # all zero (checked before offload); tiny, stays on the device
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
        self.pool.dm.current_stream().wait_event(self.fetch_done)
        if self.pool.pinned:
            self.fetched.codes.record_stream(self.pool.dm.current_stream())
            self.fetched.scales.record_stream(self.pool.dm.current_stream())
        previous = self.previous() if self.previous is not None else None
        if previous is not None:
            previous.prefetch()  # backward runs in reverse: the payload offloaded before this one is next
        return self.fetched.dequantize().view(self.shape)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.host_codes, self.host_scales, self.flags))

    def __del__(self):
        try:
            event = self.fetch_done or self.to_host
            self.pool.release(self.host_codes, event)
            self.pool.release(self.host_scales, event)
        except Exception:  # interpreter shutdown
            pass
