"""Codecs for saved activations: group-wise int8 / fp8-e4m3 / int4.

    q = quantize(x, fmt="int8", group_size=64)       # QuantizedTensor: codes + scales + flags
    y = q.dequantize()                                # x's shape and dtype

Formats are specified once, in `kernels.formats`. Dispatch by device: Triton kernels for CUDA
tensors, or the torch reference on a device where Triton cannot launch (`triton_status`, checked
once per device by `kernels.triton_check`, one warning naming what is missing); for CPU tensors
the fused path (`kernels.cpu_fused`: the reference compiled by torch.compile), or the torch
reference itself (`kernels.reference`) when the environment sets HILORE_VERL_CPU_CODEC=reference.
All are bitwise equal to the reference; the Triton kernels are tested on CPU through Triton's
interpreter (TRITON_INTERPRET=1).
"""

from __future__ import annotations

import os

import torch

from hilore_verl.kernels import cpu_fused, reference
from hilore_verl.kernels.formats import DTYPES, FORMATS, GROUP_SIZES, SPECS, payload_ratio
from hilore_verl.kernels.reference import QuantizedTensor

CPU_CODECS = ("fused", "reference")


def cpu_codec() -> str:
    """The CPU codec in use: HILORE_VERL_CPU_CODEC ("fused", the default, or "reference")."""
    name = os.environ.get("HILORE_VERL_CPU_CODEC", "fused")
    if name not in CPU_CODECS:
        raise ValueError(f"HILORE_VERL_CPU_CODEC={name!r}; valid: {', '.join(CPU_CODECS)}")
    return name


def quantize(x: torch.Tensor, fmt: str = "int8", group_size: int = 64, stochastic: bool = False,
             seed: int = 0) -> QuantizedTensor:
    if x.is_cuda:
        from hilore_verl.kernels import triton_check

        return triton_check.quantize(x, fmt, group_size, stochastic, seed)
    codec = cpu_fused if cpu_codec() == "fused" else reference
    return codec.quantize(x, fmt, group_size, stochastic, seed)


def dequantize(q: QuantizedTensor) -> torch.Tensor:
    if q.codes.is_cuda:
        from hilore_verl.kernels import triton_check

        return triton_check.dequantize(q)
    codec = cpu_fused if cpu_codec() == "fused" else reference
    return codec.dequantize(q)


def triton_status(device: torch.device | str) -> tuple[bool, str]:
    """(ok, reason): whether the Triton codec kernels run on `device` (a CUDA device); where not, its
    compressed tensors use the torch reference there and `reason` names what is missing (a C
    compiler, Python.h, libcuda). Checked once per device by a tiny launch compared bit for bit
    with the reference; see `kernels.triton_check.triton_status`. For the engine's start-up line."""
    from hilore_verl.kernels import triton_check

    return triton_check.triton_status(device)


def warm_up(device: torch.device | str = "cpu") -> None:
    """Load the codec's compiled code for `device` now (on CPU, the fused path compiles on first use:
    torch.compile's compiler and the generated kernels stay resident, about 60 MiB here). Memory
    measurements call it before taking their base, so code is not counted as held activations."""
    x = torch.randn(8, 64, device=device)
    dequantize(quantize(x, "int8", 64))


__all__ = ["DTYPES", "FORMATS", "GROUP_SIZES", "SPECS", "QuantizedTensor", "cpu_codec", "dequantize", "payload_ratio",
           "quantize", "triton_status", "warm_up"]

