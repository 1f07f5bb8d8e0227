"""The `hilore-verl` command."""

from __future__ import annotations

import argparse
import math
import os
import sys


def _doctor(args: argparse.Namespace) -> int:
    from hilore_verl.doctor import run

    return run()


def _demo(args: argparse.Namespace) -> int:
    import json

    from hilore_verl.integration.tools.demo import DemoConfig, run_demo

    config = DemoConfig(steps=args.steps, seed=args.seed, recipe_dir=args.recipe_dir or "", task_dir=args.task_dir,
                        overrides=tuple(args.override))
    arms = tuple(a.strip() for a in args.arms.split(",") if a.strip())
    bad = [a for a in arms if a not in ("hilore", "gc")] or ([] if arms else ["(none)"])
    if bad:
        print(f"hilore-verl demo: unknown demo arm {bad[0]!r}; valid: hilore, gc (e.g. --arms hilore,gc)",
              file=sys.stderr)
        return 2
    print(f"hilore-verl demo: verl's main_ppo, GRPO on the tiny CPU recipe (random 2-layer Qwen2, copy the "
          f"first digit), 2 ranks through Ray, {config.steps} steps per arm ({', '.join(arms)})", flush=True)
    result = run_demo(config, arms, echo=lambda line: print(line, flush=True))
    print()
    print(result.table())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result.to_dict(), f, indent=1)
        print(f"wrote {args.json}")
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


def _bench_budget(text: str) -> float | str:
    if text == "no_gc":
        return text
    try:
        return _number(0.0, inclusive=False)(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected a ratio > 0 of GC's peak or no_gc, got {text!r}") from None


BENCH_STOP = {"target_ci": 0.02, "min_rounds": 3, "time_cap": 600.0}  # without --rounds


def _bench_stop(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--rounds N (a fixed count) or the target, minimum and cap (their defaults filled in), not both."""
    given = [f"--{k.replace('_', '-')}" for k in BENCH_STOP if getattr(args, k) is not None]
    if args.rounds is not None and given:
        parser.error(f"bench: --rounds is a fixed count of rounds; drop it or {', '.join(given)}")
    for key, default in BENCH_STOP.items():
        if getattr(args, key) is None:
            setattr(args, key, default)


def _bench(args: argparse.Namespace) -> int:
    import os

    if sys.platform.startswith("linux") and os.environ.get("MALLOC_TRIM_THRESHOLD_") is None:
        os.execve(sys.executable, [sys.executable, "-m", "hilore_verl.cli", *sys.argv[1:]],
                  {**os.environ, **CACHING_MALLOC})
    from hilore_verl.bench import METHODS, BenchConfig
    from hilore_verl.bench.report import append_record, plot, save_json, save_markdown, table
    from hilore_verl.bench.run import run_bench

    from hilore_verl.bench.methods import SHARED

    methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    if args.shared_prompt:  # each of no GC, GC and HiLoRe also on the shared-prompt layout
        methods += tuple(m for m in SHARED if m not in methods)
    if args.no_pack and any(m in SHARED for m in methods):
        print("hilore-verl bench: the shared-prompt layout packs sequences; drop --no-pack", file=sys.stderr)
        return 2
    bad = [m for m in methods if m not in METHODS] or ([] if methods else ["(none)"])
    if bad:
        print(f"hilore-verl bench: unknown method {bad[0]!r}; valid: {', '.join(METHODS)}", file=sys.stderr)
        return 2
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("hilore-verl bench: --plot needs matplotlib: pip install matplotlib", file=sys.stderr)
            return 2
    if args.model is not None:
        from hilore_verl.presets import load_config

        try:
            args.vocab = load_config(args.model).vocab_size  # prompts and responses drawn from the model's vocabulary
        except ValueError as err:
            print(f"hilore-verl bench: {err}", file=sys.stderr)
            return 2
    config = BenchConfig(hidden_size=args.hidden, num_layers=args.layers, vocab_size=args.vocab,
                         num_groups=args.groups, group_size=args.group_size, max_response_len=args.response_len,
                         max_prompt_len=args.prompt_len, per_sequence_attention=any(m in SHARED for m in methods),
                         rounds=args.rounds, min_rounds=args.min_rounds, target_ci=args.target_ci,
                         time_cap_s=args.time_cap, model=args.model, pack=not args.no_pack, autocast=not args.no_autocast,
                         profile_tokens=args.profile_tokens, zero_advantage_share=args.zero_advantage_share,
                         kl_coef=args.kl_coef, candidates=args.candidates)
    shape = (f"model {config.model} (random weights)" if config.model else
             f"Qwen2-shaped model hidden {config.hidden_size}, {config.num_layers} layers, vocabulary {config.vocab_size}")
    print(f"hilore-verl bench: {', '.join(methods)}; {shape}; {config.num_groups} x {config.group_size} "
          f"responses up to {config.max_response_len} tokens after prompts of {max(1, config.max_prompt_len // 2)}-"
          f"{config.max_prompt_len}; {100 * config.zero_advantage_share:g}% of groups at "
          f"zero advantage; KL loss coefficient {config.kl_coef:g}; planners' budget "
          f"{args.budget if args.budget == 'no_gc' else f'{args.budget:g}x GC'}'s peak; "
          + (f"{config.rounds} paired rounds per set" if config.rounds is not None else
             f"paired rounds until every 95% interval is within +-{100 * config.target_ci:g}% (at least "
             f"{config.min_rounds}, {config.time_cap_s:g} s of rounds at most)"), flush=True)
    from hilore_verl.bench.run import WorkloadRefused

    try:
        report = run_bench(config, methods, sweep=not args.no_sweep, peaks=not args.no_peaks,
                           risk_budget=args.risk_budget, budget=args.budget)
    except WorkloadRefused as err:
        print(f"hilore-verl bench: {err}", file=sys.stderr)
        return 2
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
    if args.append:
        append_record(report, args.append, " ".join(["hilore-verl", *sys.argv[1:]]))
        print(f"appended to {args.append}")
    failed = [m for m, v in report["methods"].items() if v["status"] == "failed"]
    return 1 if failed else 0


def _gpu_check(args: argparse.Namespace) -> int:
    from hilore_verl.gpucheck import STAGES, run_check

    stages = tuple(s.strip() for s in args.stages.split(",") if s.strip()) if args.stages else tuple(STAGES)
    bad = [s for s in stages if s not in STAGES] or ([] if stages else ["(none)"])
    if bad:
        print(f"hilore-verl gpu-check: unknown stage {bad[0]!r}; valid: {', '.join(STAGES)}", file=sys.stderr)
        return 2
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("hilore-verl gpu-check: no CUDA device here; run it on a GPU machine, or `--device cpu --tiny` "
                  "for the CPU rehearsal", file=sys.stderr)
            return 2
    command = " ".join(["hilore-verl", *sys.argv[1:]]) if sys.argv[1:2] == ["gpu-check"] else "hilore-verl gpu-check"
    report = run_check(args.out, args.device, args.tiny, stages, args.time_limit_s, command=command,
                       echo=lambda line: print(line, flush=True))
    print(f"wrote {os.path.join(args.out, 'gpu_check.json')} and {os.path.join(args.out, 'gpu_check.md')}")
    return 0 if report["passed"] else 1


def _tiny_task(args) -> int:
    from hilore_verl.tiny_task import make_tiny_task

    root = make_tiny_task(args.out)
    print(f"hilore-verl tiny-task: {os.path.abspath(root)} (model/, train.parquet, val.parquet)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="hilore-verl", description="HiLoRe activation memory manager for verl.")
    from hilore_verl import __version__

    parser.add_argument("--version", action="version", version=f"hilore-verl {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    doctor = sub.add_parser("doctor", help="check versions, device, the verl plugin and verl's FSDP2 engine here")
    doctor.set_defaults(func=_doctor)
    demo = sub.add_parser("demo", help="verl's main_ppo on the tiny CPU recipe: HiLoRe next to verl's GC")
    demo.add_argument("--steps", type=_positive, default=20, help="GRPO steps per arm (default 20)")
    demo.add_argument("--arms", default="hilore,gc", help="comma-separated: hilore, gc (default both)")
    demo.add_argument("--seed", type=_seed, default=0, help="data order and rollout sampling (default 0)")
    demo.add_argument("--task-dir", default=".tiny_cpu", help="the tiny task's folder, written if missing "
                                                              "(default .tiny_cpu)")
    demo.add_argument("--recipe-dir", default=None, help="folder of tiny_cpu.yaml (default: the repository's "
                                                         "recipes/grpo)")
    demo.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                      help="a hydra override for both arms (repeatable), e.g. data.train_batch_size=16")
    demo.add_argument("--json", metavar="PATH", type=_output_path, help="also write the per-step records as JSON")
    demo.set_defaults(func=_demo)
    tiny = sub.add_parser("tiny-task", help="write the tiny CPU task recipes/grpo/tiny_cpu.yaml names (model, "
                                            "tokenizer, parquet data; no download)")
    tiny.add_argument("--out", default=".tiny_cpu", help="folder to write (default .tiny_cpu, as the recipe names)")
    tiny.set_defaults(func=_tiny_task)
    plan = sub.add_parser("plan", help="the per-unit plan for a model on a GPU, from its config alone (no GPU)")
    plan.add_argument("--model", required=True,
                      help="a preset (e.g. qwen2.5-7b, llama-3-8b; see docs/config.md) or a HF model directory")
    plan.add_argument("--gpu-mem-gib", type=_number(0.0, inclusive=False), default=80.0,
                      help="device memory per GPU, a finite number > 0 (default 80)")
    plan.add_argument("--micro-batch-tokens", type=_positive, default=16384, help="tokens per micro-batch (default 16384)")
    plan.add_argument("--seq-len", type=_positive, default=None, help="typical sequence length (default: the micro-batch)")
    plan.add_argument("--gpus", type=_positive, default=8, help="FSDP ranks sharding the model (default 8)")
    plan.add_argument("--budget", default="gc_ratio:1.10", help="gc_ratio:X, gib:X or auto[:headroom GiB] (default gc_ratio:1.10)")
    plan.add_argument("--prompt-len", type=_positive, default=None,
                      help="with --response-len and --group-size: also predict each group's prompt computed once")
    plan.add_argument("--response-len", type=_positive, default=None, help="response tokens (with --prompt-len)")
    plan.add_argument("--group-size", type=_positive, default=None, help="responses per prompt (with --prompt-len)")
    plan.add_argument("--json", metavar="PATH", type=_output_path, help="also write the plan and the figures as JSON")
    plan.set_defaults(func=_plan)
    bench = sub.add_parser("bench", help="HiLoRe against GC, offload, boundary compression and a keep/recompute "
                                         "planner on one GRPO actor update, side by side")
    bench.add_argument("--methods", default="no_gc,gc,verl_offload,hidden_offload,int8_boundary,fp8_boundary,"
                       "keep_recompute,hilore", help="comma-separated methods (default: all)")
    bench.add_argument("--target-ci", type=_number(0.0, inclusive=False), default=None,
                       help="paired rounds go on until every 95%% interval of a throughput over GC's is within +- "
                            "this share of the ratio (default 0.02: +-2%%)")
    bench.add_argument("--min-rounds", type=_positive, default=None, help="rounds before the stop is weighed (default 3)")
    bench.add_argument("--time-cap", type=_number(0.0, inclusive=False), default=None, metavar="SECONDS",
                       help="seconds of timed rounds for the whole run, half for the methods, half shared by the "
                            "sweep's budgets; hit before the target, the interval reached is reported (default 600)")
    bench.add_argument("--rounds", type=_positive, default=None,
                       help="instead: exactly this many paired rounds per set (no target, no cap)")
    bench.add_argument("--candidates", type=int, choices=range(0, 9), default=4, metavar="N",
                       help="runner-ups of HiLoRe's plan (ranked by the cost model) run beside it at each budget of "
                            "the sweep, plus keep / recompute's plan (0-8, default 4; 0: none)")
    bench.add_argument("--model", default=None, help="a preset (e.g. qwen2.5-1.5b) or HF model directory: its "
                                                     "architecture with random weights (default: the Qwen2 shape below)")
    bench.add_argument("--hidden", type=_positive, default=512)
    bench.add_argument("--layers", type=_positive, default=4)
    bench.add_argument("--vocab", type=_positive, default=4000)
    bench.add_argument("--groups", type=_positive, default=4, help="prompts per mini-batch (default 4)")
    bench.add_argument("--group-size", type=_positive, default=8, help="responses per prompt (default 8)")
    bench.add_argument("--response-len", type=_positive, default=192, help="longest response (default 192)")
    bench.add_argument("--prompt-len", type=_positive, default=64,
                       help="longest prompt; prompts are drawn from half of it up to it (default 64)")
    bench.add_argument("--shared-prompt", action="store_true",
                       help="also run no_gc, gc and hilore with each group's prompt computed once "
                            "(methods no_gc_shared, gc_shared, hilore_shared)")
    bench.add_argument("--zero-advantage-share", type=_share, default=0.5,
                       help="share of groups whose responses all get one reward, in [0, 1) (default 0.5)")
    bench.add_argument("--kl-coef", type=_number(0.0, inclusive=True), default=0.0,
                       help="KL loss coefficient (k1 estimator: kl_coef / tokens on every response token's "
                            "coefficient; 0, the default: no KL loss)")
    bench.add_argument("--no-pack", action="store_true",
                       help="left-right padded sequences instead of one packed row (refused above 20%% padding)")
    bench.add_argument("--no-autocast", action="store_true",
                       help="CPU: compute in fp32 instead of bf16 autocast over fp32 weights")
    bench.add_argument("--risk-budget", type=_number(0.0, inclusive=True), default=0.01,
                       help="HiLoRe's risk budget, a finite number >= 0 (default 0.01)")
    bench.add_argument("--budget", type=_bench_budget, default=1.10,
                       help="the planners' memory budget: a ratio > 0 of GC's predicted peak, or no_gc (the "
                            "predicted peak of keeping every unit); default 1.10")
    bench.add_argument("--profile-tokens", type=_non_negative_int, default=2048,
                       help="the planners' probe bound in tokens, as hilore.profile_tokens (also at most 1/8 of "
                            "the step's tokens; 0: only that; default 2048)")
    bench.add_argument("--no-sweep", action="store_true", help="skip the planners' budget sweep")
    bench.add_argument("--no-peaks", action="store_true", help="skip the per-method peak-memory processes")
    bench.add_argument("--json", metavar="PATH", type=_output_path, help="write the report as JSON")
    bench.add_argument("--md", metavar="PATH", type=_output_path, help="write the report as markdown")
    bench.add_argument("--plot", metavar="PATH", type=_output_path, help="write throughput against peak memory as PNG")
    bench.add_argument("--append", metavar="PATH", type=_output_path,
                       help="append this run (date, command, summary, per-method figures) as one JSON line")
    bench.set_defaults(func=_bench)
    check = sub.add_parser("gpu-check", help="validate and measure hilore-verl on one GPU in one run (<= 8 min; "
                                             "needs torch, triton, transformers, numpy only)")
    check.add_argument("--out", required=True, help="folder for gpu_check.json, gpu_check.md and per-stage files")
    check.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cuda (default) or cpu")
    check.add_argument("--tiny", action="store_true", help="tiny sizes in every stage (the CPU rehearsal)")
    check.add_argument("--stages", default=None, help="comma-separated subset of: environment, codecs, runtime, "
                                                      "model, profile (default: all, in that order)")
    check.add_argument("--time-limit-s", type=_number(0.0, inclusive=False), default=480.0,
                       help="the whole check's time limit in seconds (default 480); each stage has its own too")
    check.set_defaults(func=_gpu_check)
    return parser


class _Parser(argparse.ArgumentParser):
    """A parse error is one line on stderr and exit code 2, like every other bad-input error of the command."""

    def error(self, message):
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def _positive(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value!r}")
    return n


def _share(value: str) -> float:
    try:
        x = float(value)
    except ValueError:
        x = math.nan
    if not 0 <= x < 1:
        raise argparse.ArgumentTypeError(f"expected a share in [0, 1), got {value!r}")
    return x


def _seed(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        n = -1
    if not 0 <= n < 2**63:
        raise argparse.ArgumentTypeError(f"expected an integer in [0, 2**63), got {value!r}")
    return n


def _non_negative_int(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value!r}")
    return n


def _number(low: float, inclusive: bool):
    """A finite float above `low` (or equal to it when inclusive): nan, inf and out-of-range fail at parse time."""

    def number(value: str) -> float:
        try:
            x = float(value)
        except ValueError:
            x = math.nan
        if not math.isfinite(x) or x < low or (x == low and not inclusive):
            raise argparse.ArgumentTypeError(f"expected a finite number {'>=' if inclusive else '>'} {low:g}, "
                                             f"got {value!r}")
        return x

    return number


def _output_path(value: str) -> str:
    """A file written at the end of the run, checked now so that a bad path fails before the work, not after
    it: not a folder, and its nearest existing folder writable (`main` creates the missing ones)."""
    path = os.path.abspath(os.path.expanduser(value))
    if value.endswith(("/", os.sep)) or os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{value!r} is a folder; give a file path")
    existing = os.path.dirname(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise argparse.ArgumentTypeError(f"cannot write {value!r}: {existing!r} is not a folder")
    if not os.access(existing, os.W_OK | os.X_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise argparse.ArgumentTypeError(f"cannot write {value!r}: permission denied")
    return path if value.startswith("~") else value


OUTPUTS = ("json", "plot", "append", "md")  # the options that name files written at the end


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "bench":
        _bench_stop(parser, args)
    for key in OUTPUTS:  # checked by _output_path; their missing folders are made before any work
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
