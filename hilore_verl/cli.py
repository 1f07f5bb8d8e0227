"""The `hilore-verl` command."""

from __future__ import annotations

import argparse
import sys


def _doctor(args: argparse.Namespace) -> int:
    from hilore_verl.doctor import run

    return run()


def _demo(args: argparse.Namespace) -> int:
    import json

    from hilore_verl.integration.demo import DemoConfig, run_demo

    config = DemoConfig(steps=args.steps, seed=args.seed)
    arms = tuple(a.strip() for a in args.arms.split(",") if a.strip())
    bad = [a for a in arms if a not in ("hilore", "gc")] or ([] if arms else ["(none)"])
    if bad:
        print(f"hilore-verl demo: unknown demo arm {bad[0]!r}; valid: hilore, gc (e.g. --arms hilore,gc)",
              file=sys.stderr)
        return 2
    print(f"hilore-verl demo: GRPO on a toy copy task, tiny random Qwen2 policy, 2 gloo ranks, "
          f"{config.steps} steps per arm ({', '.join(arms)})", flush=True)
    result = run_demo(config, arms)
    print()
    print(result.table())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result.to_dict(), f, indent=1)
        print(f"wrote {args.json}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hilore-verl", description="HiLoRe activation memory manager for verl.")
    from hilore_verl import __version__

    parser.add_argument("--version", action="version", version=f"hilore-verl {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    doctor = sub.add_parser("doctor", help="check versions, device, the verl plugin and verl's FSDP2 engine here")
    doctor.set_defaults(func=_doctor)
    demo = sub.add_parser("demo", help="a short GRPO run on CPU through verl's FSDP2 engine: HiLoRe next to verl's GC")
    demo.add_argument("--steps", type=_positive, default=12, help="GRPO steps per arm (default 12)")
    demo.add_argument("--arms", default="hilore,gc", help="comma-separated: hilore, gc (default both)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--json", metavar="PATH", help="also write the per-step records as JSON")
    demo.set_defaults(func=_demo)
    return parser


def _positive(value: str) -> int:
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return n


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
