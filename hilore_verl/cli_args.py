"""The `hilore-verl` command's arguments: each subcommand's flags with their defaults and help, and the
parse-time types that check them (a bad value is one line on stderr and exit code 2, before any work).

cli.py builds the parser from these and binds each subcommand to what it runs."""

from __future__ import annotations

import argparse
import math
import os


class Parser(argparse.ArgumentParser):
    """A parse error is one line on stderr and exit code 2, like every other bad-input error of the command."""

    def error(self, message):
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def add_doctor(sub) -> argparse.ArgumentParser:
    return sub.add_parser("doctor", help="check versions, device, the verl plugin and verl's FSDP2 engine here")


def add_demo(sub) -> argparse.ArgumentParser:
    demo = sub.add_parser("demo", help="verl's main_ppo on a CPU recipe: HiLoRe next to verl's GC")
    demo.add_argument("--steps", type=positive, default=10, help="GRPO steps per arm (default 10)")
    demo.add_argument("--arms", default="hilore,gc", help="comma-separated: hilore, gc (default both)")
    demo.add_argument("--seed", type=seed, default=0, help="data order and rollout sampling (default 0)")
    demo.add_argument("--recipe", choices=("demo_cpu", "tiny_cpu"), default="demo_cpu",
                      help="demo_cpu (default: GRPO's proportions) or tiny_cpu (the tests' tiny task)")
    demo.add_argument("--task-dir", default=None, help="the task's folder, written if missing (default .demo_cpu, "
                                                       "or .tiny_cpu with --recipe tiny_cpu)")
    demo.add_argument("--recipe-dir", default=None, help="folder of the recipe's YAML (default: the repository's "
                                                         "recipes/grpo)")
    demo.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                      help="a hydra override for both arms (repeatable), e.g. actor_rollout_ref.actor.use_kl_loss=true")
    demo.add_argument("--json", metavar="PATH", type=output_path, help="also write the per-step records as JSON")
    demo.add_argument("--plot", metavar="FILE.png", type=output_path,
                      help="also draw reward and actor-update time per step for both arms")
    return demo


def add_tiny_task(sub) -> argparse.ArgumentParser:
    tiny = sub.add_parser("tiny-task", help="write the tiny CPU task recipes/grpo/tiny_cpu.yaml names (model, "
                                            "tokenizer, parquet data; no download)")
    tiny.add_argument("--out", default=".tiny_cpu", help="folder to write (default .tiny_cpu, as the recipe names)")
    tiny.add_argument("--shape", choices=("tiny", "demo"), default="tiny",
                      help="tiny (tests; recipes/grpo/tiny_cpu.yaml) or demo (recipes/grpo/demo_cpu.yaml, .demo_cpu)")
    return tiny


def add_plan(sub) -> argparse.ArgumentParser:
    plan = sub.add_parser("plan", help="the per-unit plan for a model on a GPU, from its config alone (no GPU)")
    plan.add_argument("--model", required=True,
                      help="a preset (e.g. qwen2.5-7b, llama-3-8b; see docs/config.md) or a HF model directory")
    plan.add_argument("--gpu-mem-gib", type=number(0.0, inclusive=False), default=80.0,
                      help="device memory per GPU in GiB, a finite number > 0 (default 80; an 80 GB H100 "
                           "reports 79.2 GiB to torch)")
    plan.add_argument("--micro-batch-tokens", type=positive, default=16384, help="tokens per micro-batch (default 16384)")
    plan.add_argument("--seq-len", type=positive, default=None, help="typical sequence length (default: the micro-batch)")
    plan.add_argument("--gpus", type=positive, default=8, help="FSDP ranks sharding the model (default 8)")
    plan.add_argument("--budget", default="gc_ratio:1.10", help="gc_ratio:X, gib:X or auto:headroom GiB (default gc_ratio:1.10)")
    plan.add_argument("--prompt-len", type=positive, default=None,
                      help="with --response-len and --group-size: also predict each group's prompt computed once")
    plan.add_argument("--response-len", type=positive, default=None, help="response tokens (with --prompt-len)")
    plan.add_argument("--group-size", type=positive, default=None, help="responses per prompt (with --prompt-len)")
    plan.add_argument("--json", metavar="PATH", type=output_path, help="also write the plan and the figures as JSON")
    return plan


def add_bench(sub) -> argparse.ArgumentParser:
    bench = sub.add_parser("bench", help="HiLoRe against GC, offload, boundary compression and a keep/recompute "
                                         "planner on one GRPO actor update, side by side")
    bench.add_argument("--methods", default=None,
                       help="comma-separated methods (default: no_gc, gc, verl_offload, hidden_offload, int8_boundary, "
                            "fp8_boundary, keep_recompute, hilore; every method: hilore_verl/bench/methods.py)")
    _add_bench_stop(bench)
    bench.add_argument("--candidates", type=int, choices=range(0, 9), default=4, metavar="N",
                       help="runner-ups of HiLoRe's plan (ranked by the cost model) run beside it at each budget of "
                            "the sweep, plus keep / recompute's plan (0-8, default 4; 0: none)")
    _add_bench_workload(bench)
    _add_bench_planners(bench)
    bench.add_argument("--no-sweep", action="store_true", help="skip the planners' budget sweep")
    bench.add_argument("--no-peaks", action="store_true", help="skip the per-method peak-memory processes")
    bench.add_argument("--json", metavar="PATH", type=output_path, help="write the report as JSON")
    bench.add_argument("--md", metavar="PATH", type=output_path, help="write the report as markdown")
    bench.add_argument("--plot", metavar="PATH", type=output_path, help="write throughput against peak memory as PNG")
    bench.add_argument("--append", metavar="PATH", type=output_path,
                       help="append this run (date, command, summary, per-method figures) as one JSON line")
    return bench


def _add_bench_stop(bench: argparse.ArgumentParser) -> None:
    """When the paired rounds stop: a target interval, a minimum and a time cap, or a fixed count (their
    defaults are filled in after parsing, by cli._bench_stop)."""
    bench.add_argument("--target-ci", type=number(0.0, inclusive=False), default=None,
                       help="paired rounds go on until every 95%% interval of a throughput over GC's is within +- "
                            "this share of the ratio (default 0.02: +-2%%)")
    bench.add_argument("--min-rounds", type=positive, default=None, help="rounds before the stop is weighed (default 3)")
    bench.add_argument("--time-cap", type=number(0.0, inclusive=False), default=None, metavar="SECONDS",
                       help="seconds of timed rounds for the methods' set; hit before the target, the interval "
                            "reached is reported (default 900)")
    bench.add_argument("--sweep-time-cap", type=number(0.0, inclusive=False), default=None, metavar="SECONDS",
                       help="seconds of timed rounds shared equally by the sweep's budgets (default 300)")
    bench.add_argument("--rounds", type=positive, default=None,
                       help="instead: exactly this many paired rounds per set (no target, no cap)")


def _add_bench_workload(bench: argparse.ArgumentParser) -> None:
    """The model and the GRPO mini-batch every method steps on."""
    bench.add_argument("--model", default=None, help="a preset (e.g. qwen2.5-1.5b) or HF model directory: its "
                                                     "architecture with random weights (default: the Qwen2 shape below)")
    bench.add_argument("--hidden", type=positive, default=512)
    bench.add_argument("--layers", type=positive, default=4)
    bench.add_argument("--vocab", type=positive, default=4000)
    bench.add_argument("--groups", type=positive, default=4, help="prompts per mini-batch (default 4)")
    bench.add_argument("--group-size", type=positive, default=8, help="responses per prompt (default 8)")
    bench.add_argument("--response-len", type=positive, default=192, help="longest response (default 192)")
    bench.add_argument("--prompt-len", type=positive, default=64,
                       help="longest prompt; prompts are drawn from half of it up to it (default 64)")
    bench.add_argument("--shared-prompt", action="store_true",
                       help="also run no_gc, gc and hilore with each group's prompt computed once "
                            "(methods no_gc_shared, gc_shared, hilore_shared)")
    bench.add_argument("--zero-advantage-share", type=share, default=0.5,
                       help="share of groups whose responses all get one reward, in [0, 1) (default 0.5)")
    bench.add_argument("--kl-coef", type=number(0.0, inclusive=True), default=0.0,
                       help="KL loss coefficient (k1 estimator: kl_coef / tokens on every response token's "
                            "coefficient; 0, the default: no KL loss)")
    bench.add_argument("--no-pack", action="store_true",
                       help="left-right padded sequences instead of one packed row (refused above 20%% padding)")
    bench.add_argument("--dense-attention", action="store_true",
                       help="SDPA over the whole packed row under a block-diagonal mask, which on the CPU computes "
                            "every pair of the row (default: attention per packed sequence, as a GPU's varlen "
                            "kernel computes it)")
    bench.add_argument("--no-autocast", action="store_true",
                       help="CPU: compute in fp32 instead of bf16 autocast over fp32 weights")


def _add_bench_planners(bench: argparse.ArgumentParser) -> None:
    """The planners' risk budget, memory budget and probe bound."""
    bench.add_argument("--risk-budget", type=number(0.0, inclusive=True), default=0.01,
                       help="HiLoRe's risk budget, a finite number >= 0 (default 0.01)")
    bench.add_argument("--budget", type=bench_budget, default=1.10,
                       help="the planners' memory budget: a ratio >= 1 of GC's predicted peak, or no_gc (the "
                            "predicted peak of keeping every unit); default 1.10")
    bench.add_argument("--profile-tokens", type=non_negative_int, default=2048,
                       help="the planners' probe bound in tokens, as hilore.profile_tokens (also at most 1/8 of "
                            "the step's tokens; 0: only that; default 2048)")


def add_gpu_check(sub) -> argparse.ArgumentParser:
    check = sub.add_parser("gpu-check", help="validate and measure hilore-verl on one GPU in one run (<= 7 min; "
                                             "needs torch, triton, transformers, numpy only)")
    check.add_argument("--out", default=os.environ.get("OUT") or None,
                       help="folder for gpu_check.json, gpu_check.md and per-stage files (default: $OUT when set)")
    check.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cuda (default) or cpu")
    check.add_argument("--tiny", action="store_true", help="tiny sizes in every stage (the CPU rehearsal)")
    stages = check.add_mutually_exclusive_group()
    stages.add_argument("--stages", default=None, help="comma-separated subset of: environment, codecs, runtime, "
                                                       "shared_prompt, model, profile (default: all, in that order)")
    stages.add_argument("--only", default=None, metavar="STAGE",
                        help="rerun one stage; the other stages' rows of the report already in --out stay")
    check.add_argument("--time-limit-s", type=number(0.0, inclusive=False), default=None,
                       help="the whole check's time limit in seconds (default 420); each stage's own limit "
                            "follows what the environment stage measured")
    return check


def _integer(value: str, ok, expected: str) -> int:
    """`value` as an int for which `ok` holds; otherwise the parse error "expected <expected>, got ..."."""
    try:
        n = int(value)
    except ValueError:
        n = None
    if n is None or not ok(n):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {value!r}")
    return n


def positive(value: str) -> int:
    return _integer(value, lambda n: n >= 1, "an integer >= 1")


def seed(value: str) -> int:
    return _integer(value, lambda n: 0 <= n < 2**63, "an integer in [0, 2**63)")


def non_negative_int(value: str) -> int:
    return _integer(value, lambda n: n >= 0, "an integer >= 0")


def share(value: str) -> float:
    try:
        x = float(value)
    except ValueError:
        x = math.nan
    if not 0 <= x < 1:
        raise argparse.ArgumentTypeError(f"expected a share in [0, 1), got {value!r}")
    return x


def number(low: float, inclusive: bool):
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


def bench_budget(text: str) -> float | str:
    """The bench's --budget: a ratio >= 1 of GC's predicted peak (what hilore.budget accepts: every row,
    the timed rounds and the fresh-process peaks, runs at it), or no_gc."""
    if text == "no_gc":
        return text
    try:
        return number(1.0, inclusive=True)(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected a ratio >= 1 of GC's peak (a gc_ratio below 1 is below what "
                                         f"GC itself needs) or no_gc, got {text!r}") from None


def output_path(value: str) -> str:
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
