"""The `hilore-verl` command."""

from __future__ import annotations

import argparse
import os
import sys

from hilore_verl.cli_args import (Parser, add_bench, add_demo, add_doctor, add_gpu_check, add_plan,
                                   add_tiny_task)


def _doctor(args: argparse.Namespace) -> int:
    from hilore_verl.doctor import run

    return run()


def _demo(args: argparse.Namespace) -> int:
    import json

    from hilore_verl.integration.tools.demo import DemoConfig, run_demo
    from hilore_verl.integration.tools.demo_report import plot

    config = DemoConfig(steps=args.steps, seed=args.seed, recipe=args.recipe, recipe_dir=args.recipe_dir or "",
                        task_dir=args.task_dir or "", overrides=tuple(args.override))
    arms = tuple(a.strip() for a in args.arms.split(",") if a.strip())
    bad = [a for a in arms if a not in ("hilore", "gc")] or ([] if arms else ["(none)"])
    if bad:
        print(f"hilore-verl demo: unknown demo arm {bad[0]!r}; valid: hilore, gc (e.g. --arms hilore,gc)",
              file=sys.stderr)
        return 2
    what = {"demo_cpu": "a random 4-layer hidden-256 Qwen2, prompts of 64-192 digits, answer the first",
            "tiny_cpu": "a random 2-layer hidden-64 Qwen2, copy the first digit"}[config.recipe]
    print(f"hilore-verl demo: verl's main_ppo, GRPO on recipe {config.recipe} ({what}), 2 ranks through Ray, "
          f"{config.steps} steps per arm ({', '.join(arms)})", flush=True)
    result = run_demo(config, arms, echo=lambda line: print(line, flush=True))
    print()
    print(result.table())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result.to_dict(), f, indent=1)
        print(f"wrote {args.json}")
    if args.plot:
        plot(result, args.plot)
        print(f"wrote {args.plot} (reward and actor-update time per step)")
    return 0


def _plan(args: argparse.Namespace) -> int:
    import json

    from hilore_verl.planner.whatif import parse_budget, shared_summary, shared_tokens, what_if
    from hilore_verl.presets import load_config

    shape = (args.prompt_len, args.response_len, args.group_size)
    if any(v is not None for v in shape) and None in shape:
        print("hilore-verl plan: --prompt-len, --response-len and --group-size go together", file=sys.stderr)
        return 2
    seq_len = args.seq_len or (args.prompt_len + args.response_len if args.prompt_len else args.micro_batch_tokens)
    try:
        budget = parse_budget(args.budget)
        config = load_config(args.model)
        result = what_if(config, args.model, args.micro_batch_tokens, seq_len, args.gpus, args.gpu_mem_gib, budget)
        shared = None if args.prompt_len is None else what_if(
            config, args.model, shared_tokens(args.micro_batch_tokens, *shape), seq_len, args.gpus, args.gpu_mem_gib,
            budget, row=args.micro_batch_tokens)  # the budget: GC's peak without the shared layout
    except ValueError as err:
        print(f"hilore-verl plan: {err}", file=sys.stderr)
        return 2
    print(result.table())
    if shared is not None:
        print(shared_summary(result, shared, *shape))
    if args.json:
        from dataclasses import asdict

        with open(args.json, "w") as f:
            json.dump({**asdict(result), "plan": {u: str(p) for u, p in result.plan.items()},
                       "saved_vs_gc": result.saved_vs_gc}, f, indent=1)
    return 0


# glibc malloc hands large freed blocks back to the kernel, so a CPU step that keeps its activations
# pays page faults a GPU's caching allocator never pays; keep freed memory in the heap instead.
CACHING_MALLOC = {"MALLOC_MMAP_THRESHOLD_": "33554432", "MALLOC_TRIM_THRESHOLD_": "68719476736"}

BENCH_STOP = {"target_ci": 0.02, "min_rounds": 3, "time_cap": 900.0, "sweep_time_cap": 300.0}  # without --rounds


def _bench_stop(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--rounds N (a fixed count) or the target, minimum and cap (their defaults filled in), not both."""
    given = [f"--{k.replace('_', '-')}" for k in BENCH_STOP if getattr(args, k) is not None]
    if args.rounds is not None and given:
        parser.error(f"bench: --rounds is a fixed count of rounds; drop it or {', '.join(given)}")
    for key, default in BENCH_STOP.items():
        if getattr(args, key) is None:
            setattr(args, key, default)


class _BenchRefused(ValueError):
    """A bench input refused before any work: `hilore-verl bench: <message>` on stderr, exit code 2."""


def _bench(args: argparse.Namespace) -> int:
    """Re-run once under CACHING_MALLOC (Linux), then: methods, config, the banner, the run, its outputs."""
    if sys.platform.startswith("linux") and os.environ.get("MALLOC_TRIM_THRESHOLD_") is None:
        os.execve(sys.executable, [sys.executable, "-m", "hilore_verl.cli", *sys.argv[1:]],
                  {**os.environ, **CACHING_MALLOC})
    from hilore_verl.bench.run import WorkloadRefused, run_bench

    try:
        methods = _bench_methods(args)
        config = _bench_config(args, methods)
        print(_bench_banner(args, config, methods), flush=True)
        report = run_bench(config, methods, sweep=not args.no_sweep, peaks=not args.no_peaks,
                           risk_budget=args.risk_budget, budget=args.budget)
    except (_BenchRefused, WorkloadRefused) as err:
        print(f"hilore-verl bench: {err}", file=sys.stderr)
        return 2
    return _bench_outputs(args, config, report)


def _bench_methods(args: argparse.Namespace) -> tuple[str, ...]:
    """--methods (plus the shared-prompt rows with --shared-prompt), each a known method."""
    from hilore_verl.bench import METHODS
    from hilore_verl.bench.methods import DEFAULT, SHARED

    methods = DEFAULT if args.methods is None else tuple(m.strip() for m in args.methods.split(",") if m.strip())
    if args.shared_prompt:  # each of no GC, GC and HiLoRe also on the shared-prompt layout
        methods += tuple(m for m in SHARED if m not in methods)
    if args.no_pack and any(m in SHARED for m in methods):
        raise _BenchRefused("the shared-prompt layout packs sequences; drop --no-pack")
    if args.dense_attention and any(m in SHARED for m in methods):
        raise _BenchRefused("the shared-prompt layout computes attention per sequence; drop --dense-attention")
    bad = [m for m in methods if m not in METHODS] or ([] if methods else ["(none)"])
    if bad:
        raise _BenchRefused(f"unknown method {bad[0]!r}; valid: {', '.join(METHODS)}")
    return methods


def _bench_config(args: argparse.Namespace, methods: tuple[str, ...]):
    """The BenchConfig of the parsed flags; --plot's matplotlib and --model's config checked first."""
    from hilore_verl.bench import BenchConfig

    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise _BenchRefused("--plot needs matplotlib: pip install matplotlib") from None
    if args.model is not None:
        from hilore_verl.presets import load_config

        try:
            args.vocab = load_config(args.model).vocab_size  # prompts and responses drawn from the model's vocabulary
        except ValueError as err:
            raise _BenchRefused(str(err)) from None
    return BenchConfig(hidden_size=args.hidden, num_layers=args.layers, vocab_size=args.vocab,
                       num_groups=args.groups, group_size=args.group_size, max_response_len=args.response_len,
                       max_prompt_len=args.prompt_len, per_sequence_attention=not (args.no_pack or args.dense_attention),
                       rounds=args.rounds, min_rounds=args.min_rounds, target_ci=args.target_ci,
                       time_cap_s=args.time_cap, sweep_time_cap_s=args.sweep_time_cap, model=args.model, pack=not args.no_pack, autocast=not args.no_autocast,
                       profile_tokens=args.profile_tokens, zero_advantage_share=args.zero_advantage_share,
                       kl_coef=args.kl_coef, candidates=args.candidates)


def _bench_banner(args: argparse.Namespace, config, methods: tuple[str, ...]) -> str:
    """The line printed before the work: the methods, the workload, the planners' budget and the stop."""
    shape = (f"model {config.model} (random weights)" if config.model else
             f"Qwen2-shaped model hidden {config.hidden_size}, {config.num_layers} layers, vocabulary {config.vocab_size}")
    return (f"hilore-verl bench: {', '.join(methods)}; {shape}; {config.num_groups} x {config.group_size} "
            f"responses up to {config.max_response_len} tokens after prompts of {max(1, config.max_prompt_len // 2)}-"
            f"{config.max_prompt_len}; attention {'per sequence' if config.per_sequence_attention else 'over the whole row'}; "
            f"{100 * config.zero_advantage_share:g}% of groups at "
            f"zero advantage; KL loss coefficient {config.kl_coef:g}; planners' budget "
            f"{args.budget if args.budget == 'no_gc' else f'{args.budget:g}x GC'}'s peak; "
            + (f"{config.rounds} paired rounds per set" if config.rounds is not None else
               f"paired rounds until every 95% interval is within +-{100 * config.target_ci:g}% (at least "
               f"{config.min_rounds}, {config.time_cap_s:g} s of rounds at most for the methods, {config.sweep_time_cap_s:g} s and what they leave for the sweep)"))


def _bench_outputs(args: argparse.Namespace, config, report: dict) -> int:
    """The table, the files asked for, a note when an interval missed the target; 1 if a method failed."""
    from hilore_verl.bench.report import append_record, plot, save_json, save_markdown, table

    print(table(report))
    if args.json:
        save_json(report, args.json)
        print(f"wrote {args.json}")
    if args.md:
        save_markdown(report, args.md)
        print(f"wrote {args.md}")
    if args.plot:
        plot(report, args.plot)
        print(f"wrote {args.plot}")
    if not report["ci_reached"]:
        width = report["ci_half_width"]
        reached = "no interval (one round)" if width != width else f"the widest +-{100 * width:.1f}%"
        print(f"hilore-verl bench: not every 95% interval reached +-{100 * config.target_ci:g}% "
              + ("before the time cap" if config.rounds is None else f"in {config.rounds} fixed rounds")
              + f": {reached} (ci_reached false in the JSON)")
    if report.get("machine", {}).get("warning"):
        print(f"hilore-verl bench: {report['machine']['warning']}", file=sys.stderr)
    if args.append:
        append_record(report, args.append, " ".join(["hilore-verl", *sys.argv[1:]]))
        print(f"appended to {args.append}")
    failed = [m for m, v in report["methods"].items() if v["status"] == "failed"]
    return 1 if failed else 0


def _gpu_check(args: argparse.Namespace) -> int:
    from hilore_verl.gpucheck import STAGES, run_check

    if args.out is None:
        print("hilore-verl gpu-check: give --out DIR (or set $OUT)", file=sys.stderr)
        return 2
    chosen = args.only if args.only is not None else args.stages
    stages = tuple(s.strip() for s in chosen.split(",") if s.strip()) if chosen else STAGES
    bad = [s for s in stages if s not in STAGES] or ([] if stages else ["(none)"])
    if args.only is not None and len(stages) != 1:
        bad = bad or [args.only]
    if bad:
        print(f"hilore-verl gpu-check: unknown stage {bad[0]!r}; valid: {', '.join(STAGES)}", file=sys.stderr)
        return 2
    if args.device == "cuda" and "environment" not in stages:
        import torch

        if not torch.cuda.is_available():  # only the environment stage can say why
            print("hilore-verl gpu-check: no CUDA device here; run the environment stage for what is missing, "
                  "or `--device cpu --tiny` for the CPU rehearsal", file=sys.stderr)
            return 2
    command = " ".join(["hilore-verl", *sys.argv[1:]]) if sys.argv[1:2] == ["gpu-check"] else "hilore-verl gpu-check"
    report = run_check(args.out, args.device, args.tiny, stages, args.time_limit_s, command=command,
                       echo=lambda line: print(line, flush=True), keep_others=stages != STAGES)
    print(f"wrote {os.path.join(args.out, 'gpu_check.json')} and {os.path.join(args.out, 'gpu_check.md')}")
    return 0 if report["passed"] else 1


def _tiny_task(args) -> int:
    from hilore_verl.tiny.task import make_tiny_task

    root = make_tiny_task(args.out, shape=args.shape)
    print(f"hilore-verl tiny-task: {os.path.abspath(root)} (model/, train.parquet, val.parquet)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The parser of every subcommand (cli_args.py: their flags), each bound to the function that runs it."""
    from hilore_verl import __version__

    parser = Parser(prog="hilore-verl", description="HiLoRe activation memory manager for verl.")
    parser.add_argument("--version", action="version", version=f"hilore-verl {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    add_doctor(sub).set_defaults(func=_doctor)
    add_demo(sub).set_defaults(func=_demo)
    add_tiny_task(sub).set_defaults(func=_tiny_task)
    add_plan(sub).set_defaults(func=_plan)
    add_bench(sub).set_defaults(func=_bench)
    add_gpu_check(sub).set_defaults(func=_gpu_check)
    return parser


OUTPUTS = ("json", "plot", "append", "md")  # the options that name files written at the end


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "bench":
        _bench_stop(parser, args)
    for key in OUTPUTS:  # checked by cli_args.output_path; their missing folders are made before any work
        path = getattr(args, key, None)
        try:
            if path:
                os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        except OSError as err:
            print(f"hilore-verl {args.command}: cannot create the folder of --{key} {path!r}: {err.strerror}",
                  file=sys.stderr)
            return 2
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
