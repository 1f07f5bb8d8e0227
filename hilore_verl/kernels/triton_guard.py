"""Can the Triton kernels run on a device? The codec for CUDA tensors, with the torch reference behind it.

Triton builds a small C launcher per kernel signature on first use: it needs a C compiler ($CC,
gcc or clang), the Python headers (Python.h) and libcuda. Where one is missing, the first
compressed tensor used to fail inside a training step. `triton_status(device)` launches a tiny
quantize + dequantize through Triton on the device once (cached per device) and compares it bit
for bit with the reference, computed on CPU (the definition the kernels are held to). Where that
fails, or a later launch fails (`triton_codec.LaunchError`), `quantize` / `dequantize` here run
the torch reference on the device instead (pure torch, slower; it divides by tensors only, so on
CUDA too it is IEEE division as the kernels' `div_rn`) and one warning per device names what is
missing. Out-of-memory errors are raised.
"""

from __future__ import annotations

import contextlib
import ctypes.util
import logging
import os
import shutil
import sysconfig

import torch

from hilore_verl.kernels import reference, triton_codec
from hilore_verl.kernels.reference import QuantizedTensor

logger = logging.getLogger("hilore_verl")
_STATUS: dict[str, tuple[bool, str]] = {}  # per device ("cuda:0"): (ok, reason)
FIELDS = ("codes", "scales", "flags")


def _key(device: torch.device | str) -> str:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return str(device)


def _interpreted() -> bool:
    import triton

    return bool(triton.knobs.runtime.interpret)


def triton_status(device: torch.device | str) -> tuple[bool, str]:
    """Whether hilore-verl's Triton codec kernels run on `device`, as (ok, reason).

    The first call for a device launches a tiny int8 quantize + dequantize (bf16) through Triton
    there and compares codes, scales, flags and output bit for bit with the torch reference
    (computed on CPU); the answer is cached per device. `reason` is "" when ok; otherwise one line
    saying what failed and what is missing (a C compiler, Python.h, libcuda), also logged once as a
    warning (logger "hilore_verl"), after which compressed tensors on that device use the torch
    reference. The engine's start-up calls it for its device and prints the reason when not ok.
    CPU devices never use the kernels (not ok, unless Triton's interpreter is on, as in the tests)."""
    key = _key(device)
    if key not in _STATUS:
        ok, reason = _probe(torch.device(key))
        _STATUS[key] = ok, reason
        if not ok:
            _warn(key, reason)
    return _STATUS[key]


def _warn(key: str, reason: str) -> None:
    logger.warning("hilore-verl: %s; compressed tensors on %s use the torch reference codec instead "
                   "(correct, slower)", reason, key)


def _probe(device: torch.device) -> tuple[bool, str]:
    if device.type != "cuda" and not _interpreted():
        return False, f"the Triton kernels run on CUDA devices only, not on {device}"
    x = torch.linspace(-3.0, 3.0, 256).view(2, 128)
    x[0, 64:] = 0.0  # a zero group
    x[1, 70] = float("nan")  # a flagged group
    x = x.to(device=device, dtype=torch.bfloat16)
    try:
        with _on(device):
            got = triton_codec.quantize(x, "int8", 64)
            y = triton_codec.dequantize(got)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
    except torch.OutOfMemoryError:
        raise
    except Exception as e:  # noqa: BLE001 - whatever stops a launch is the answer
        return False, failure_reason(device, e)
    return compare(reference.quantize(x.cpu(), "int8", 64), got, y, f"int8 bf16 on {device}")


def _on(device: torch.device):
    """Triton launches on the current CUDA device: make it `device`'s."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def bitwise_check(device: torch.device | str) -> tuple[bool, str]:
    """(ok, reason) for every format, nearest and stochastic rounding (with the seed whose mix is 1, a
    compile-time special case once), bf16 and fp32, a masked row tail and a single row, against the
    reference computed on CPU; what `hilore-verl doctor` runs after `triton_status`."""
    device = torch.device(_key(device))
    seed = pow(reference._SEED_MUL, -1, 2**31)  # seed_mix(seed) == 1
    g = torch.Generator().manual_seed(0)
    for shape in ((33, 256), (1, 128)):
        for dtype in (torch.bfloat16, torch.float32):
            x = (torch.randn(shape, generator=g) * 3).to(device=device, dtype=dtype)
            x[0, 5] = float("nan")
            for fmt in reference.FORMATS:
                for stochastic in (False, True):
                    rounding = "stochastic" if stochastic else "nearest"
                    what = f"{fmt} {str(dtype)[6:]} {rounding} {tuple(shape)} on {device}"
                    try:
                        with _on(device):
                            got = triton_codec.quantize(x, fmt, 64, stochastic, seed)
                            y = triton_codec.dequantize(got)
                    except Exception as e:  # noqa: BLE001 - reported with the variant
                        return False, f"{what}: {failure_reason(device, e)}"
                    ok, reason = compare(reference.quantize(x.cpu(), fmt, 64, stochastic, seed), got, y, what)
                    if not ok:
                        return False, reason
    return True, ""


def compare(ref: QuantizedTensor, got: QuantizedTensor, y: torch.Tensor, what: str) -> tuple[bool, str]:
    """(ok, reason): the kernels' codes, scales, flags and dequantized output `y` against the
    reference's `ref`, computed on CPU."""
    differ = [f for f in FIELDS if not same_bits(getattr(got, f).cpu(), getattr(ref, f))]
    if not same_bits(y.cpu(), reference.dequantize(ref)):
        differ.append("dequantized output")
    if differ:
        return False, f"the Triton kernels' {', '.join(differ)} differ from the torch reference ({what})"
    return True, ""


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit, any NaN equal to any NaN (torch's casts write different NaN bits)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point():
        nan = a.isnan()
        if not torch.equal(nan, b.isnan()):
            return False
        a, b = a.masked_fill(nan, 0), b.masked_fill(nan, 0)
        view = {4: torch.int32, 2: torch.int16}[a.element_size()]
        return torch.equal(a.contiguous().view(view), b.contiguous().view(view))
    return torch.equal(a, b)


def failure_reason(device: torch.device | str, error: BaseException) -> str:
    """One line: the launch error's first line, and what Triton's launcher build lacks here."""
    first = (str(error).strip().splitlines() or [""])[0][:300]
    line = f"Triton cannot launch its kernels on {device} ({type(error).__name__}: {first})"
    missing = [what for what, _ in missing_pieces()]
    return line + (f"; missing: {'; '.join(missing)}" if missing else "")


def missing_pieces() -> list[tuple[str, str]]:
    """What Triton needs to build its launchers and this host lacks, as (what is missing, fix),
    looked up where Triton looks (triton/runtime/build.py, triton/backends/nvidia/driver.py)."""
    return [p for p in (_compiler(), _python_h(), _libcuda()) if p is not None]


def _compiler() -> tuple[str, str] | None:
    import triton

    if triton.knobs.build.impl is not None:  # a build function set in Triton's knobs: no compiler needed
        return None
    cc = os.environ.get("CC")
    if cc is not None:
        found = shutil.which(cc)
        return None if found else (f"the C compiler CC={cc} (not found)", "set CC to an installed C compiler")
    if shutil.which("gcc") or shutil.which("clang"):
        return None
    found = shutil.which("cc")
    fix = f"set CC={found} (Triton looks for $CC, gcc, clang)" if found else "install gcc or clang, or set CC"
    return "a C compiler (Triton builds its launcher with $CC, gcc or clang)", fix


def _python_h() -> tuple[str, str] | None:
    scheme = sysconfig.get_default_scheme()
    include = sysconfig.get_paths(scheme="posix_prefix" if scheme == "posix_local" else scheme)["include"]
    if os.path.exists(os.path.join(include, "Python.h")):
        return None
    return (f"Python.h (looked in {include})",
            "install the Python development headers for this interpreter (e.g. apt-get install python3-dev)")


def _libcuda_dirs() -> list[str]:
    """Triton's own libcuda lookup ($TRITON_LIBCUDA_PATH, ldconfig -p, $LD_LIBRARY_PATH); raises if none."""
    from triton.backends.nvidia.driver import libcuda_dirs

    return libcuda_dirs()


def _libcuda() -> tuple[str, str] | None:
    try:
        _libcuda_dirs()
        return None
    except Exception:  # noqa: BLE001 - not found, no ldconfig, or no NVIDIA backend in this Triton
        pass
    found = ctypes.util.find_library("cuda")
    if found:
        return (f"libcuda.so.1 where Triton looks (ldconfig -p, LD_LIBRARY_PATH; the loader finds {found})",
                "set TRITON_LIBCUDA_PATH to the directory holding libcuda.so.1")
    return "libcuda.so.1 (the NVIDIA driver library)", "install the NVIDIA driver, or set TRITON_LIBCUDA_PATH"


def mark_failed(device: torch.device | str, error: BaseException) -> None:
    """A launch failed after the check had passed (a kernel variant of its own): the reference from now on."""
    key = _key(device)
    warned = key in _STATUS and not _STATUS[key][0]
    _STATUS[key] = False, failure_reason(key, error)
    if not warned:
        _warn(key, _STATUS[key][1])


def quantize(x: torch.Tensor, fmt: str = "int8", group_size: int = 64, stochastic: bool = False,
             seed: int = 0) -> QuantizedTensor:
    """`kernels.quantize` for a CUDA tensor: the Triton kernels where they run, else the reference."""
    if triton_status(x.device)[0]:
        try:
            with _on(x.device):  # Triton launches on the current device and its stream
                return triton_codec.quantize(x, fmt, group_size, stochastic, seed)
        except triton_codec.LaunchError as e:
            mark_failed(x.device, e)
    return reference.quantize(x, fmt, group_size, stochastic, seed)


def dequantize(q: QuantizedTensor) -> torch.Tensor:
    if triton_status(q.codes.device)[0]:
        try:
            with _on(q.codes.device):
                return triton_codec.dequantize(q)
        except triton_codec.LaunchError as e:
            mark_failed(q.codes.device, e)
    return reference.dequantize(q)
