"""Codec bandwidth on a GPU: quantize / dequantize bytes moved per second vs a device-to-device copy.

    python benchmarks/codec_bandwidth.py --out docs/benchmarks/codec_bandwidth.md

For each input size (bf16, rows of 4096) and format, bandwidth = (bytes read + bytes written) / time,
with CUDA events over repeated launches after a warm-up; the copy baseline moves the input's bytes
once (read + write). The ratio to copy is what matters: the target is >= 0.8 from 64 MiB up.
Needs a CUDA device; exits with status 2 without one.
"""

from __future__ import annotations

import argparse
import sys

import torch

SIZES_MIB = (1, 4, 16, 64, 256, 1024)
FORMATS = ("int8", "fp8", "int4")
ROW = 4096


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
    parser.add_argument("--out", help="write a markdown report here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("codec_bandwidth: needs a CUDA device; none found", file=sys.stderr)
        return 2
    rows = run(args.group_size)
    report = (f"# Codec bandwidth\n\nGPU: {torch.cuda.get_device_name()}; torch {torch.__version__}; "
              f"bf16 input, rows of {ROW}, group size {args.group_size}.\n\n"
              f"Command: `python benchmarks/codec_bandwidth.py --group-size {args.group_size}"
              f"{' --out ' + args.out if args.out else ''}`\n\n{table(rows)}\n")
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
