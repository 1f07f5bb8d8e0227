"""Codec and host-copy bandwidth, as the cost table prices a unit's codec and offload time, and the
codec's working memory, as it prices a compressed unit's transient.

Each is the slope of `timing.fit_bandwidth` over a sample and its first quarter, so that a call's
launch overhead is not read as low bandwidth (on the CPU, bandwidth-bound at a few MiB: one size,
the sample's throughput). The sample is as large as the probe's largest unit's saved bytes, within
bounds (`sample_bytes`).
"""

from __future__ import annotations

import torch

from hilore_verl.kernels import quantize
from hilore_verl.measure.allocations import allocations
from hilore_verl.measure.timing import DeviceClock, fit_bandwidth

SAMPLE_MIN_BYTES = 64 * 2**20  # off the CPU: smaller calls are launch-bound, their fit ill-conditioned
SAMPLE_MAX_BYTES = 512 * 2**20
CPU_SAMPLE_ELEMENTS = 1024 * 1024  # the CPU is bandwidth-bound at a few MiB: keep its probe cheap
REPEATS = 3


def _parts(clock: DeviceClock) -> int:
    """How `fit_bandwidth` splits the sample: a quarter off the CPU; on the CPU, where a call's fixed
    time is small against a few MiB and two sizes' difference is mostly noise, one size (parts 1)."""
    return 1 if clock.device.type == "cpu" else 4


def sample_bytes(device: torch.device, largest: float, element_size: int) -> int:
    """Size of the codec and host-copy samples: on the CPU a fixed 1M elements; elsewhere the probe's
    `largest` unit's saved bytes, at least SAMPLE_MIN_BYTES, at most SAMPLE_MAX_BYTES and an eighth of
    the device's free memory (the codec's output and the copies' buffers come on top). A whole number
    of 4 rows of 1024 elements (the fit's smaller size is a quarter)."""
    row = 4 * 1024 * element_size
    if device.type == "cpu":
        return CPU_SAMPLE_ELEMENTS * element_size
    module = torch.get_device_module(device.type)
    free = module.mem_get_info(device)[0] if hasattr(module, "mem_get_info") else 8 * SAMPLE_MAX_BYTES
    return max(int(min(max(largest, SAMPLE_MIN_BYTES), SAMPLE_MAX_BYTES, free // 8)) // row, 1) * row


def codec_bandwidth(clock: DeviceClock, sample: torch.Tensor) -> float:
    """Activation bytes per second of quantize + dequantize (int8), counted twice (the table prices a
    unit's codec time as 2 S / codec_bytes_per_s): the slope of `fit_bandwidth` over `sample` and its
    first quarter, so that a call's launch overhead is not read as low bandwidth (on the CPU: the
    sample's throughput)."""
    row = sample[0].numel() * sample.element_size()

    def seconds(nbytes: int) -> float:
        part = sample[: nbytes // row]
        return clock.time(lambda: quantize(part, "int8", 64).dequantize(), REPEATS)

    return 2 * fit_bandwidth(seconds, sample.numel() * sample.element_size(), _parts(clock))[0]


def codec_working_memory(sample: torch.Tensor) -> float:
    """Bytes the codec allocates at once on `sample` beyond its payload and its output: the larger of
    quantize's (its payload is kept) and dequantize's (less its output). The Triton and the fused CPU
    codecs write codes and values directly (about 0); the torch reference, which serves where those
    cannot run, makes fp32 temporaries of a chunk of rows (reference.CHUNK_ELEMENTS, at most the
    sample's elements). 0 where the allocator reports nothing."""
    nbytes = sample.numel() * sample.element_size()
    try:
        kept = []
        quantized = allocations(lambda: kept.append(quantize(sample, "int8", 64)), sample.device)
        restored = allocations(kept[0].dequantize, sample.device)
    except RuntimeError:
        return 0.0
    return max(quantized.during, restored.during - nbytes, 0.0)


def bandwidths(clock: DeviceClock, device: torch.device, largest: float, element_size: int
               ) -> tuple[float, float, float, int]:
    """(codec, host-copy) bandwidths, the codec's working memory (`codec_working_memory`) and the elements
    it was measured on: a sample of `sample_bytes` (the probe's `largest` unit's saved bytes, within
    bounds) of the activations' dtype (element_size 4: fp32, else bf16) on `device`."""
    dtype = torch.float32 if element_size == 4 else torch.bfloat16
    nbytes = sample_bytes(device, largest, dtype.itemsize)
    sample = torch.randn(nbytes // (1024 * dtype.itemsize), 1024, device=device, dtype=dtype)
    return codec_bandwidth(clock, sample), host_bandwidth(clock, sample), codec_working_memory(sample), sample.numel()


def host_buffer(like: torch.Tensor, pinned: bool) -> torch.Tensor:
    return torch.empty(like.shape, dtype=like.dtype, pin_memory=pinned)


def host_bandwidth(clock: DeviceClock, sample: torch.Tensor) -> float:
    """Bytes per second one way between the device and the host, as the runtime's offload copies
    (runtime/offload.py): into a pinned host buffer and back, non-blocking on a side stream, timed by
    events on that stream; on the CPU synchronous copies (the offload's path there). The slope of
    `fit_bandwidth` over the round trip of `sample` and of its first quarter (on the CPU: the
    sample's throughput)."""
    side = clock.module.Stream() if clock.events else None
    host, back = host_buffer(sample, pinned=clock.events), torch.empty_like(sample)
    flat = [t.view(-1) for t in (sample, host, back)]

    def seconds(nbytes: int) -> float:
        src, buf, dst = (t[: nbytes // sample.element_size()] for t in flat)

        def trip():
            buf.copy_(src, non_blocking=clock.events)  # forward: to the host
            dst.copy_(buf, non_blocking=clock.events)  # backward: back to the device

        return clock.time(trip, REPEATS, stream=side)

    return 2 * fit_bandwidth(seconds, sample.numel() * sample.element_size(), _parts(clock))[0]
