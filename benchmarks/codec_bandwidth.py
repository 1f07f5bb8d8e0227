"""Codec bandwidth: quantize + dequantize throughput against a plain copy, on a GPU or on the CPU.

    python benchmarks/codec_bandwidth.py --out docs/benchmarks/codec_bandwidth.md          # CUDA
    python benchmarks/codec_bandwidth.py --device cpu --out docs/benchmarks/codec_cpu.md  # CPU

GPU: Triton kernels on bf16 inputs of 1 MiB - 1 GiB (rows of 4096), bandwidth = (bytes read +
bytes written) / time with CUDA events; the target is >= 0.8x copy from 64 MiB up.
CPU: the native codec (`kernels.cpu_native`) on fp32 and bf16 inputs of 4, 16 and 64 MiB (input
bytes, rows of 1024), as a round trip (quantize, then dequantize): input elements per second and
input GB/s, median and range over --repeats timed runs, both through the API (output tensors
allocated per call) and into preallocated outputs (the codec alone; above glibc's 32 MiB mmap
threshold a fresh output is page-faulted in on every call). `copy_` of the same input for scale.
The process re-runs itself with malloc keeping freed memory (as `hilore-verl bench` does).
Target on the development machine (2 cores, 2 threads): >= 1.25 G elements/s round trip.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

SIZES_MIB = (1, 4, 16, 64, 256, 1024)
CPU_SIZES_MIB = (4, 16, 64)
FORMATS = ("int8", "fp8", "int4")
ROW = 4096
CPU_ROW = 1024


def _time_ms(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def _bytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def run(group_size: int) -> list[dict]:
    from hilore_verl.kernels import triton_codec

    rows = []
    for mib in SIZES_MIB:
        x = torch.randn(mib * 2**20 // 2 // ROW, ROW, device="cuda", dtype=torch.bfloat16)
        repeats = max(5, 2000 // mib)
        dst = torch.empty_like(x)
        copy_ms = _time_ms(lambda: dst.copy_(x), repeats)
        copy_gbs = 2 * _bytes(x) / copy_ms / 1e6
        for fmt in FORMATS:
            q = triton_codec.quantize(x, fmt, group_size)
            moved = _bytes(x) + _bytes(q.codes, q.scales, q.flags)
            q_ms = _time_ms(lambda: triton_codec.quantize(x, fmt, group_size), repeats)
            d_ms = _time_ms(lambda: triton_codec.dequantize(q), repeats)
            rows.append({"MiB": mib, "fmt": fmt, "copy GB/s": copy_gbs,
                         "quantize GB/s": moved / q_ms / 1e6, "dequantize GB/s": moved / d_ms / 1e6})
    return rows


def _times_s(fn, repeats: int) -> list[float]:
    for _ in range(2):
        fn()
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def _rate(n: int, times: list[float]) -> tuple[float, float, float]:
    """(median, lowest, highest) of n / t in G per second."""
    r = sorted(n / t / 1e9 for t in times)
    return statistics.median(r), r[0], r[-1]


def run_cpu(group_size: int, repeats: int) -> list[dict]:
    from hilore_verl.kernels import cpu_native

    cpu_native.load()
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for mib in CPU_SIZES_MIB:
            x = torch.randn(mib * 2**20 // dtype.itemsize // CPU_ROW, CPU_ROW).to(dtype)
            dst = torch.empty_like(x)
            copy = _rate(x.numel(), _times_s(lambda: dst.copy_(x), repeats))
            for fmt in FORMATS:
                q = cpu_native.quantize(x, fmt, group_size)
                bufs, y = (torch.empty_like(q.codes), torch.empty_like(q.scales), torch.empty_like(q.flags)), dst
                api = _times_s(lambda: cpu_native.dequantize(cpu_native.quantize(x, fmt, group_size)), repeats)
                into = _times_s(lambda: cpu_native.dequantize(cpu_native.quantize(x, fmt, group_size, out=bufs), y),
                                repeats)
                rows.append({"dtype": str(dtype).split(".")[-1], "MiB": mib, "fmt": fmt, "copy": copy,
                             "api": _rate(x.numel(), api), "into": _rate(x.numel(), into),
                             "GB/s": x.numel() * dtype.itemsize / statistics.median(api) / 1e9})
    return rows


def table_cpu(rows: list[dict]) -> str:
    f = lambda r: f"{r[0]:.2f} ({r[1]:.2f}-{r[2]:.2f})"  # noqa: E731
    lines = ["| input | MiB | format | round trip G el/s | GB/s of input | preallocated outputs G el/s | "
             "copy_ G el/s |", "|---|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['dtype']} | {r['MiB']} | {r['fmt']} | {f(r['api'])} | {r['GB/s']:.2f} | {f(r['into'])} | "
                     f"{f(r['copy'])} |")
    return "\n".join(lines)


def table(rows: list[dict]) -> str:
    lines = ["| input MiB | format | copy GB/s | quantize GB/s | x copy | dequantize GB/s | x copy |",
             "|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['MiB']} | {r['fmt']} | {r['copy GB/s']:.0f} | {r['quantize GB/s']:.0f} | "
                     f"{r['quantize GB/s'] / r['copy GB/s']:.2f} | {r['dequantize GB/s']:.0f} | "
                     f"{r['dequantize GB/s'] / r['copy GB/s']:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--threads", type=int, default=2, help="CPU: torch (and codec) threads")
    parser.add_argument("--repeats", type=int, default=15, help="CPU: timed runs per case (after 2 untimed)")
    parser.add_argument("--out", help="write a markdown report here")
    args = parser.parse_args(argv)
    cpu_args = f" --threads {args.threads} --repeats {args.repeats}" if args.device == "cpu" else ""
    command = (f"`python benchmarks/codec_bandwidth.py --device {args.device} --group-size {args.group_size}"
               f"{cpu_args}{' --out ' + args.out if args.out else ''}`")
    if args.device == "cpu":
        from hilore_verl.cli import CACHING_MALLOC

        if sys.platform.startswith("linux") and os.environ.get("MALLOC_TRIM_THRESHOLD_") is None:
            os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **CACHING_MALLOC})
        torch.set_num_threads(args.threads)
        rows = run_cpu(args.group_size, args.repeats)
        report = (f"# Codec throughput on the CPU\n\n{os.cpu_count()} cores, {torch.get_num_threads()} threads; "
                  f"torch {torch.__version__}; native codec; rows of {CPU_ROW}, group size {args.group_size}; "
                  f"round trip = quantize then dequantize, per input element; median (lowest-highest) of "
                  f"{args.repeats} runs.\n\nCommand: {command}\n\n{table_cpu(rows)}\n")
    else:
        if not torch.cuda.is_available():
            print("codec_bandwidth: --device cuda needs a CUDA device; none found (use --device cpu)",
                  file=sys.stderr)
            return 2
        rows = run(args.group_size)
        report = (f"# Codec bandwidth\n\nGPU: {torch.cuda.get_device_name()}; torch {torch.__version__}; "
                  f"bf16 input, rows of {ROW}, group size {args.group_size}.\n\nCommand: {command}\n\n"
                  f"{table(rows)}\n")
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
