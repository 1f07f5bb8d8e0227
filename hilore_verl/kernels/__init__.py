"""Codecs for saved activations: group-wise int8 / fp8-e4m3 / int4.

    q = quantize(x, fmt="int8", group_size=64)       # QuantizedTensor: codes + scales + flags
    y = q.dequantize()                                # x's shape and dtype

Formats are specified once, in `kernels.formats`. Dispatch by device: Triton kernels for CUDA
tensors, or the torch reference on a device where Triton cannot launch (`triton_status`, checked
once per device by `kernels.triton_guard`, one warning naming what is missing). CPU tensors go to
the codec HILORE_VERL_CPU_CODEC names:

    native     (default) `kernels.cpu_native`: a small C++ library built once per machine with its
               C++ compiler (cached; `python -m hilore_verl.kernels.cpu_native build` at install)
    fused      `kernels.cpu_fused`: the reference compiled by torch.compile, per group width
    reference  `kernels.reference`: the torch code the others are held to

If the native library cannot be built, one warning says why and the fused codec runs instead (the
reference where no C++ compiler exists, since torch.compile needs one too); if the fused codec
cannot be compiled, one warning says why and the reference runs. `cpu_codec_in_use()` tells which
(`cpu_fused.status()` counts the calls its compiled code served). All are bitwise equal to the
reference; the Triton kernels are tested on CPU through Triton's interpreter (TRITON_INTERPRET=1).

A leaf: imports nothing else of hilore_verl.
"""

from __future__ import annotations

import logging
import os
import threading

import torch

from hilore_verl.kernels import cpu_fused, reference
from hilore_verl.kernels.formats import DTYPES, FORMATS, GROUP_SIZES, SPECS, payload_ratio
from hilore_verl.kernels.reference import QuantizedTensor

CPU_CODECS = ("native", "fused", "reference")
logger = logging.getLogger("hilore_verl")
_native_outcome: list[str] = []  # once tried: "native", or the codec that runs in its place
_native_lock = threading.Lock()


def cpu_codec() -> str:
    """The CPU codec asked for: HILORE_VERL_CPU_CODEC ("native", the default, "fused" or "reference")."""
    name = os.environ.get("HILORE_VERL_CPU_CODEC", "native")
    if name not in CPU_CODECS:
        raise ValueError(f"HILORE_VERL_CPU_CODEC={name!r}; valid: {', '.join(CPU_CODECS)}")
    return name


def cpu_codec_in_use() -> str:
    """The CPU codec that runs: `cpu_codec()`, except where "native" cannot be built (then "fused", or
    "reference" without a C++ compiler; one warning with the reason, the first time), and "reference"
    once the fused codec has failed to compile (its own one warning)."""
    name = _cpu_codec_chosen()
    return "reference" if name == "fused" and not cpu_fused.available() else name


def _cpu_codec_chosen() -> str:
    """`cpu_codec()`, or the codec that replaces "native" where it cannot be built."""
    name = cpu_codec()
    if name != "native":
        return name
    if not _native_outcome:
        from hilore_verl.kernels import cpu_native

        with _native_lock:
            if not _native_outcome:
                try:
                    cpu_native.load()
                    _native_outcome.append("native")
                except cpu_native.Unavailable as e:
                    fallback = "reference" if e.no_compiler else "fused"
                    _native_outcome.append(fallback)
                    logger.warning("hilore-verl: the native CPU codec could not be built (%s); the %s codec runs "
                                   "instead (bitwise the same results, slower)", str(e)[:400],
                                   "torch reference" if e.no_compiler else "fused (torch.compile)")
    return _native_outcome[0]


def _cpu_module():
    name = _cpu_codec_chosen()  # "fused" also after a failed compile: cpu_fused serves the reference then
    if name == "native":
        from hilore_verl.kernels import cpu_native

        return cpu_native
    return cpu_fused if name == "fused" else reference


def quantize(x: torch.Tensor, fmt: str = "int8", group_size: int = 64, stochastic: bool = False,
             seed: int = 0) -> QuantizedTensor:
    if x.is_cuda:
        from hilore_verl.kernels import triton_guard

        return triton_guard.quantize(x, fmt, group_size, stochastic, seed)
    return _cpu_module().quantize(x, fmt, group_size, stochastic, seed)


def dequantize(q: QuantizedTensor) -> torch.Tensor:
    if q.codes.is_cuda:
        from hilore_verl.kernels import triton_guard

        return triton_guard.dequantize(q)
    return _cpu_module().dequantize(q)


def triton_status(device: torch.device | str) -> tuple[bool, str]:
    """(ok, reason): whether the Triton codec kernels run on `device` (a CUDA device); where not, its
    compressed tensors use the torch reference there and `reason` names what is missing (a C
    compiler, Python.h, libcuda). Checked once per device by a tiny launch compared bit for bit
    with the reference; see `kernels.triton_guard.triton_status`. For the engine's start-up line."""
    from hilore_verl.kernels import triton_guard

    return triton_guard.triton_status(device)


def warm_up(device: torch.device | str = "cpu") -> None:
    """Load the codec's compiled code for `device` now: on CPU the native library (built first if the
    cache lacks it; about 0.2 MiB mapped), or with HILORE_VERL_CPU_CODEC=fused the torch.compile'd
    code (its compiler and kernels stay resident, about 60 MiB). Memory measurements call it before
    taking their base, so code is not counted as held activations."""
    x = torch.randn(8, 64, device=device)
    dequantize(quantize(x, "int8", 64))


__all__ = ["DTYPES", "FORMATS", "GROUP_SIZES", "SPECS", "QuantizedTensor", "cpu_codec", "cpu_codec_in_use", "dequantize", "payload_ratio",
           "quantize", "triton_status", "warm_up"]

