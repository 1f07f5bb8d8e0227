"""The `hilore-verl` command."""

from __future__ import annotations

import argparse
import sys


def _doctor(args: argparse.Namespace) -> int:
    from hilore_verl.doctor import run

    return run()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hilore-verl", description="HiLoRe activation memory manager for verl.")
    from hilore_verl import __version__

    parser.add_argument("--version", action="version", version=f"hilore-verl {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    doctor = sub.add_parser("doctor", help="check versions, device, the verl plugin and verl's FSDP2 engine here")
    doctor.set_defaults(func=_doctor)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
