"""Codec bandwidth: quantize + dequantize throughput against a plain copy, on a GPU or on the CPU.

    python benchmarks/codec_bandwidth.py --out docs/benchmarks/codec_bandwidth.md          # CUDA
    python benchmarks/codec_bandwidth.py --device cpu --out docs/benchmarks/codec_cpu.md  # CPU

GPU: Triton kernels on bf16 inputs of 1 MiB - 1 GiB (rows of 4096), bandwidth = (bytes read +
bytes written) / time with CUDA events; the target is >= 0.8x copy from 64 MiB up.
CPU: the fused codec (and the torch reference, for comparison) on fp32 and bf16 inputs of
1 - 16 MiB (rows of 1024), as a round trip (quantize, then dequantize) in input elements per
second and input GB/s, best of repeated runs, against `copy_` of the same input. The process
re-runs itself with malloc keeping freed memory (as `hilore-verl bench` does). Target on the
development machine (2 cores): >= 1.25 G elements/s for int8 and fp8.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

SIZES_MIB = (1, 4, 16, 64, 256, 1024)
CPU_SIZES_MIB = (1, 4, 16)
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


def _best_s(fn, seconds: float = 0.5) -> float:
    fn()
    best, spent = float("inf"), 0.0
    while spent < seconds:
        t = time.perf_counter()
        fn()
        dt = time.perf_counter() - t
        best, spent = min(best, dt), spent + dt
    return best


def run_cpu(group_size: int) -> list[dict]:
    from hilore_verl.kernels import cpu_fused, reference

    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for mib in CPU_SIZES_MIB:
            x = torch.randn(mib * 2**20 // (CPU_ROW * 4), CPU_ROW).to(dtype)  # mib MiB of fp32 elements
            dst = torch.empty_like(x)
            copy_s = _best_s(lambda: dst.copy_(x))
            for fmt in FORMATS:
                fused_s = _best_s(lambda: cpu_fused.dequantize(cpu_fused.quantize(x, fmt, group_size)))
                ref_s = _best_s(lambda: reference.dequantize(reference.quantize(x, fmt, group_size)), 0.2)
                rows.append({"dtype": str(dtype).split(".")[-1], "MiB": round(_bytes(x) / 2**20, 1), "fmt": fmt,
                             "copy Gel/s": x.numel() / copy_s / 1e9, "fused Gel/s": x.numel() / fused_s / 1e9,
                             "reference Gel/s": x.numel() / ref_s / 1e9,
                             "fused GB/s": _bytes(x) / fused_s / 1e9})
    return rows


def table_cpu(rows: list[dict]) -> str:
    lines = ["| input | MiB | format | copy_ G el/s | fused round trip G el/s | GB/s of input | x copy_ | "
             "reference G el/s |", "|---|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['dtype']} | {r['MiB']} | {r['fmt']} | {r['copy Gel/s']:.2f} | {r['fused Gel/s']:.2f} | "
                     f"{r['fused GB/s']:.2f} | {r['fused Gel/s'] / r['copy Gel/s']:.2f} | "
                     f"{r['reference Gel/s']:.3f} |")
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
    parser.add_argument("--out", help="write a markdown report here")
    args = parser.parse_args(argv)
    command = (f"`python benchmarks/codec_bandwidth.py --device {args.device} --group-size {args.group_size}"
               f"{' --out ' + args.out if args.out else ''}`")
    if args.device == "cpu":
        from hilore_verl.cli import CACHING_MALLOC

        if sys.platform.startswith("linux") and os.environ.get("MALLOC_TRIM_THRESHOLD_") is None:
            os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **CACHING_MALLOC})
        rows = run_cpu(args.group_size)
        report = (f"# Codec throughput on the CPU\n\n{os.cpu_count()} cores, {torch.get_num_threads()} threads; "
                  f"torch {torch.__version__}; rows of {CPU_ROW}, group size {args.group_size}; round trip = "
                  f"quantize then dequantize; best of repeated runs.\n\nCommand: {command}\n\n{table_cpu(rows)}\n")
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
