"""The check's first stage: versions, the device, what Triton's launcher needs, one Triton launch, and
what a cold compile costs here (the later stages' time limits follow it: limits.py).

Without a usable CUDA device it still writes what it found missing (a CUDA build of torch, the NVIDIA
driver, libcuda, a visible device, CUDA's own initialisation error; a C compiler and `Python.h` for
Triton), and the run skips the other stages.
"""

from __future__ import annotations

import os
import platform
import time
from importlib import metadata

import torch

from hilore_verl.gpucheck.context import Context, StageReport
from hilore_verl.kernels import reference, triton_guard, triton_codec

PACKAGES = ("torch", "triton", "transformers", "numpy", "verl", "ray")


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


# ---------------------------------------------------------------------------------------------- environment
def environment(report: StageReport, ctx: Context) -> None:
    report.figure("versions", {"python": platform.python_version(), **{p: _version(p) for p in PACKAGES},
                               "torch_cuda": torch.version.cuda, "hilore_verl": _hilore_version()})
    missing = [f"{what} ({fix})" for what, fix in triton_guard.missing_pieces()]
    if ctx.device == "cuda":
        available = torch.cuda.is_available()
        report.figure("cuda_available", available)
        if not available:  # say what is missing, then stop: the run skips the other stages
            report.figure("missing", cuda_missing() + missing)
            report.check("CUDA device", False, "; ".join(cuda_missing() + missing))
            return
        device = ctx.torch_device()
        props = torch.cuda.get_device_properties(device)
        report.figure("device", {"name": props.name, "capability": f"{props.major}.{props.minor}",
                                 "memory_gib": round(props.total_memory / 2**30, 1),
                                 "multiprocessors": props.multi_processor_count})
        report.check("Triton launcher prerequisites", not missing, "; ".join(missing) or
                     "C compiler, Python.h and libcuda present")
    else:
        device = ctx.torch_device()
        report.figure("device", {"name": f"CPU ({os.cpu_count()} cores, {platform.machine()})"})
        report.figure("launcher_prerequisites_missing", missing)  # informational on the CPU
    x = torch.randn(64, 256, device=device, dtype=torch.bfloat16)
    start = time.perf_counter()
    try:
        q = triton_codec.quantize(x, "int8", 64)
        y = triton_codec.dequantize(q)
    except Exception as err:
        report.check("one Triton launch (quantize + dequantize)", False, triton_guard.failure_reason(device, err))
        return
    launch_s = time.perf_counter() - start
    report.figure("triton_first_launch_s", round(launch_s, 3))
    same, why = triton_guard.compare(reference.quantize(x.cpu(), "int8", 64), q, y, "int8 bf16 64 x 256")
    report.check("one Triton launch (quantize + dequantize)", same,
                 why or f"bitwise the reference; first launch {launch_s:.2f} s (compilation)")
    if not ctx.tiny:  # what a cold compile costs here: the later stages' limits follow it (limits.py)
        report.figure("inductor_compile_s", round(inductor_compile_s(device), 2))


def cuda_missing() -> list[str]:
    """Why torch sees no CUDA device, as far as this host shows: a CPU build of torch, no NVIDIA driver
    (kernel module, libcuda), no visible device, or the error CUDA's initialisation raised."""
    import ctypes.util
    import shutil

    found = []
    if torch.version.cuda is None:
        found.append(f"a CUDA build of torch (this torch {torch.__version__} is built without CUDA)")
    if not os.path.exists("/proc/driver/nvidia/version"):
        found.append("the NVIDIA driver (no /proc/driver/nvidia/version" +
                     ("" if shutil.which("nvidia-smi") else "; no nvidia-smi on PATH") + ")")
    if ctypes.util.find_library("cuda") is None:
        found.append("libcuda.so.1 (the NVIDIA driver library; not found by the loader)")
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) == "":
        found.append("a visible device (CUDA_VISIBLE_DEVICES is set empty)")
    if torch.version.cuda is not None:
        try:
            torch.cuda.init()
        except Exception as err:  # noqa: BLE001 - the reason is the finding
            found.append(f"CUDA initialisation: {type(err).__name__}: {str(err).splitlines()[0][:200]}")
    return found or ["nothing this check can name: torch.cuda.is_available() is False"]


def inductor_compile_s(device: torch.device) -> float:
    """Seconds of one cold `torch.compile` (Inductor) of a small function, forward and backward."""
    import torch._dynamo

    def fn(a, b):
        return torch.nn.functional.gelu(a @ b).softmax(-1).sum()

    a = torch.randn(64, 64, device=device, requires_grad=True)
    b = torch.randn(64, 64, device=device)
    torch._dynamo.reset()
    start = time.perf_counter()
    torch.compile(fn, dynamic=False)(a, b).backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def _hilore_version() -> str:
    from hilore_verl import __version__

    return __version__
