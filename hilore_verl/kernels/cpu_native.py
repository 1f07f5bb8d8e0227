"""Native CPU codecs: `cpu_native.cpp`, a small C++ library loaded with ctypes, bitwise the reference.

One pass over each group reads the input once (the absmax on the value bits, then y = x / scale
and the codes from the group held in L1), OpenMP over chunks of groups, torch's thread count.
No per-shape compile: one build covers every format, dtype, group size and width.

Built with the machine's C++ compiler ($CXX, else g++ / c++ / clang++) into a cache directory
($HILORE_VERL_CACHE_DIR, else $XDG_CACHE_HOME/hilore_verl, else ~/.cache/hilore_verl) under a
name keyed by the source, the flags, the compiler and the CPU, so a changed source or another
machine builds its own copy. `make install` builds it ahead (`python -m hilore_verl.kernels.cpu_native
build`); otherwise the first use does (a few seconds). A build that fails with -march=native /
OpenMP is retried with portable flags; if no build works, `load()` raises `Unavailable` with the
reason, and `kernels` falls back (see `kernels.cpu_codec_in_use`).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from hilore_verl.kernels.formats import SPECS
from hilore_verl.kernels.reference import QuantizedTensor, check_args, seed_mix

SOURCE = Path(__file__).with_name("cpu_native.cpp")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-fno-math-errno", "-std=c++17", "-shared",
         "-fPIC")
PORTABLE_FLAGS = ("-O3", "-ffp-contract=off", "-fno-math-errno", "-std=c++17", "-shared", "-fPIC",
                  "-Wno-unknown-pragmas")
_DTYPE_ID = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


class Unavailable(RuntimeError):
    """The library could not be built or loaded; `no_compiler` tells a missing compiler from a failed build."""

    def __init__(self, reason: str, no_compiler: bool):
        super().__init__(reason)
        self.no_compiler = no_compiler


def cache_dir() -> Path:
    if os.environ.get("HILORE_VERL_CACHE_DIR"):
        return Path(os.environ["HILORE_VERL_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hilore_verl"


def compiler() -> str | None:
    """$CXX when set (only it), else the first of g++, c++, clang++ on PATH."""
    if os.environ.get("CXX"):
        return shutil.which(os.environ["CXX"])
    return next((p for p in map(shutil.which, ("g++", "c++", "clang++")) if p), None)


def _cpu_id() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor()


def library_path(cxx: str) -> Path:
    key = hashlib.sha256(b"\0".join(s.encode() for s in (
        SOURCE.read_text(), " ".join(FLAGS), cxx, platform.machine(), _cpu_id()))).hexdigest()[:16]
    return cache_dir() / f"cpu_native-{key}.so"


def build(force: bool = False) -> Path:
    """Compile the library into the cache (atomically: concurrent builders do not clash); its path."""
    requested = os.environ.get("CXX", "")
    cxx = compiler()
    if cxx is None:
        raise Unavailable(f"no C++ compiler found ({'CXX=' + requested if requested else 'g++, c++, clang++'})",
                          no_compiler=True)
    path = library_path(cxx)
    if path.exists() and not force:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    errors = []
    for flags in (FLAGS, PORTABLE_FLAGS):
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
        os.close(fd)
        try:
            run = subprocess.run([cxx, *flags, str(SOURCE), "-o", tmp], capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.SubprocessError) as e:
            run = None
            errors.append(f"{type(e).__name__}: {e}")
        if run is not None and run.returncode == 0:
            os.replace(tmp, path)
            return path
        if run is not None:
            errors.append(f"{cxx} exited {run.returncode}: {(run.stderr or run.stdout).strip()[-300:]}")
        os.unlink(tmp)
    raise Unavailable("; then with portable flags: ".join(errors), no_compiler=False)


@functools.lru_cache(maxsize=1)
def load() -> ctypes.CDLL:
    """The loaded library (built first if the cache lacks it); `Unavailable` says why not."""
    path = build()
    try:
        lib = ctypes.CDLL(str(path))
    except OSError:  # a damaged cache entry: build it again once
        lib = ctypes.CDLL(str(build(force=True)))
    p, i64, i32, u32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_uint32
    lib.hv_quantize.argtypes = [p, i32, i64, i32, i32, i32, u32, p, p, p, i32]
    lib.hv_dequantize.argtypes = [p, p, i64, i32, i32, i32, p, i32, i32]
    return lib


@functools.lru_cache(maxsize=1)
def _bf16_nan() -> int:
    """The bits torch's fp32 -> bf16 conversion gives a nan (0xFFFF in its x86 vector path, 0x7FC0 in its
    scalar one): the decoded nan of a flagged group, matched bit for bit."""
    return int(torch.full((64,), float("nan")).to(torch.bfloat16).view(torch.int16)[0]) & 0xFFFF


def available() -> bool:
    try:
        load()
        return True
    except Unavailable:
        return False


def quantize(x: torch.Tensor, fmt: str = "int8", group_size: int = 64, stochastic: bool = False,
             seed: int = 0, out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> QuantizedTensor:
    """`out`: contiguous (codes, scales, flags) of the right shapes and dtypes to write into (benchmarks)."""
    check_args(x, fmt, group_size)
    D = x.shape[-1]
    flat = x.detach().reshape(-1, D).contiguous()
    R, G = flat.shape[0], D // group_size
    if out is None:
        spec = SPECS[fmt]
        out = (torch.empty(spec.codes_shape(R, D), dtype=spec.code_dtype),
               torch.empty((R, G), dtype=torch.float32), torch.empty((R, G), dtype=torch.uint8))
    codes, scales, flags = out
    rc = load().hv_quantize(flat.data_ptr(), _DTYPE_ID[x.dtype], R * G, group_size, SPECS[fmt].kernel_id,
                            int(stochastic), seed_mix(seed) if stochastic else 0, codes.data_ptr(), scales.data_ptr(),
                            flags.data_ptr(), torch.get_num_threads())
    if rc:
        raise ValueError(f"native codec: unsupported {fmt} / {x.dtype} / group {group_size}")
    return QuantizedTensor(codes, scales, flags, x.shape, x.dtype, fmt, group_size)


def dequantize(q: QuantizedTensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """`out`: a contiguous tensor of q's shape and dtype to write into (benchmarks)."""
    codes, scales = q.codes.contiguous(), q.scales.contiguous().float()
    out = torch.empty(q.shape, dtype=q.dtype) if out is None else out
    rc = load().hv_dequantize(codes.data_ptr(), scales.data_ptr(), scales.numel(), q.group_size, SPECS[q.fmt].kernel_id,
                              _DTYPE_ID[q.dtype], out.data_ptr(), _bf16_nan(), torch.get_num_threads())
    if rc:
        raise ValueError(f"native codec: unsupported {q.fmt} / {q.dtype} / group {q.group_size}")
    return out


def main(argv: list[str] | None = None) -> int:
    """`python -m hilore_verl.kernels.cpu_native build [--force]`: build into the cache, print the path."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] != "build":
        print("usage: python -m hilore_verl.kernels.cpu_native build [--force]", file=sys.stderr)
        return 2
    try:
        print(build(force="--force" in argv))
    except Unavailable as e:
        print(f"native CPU codec not built: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
