"""`hilore-verl bench`: every method on the same GRPO actor update, side by side in one run.

Order of work (`run_bench`, one private function per phase): refuse a workload unlike a GPU job (too
much padding; static memory too large a share of GC's peak, measured first in a fresh process; on a GPU,
the methods' model copies not fitting at once), build each method (planners profile and calibrate once),
one gradient each against no GC's (same weights) and a warm-up step, HiLoRe's runner-up plans beside its
choice at each budget, then paired rounds of timed steps (every method once per round, the order
rotated: alternating cancels drift) until every throughput ratio to GC's is resolved to the target or
the time cap is hit (bench/rounds.py), then the same for each budget of the planners' sweep (GC and
the planners at that budget), then each method's physical peak in a fresh process. A method that
fails is marked failed with its error; the others still report. The report: bench/report.py.

Before the rounds, Python's cyclic collector is run and what it tracks frozen (`gc.freeze`): every
method's model, optimizer and planner, ~377k objects at the default, out of its scans. A full collection
over them took ~180 ms, about a tenth of the step it fell in, in whichever method's step allocated past
the threshold: noise in that round, and a pause a job with one model pays a fraction of. Collections of
what the steps allocate still run inside them. Measured (the default methods' set, 240 s cap, same
machine, one after the other): rounds spread 4.4% -> 3.3%, the widest interval +-2.0% -> +-1.5% after 21
rounds; int8 / fp8 boundary's steps 4.5% / 3.9% -> 1.4% / 1.5%.
"""

from __future__ import annotations

import dataclasses
import gc as python_gc
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from hilore_verl.bench import methods as M
from hilore_verl.bench.candidates import candidate_controllers
from hilore_verl.bench.peak import FIRST_STEP
from hilore_verl.bench.session_passes import plan_counts
from hilore_verl.bench.report import (GC_OVERHEAD_RANGE, append_record, plot, save_json,  # noqa: F401 - re-exported
                                      save_markdown, summarize, table)
from hilore_verl.bench.rounds import StopRule, half_widths, run_rounds, sweep_cap
from hilore_verl.bench.timer import Timer, spelled
from hilore_verl.measure.intervals import mean_ci, paired_ratio_ci
from hilore_verl.bench.actor_update import (MAX_PADDING_SHARE, BenchConfig, build_model, head_flop_share, make_batch,
                                        padding_share, static_bytes, tokens_of)
from hilore_verl.bench.machine import MachineLoad
from hilore_verl.planner import BudgetConfig, Controller
from hilore_verl.runtime import KEEP

SWEEP = (1.0, 1.1, 1.25, 1.5)  # x the full-GC peak; plus the no-GC peak
MAX_STATIC_SHARE = 0.60  # of GC's peak, as on a GPU running GC


class WorkloadRefused(ValueError):
    """The workload is not shaped like a GPU job (the message names the flag to change)."""


class Progress:
    def __init__(self, total: int, stream=sys.stderr):
        self.total, self.done, self.stream, self.start = total, 0, stream, time.perf_counter()

    def tick(self, label: str, advance: int = 1) -> None:
        self.done += advance
        filled = int(30 * self.done / self.total)
        self.stream.write(f"\r[{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total} "
                          f"{time.perf_counter() - self.start:5.0f}s {label:<36}")
        self.stream.flush()
        if self.done == self.total:
            self.stream.write("\n")

    def line(self, text: str) -> None:
        """A line of its own (the rounds' progress); the bar is drawn again at the next tick."""
        self.stream.write(f"\r{text:<80}\n")
        self.stream.flush()


def run_bench(config: BenchConfig = BenchConfig(), methods: tuple[str, ...] = M.METHODS, sweep: bool = True,
              peaks: bool = True, risk_budget: float = 0.01, budget: float | str = 1.10) -> dict:
    """`budget`: the planners' memory budget for their main rows, x GC's predicted peak, or "no_gc" (the
    predicted peak of keeping every unit). A budget no row could run at is refused here, before any work."""
    if budget != "no_gc":
        BudgetConfig("gc_ratio", budget)  # ValueError below 1, as hilore.budget (and so the peak rows) refuses it
    load = MachineLoad()
    load.start()
    batch = make_batch(config)
    tokens = tokens_of(batch)
    early = _refuse_unshaped_workload(config, methods, batch, peaks)
    results: dict[str, dict] = {m: {"status": "ok"} for m in methods}
    progress = Progress(len(methods) * 2 + ((len(methods) + ("hilore" in methods)) if peaks else 0))
    built = _build_methods(config, methods, batch, budget, risk_budget, results, progress)
    _gradients_and_warm_up(built, batch, results, progress)
    timer = _timer_with_runner_ups(config, methods, built, batch, sweep)
    rule = stop_rule(config)
    python_gc.collect()
    python_gc.freeze()  # what is built so far out of the cyclic collector's scans (the module's docstring)
    try:
        sets = _paired_rounds(built, timer, rule, progress)
    finally:
        python_gc.unfreeze()
    _method_rows(built, timer, sets[0], tokens, results)
    sweep_rows = _sweep_rows(timer, sets[1:], tokens)
    if peaks:
        _peaks(config, methods, built, results, early, progress)
    report = _report(config, budget, batch, tokens, rule, sets, built, results, sweep_rows)
    report["machine"] = load.stop()
    return report


def _refuse_unshaped_workload(config: BenchConfig, methods, batch, peaks: bool) -> dict[str, dict]:
    """WorkloadRefused unless the workload is shaped like a GPU job: at most MAX_PADDING_SHARE padding; with
    peaks and GC among the methods, static memory at most MAX_STATIC_SHARE of GC's peak (measured first, in
    a fresh process, and returned as the early peaks); on a GPU, every method's model copy fitting at once."""
    if padding_share(batch) > MAX_PADDING_SHARE:
        raise WorkloadRefused(f"{100 * padding_share(batch):.0f}% of the padded batch's token positions are padding "
                              f"(a GPU job packs them: at most {100 * MAX_PADDING_SHARE:.0f}%); drop --no-pack")
    early: dict[str, dict] = {}
    if peaks and "gc" in methods:  # the proportions first: a workload unlike a GPU job is refused before timing
        with tempfile.TemporaryDirectory(prefix="hilore-bench-") as tmp:
            early["gc"] = _peak("gc", config, None, tmp)
        static = static_bytes(build_model(config), config)
        if "peak_bytes" in early["gc"] and static > MAX_STATIC_SHARE * early["gc"]["peak_bytes"]:
            raise WorkloadRefused(
                f"static memory ({static / 2**20:.0f} MiB: weights, gradients, AdamW) is "
                f"{100 * static / early['gc']['peak_bytes']:.0f}% of GC's peak ({early['gc']['peak_bytes'] / 2**20:.0f} "
                f"MiB); a GPU job is at most {100 * MAX_STATIC_SHARE:.0f}%: raise the tokens per step (--groups, "
                "--group-size, --response-len) or shrink the model (--hidden, --layers, --vocab)")
    _refuse_if_resident_copies_do_not_fit(config, methods)
    return early


def _build_methods(config: BenchConfig, methods, batch, budget: float | str, risk_budget: float, results: dict,
                   progress: Progress) -> dict[str, M.Method]:
    """Each method on a fresh model, HiLoRe first (the planners profile and calibrate once); the planners'
    controllers moved to `budget`. A method that cannot be built is marked unavailable or failed."""
    built: dict[str, M.Method] = {}
    for name in sorted(methods, key=lambda m: m != "hilore"):
        progress.tick(f"building {name}" + (" (profiling, calibrating)" if name in M.PLANNERS else ""), advance=0)
        try:
            built[name] = M.build(name, config, batch, BudgetConfig("gc_ratio", 1.10), risk_budget)
            if name in M.PLANNERS and budget != 1.10:
                built[name].session.controller = _controller_at(built[name], batch, budget)
        except M.Unavailable as err:
            results[name] = {"status": "unavailable", "error": str(err)}
        except Exception as err:  # noqa: BLE001 - reported per method; the others go on
            results[name] = _failed(err)
        progress.tick(f"built {name}")
    return built


def _gradients_and_warm_up(built: dict[str, M.Method], batch, results: dict, progress: Progress) -> None:
    """No GC's gradient as the reference, then per method its gradient against it (same weights) and one
    warm-up step. A method that fails is marked failed and leaves `built`."""
    exact = None
    if "no_gc" in built:  # the reference gradient; no_gc may not fit where GC does
        try:
            exact = built["no_gc"].gradient(batch)
        except Exception as err:  # noqa: BLE001 - the others are still timed, without a gradient error
            results["no_gc"] = _failed(err)
            built.pop("no_gc")
            _free_device_memory()
    for name, method in list(built.items()):
        try:
            if exact is not None:
                grad = method.gradient(batch)
                results[name]["grad_cosine"] = float(grad @ exact / (grad.norm() * exact.norm()))
                results[name]["grad_rel_error"] = float((grad - exact).norm() / exact.norm())
            method.step(batch)  # warm-up
        except Exception as err:  # noqa: BLE001
            results[name] = _failed(err)
            built.pop(name)
        progress.tick(f"gradient + warm-up {name}")


def _timer_with_runner_ups(config: BenchConfig, methods, built: dict[str, M.Method], batch, sweep: bool) -> Timer:
    """The timer of every key: the methods, each planner at each budget of the sweep, and HiLoRe's runner-up
    plans beside its choice at each budget (after one step of its first plan, which they are ranked against)."""
    planners = [m for m in methods if m in M.SWEPT]
    points = [(m, r) for m in planners for r in (*SWEEP, "no_gc")] if sweep else []
    variants = _sweep_controllers(built, points, batch)
    timer = Timer(built, variants, batch)
    if config.candidates and "hilore" in built:  # HiLoRe's runner-up plans beside its choice, per budget
        for ratio in [r for r in SWEEP if ("hilore", r) in variants]:
            timer.step(("hilore", ratio))  # its first plan: what the runner-ups are ranked against
            chosen = variants[("hilore", ratio)]
            for i, fixed in enumerate(candidate_controllers(chosen, config.candidates, timer.trained["hilore"])):
                timer.add(("hilore", ratio, i + 1), fixed)
    return timer


def _paired_rounds(built: dict[str, M.Method], timer: Timer, rule: StopRule, progress: Progress) -> list:
    """The methods' paired rounds, then each budget's own (GC's steps their baseline), each set stopped by
    `rule` within its share of the time cap. The first set is the methods'."""
    ratios = [r for r in (*SWEEP, "no_gc") if any(k[1] == r for k in timer.variants)]
    sets = [run_rounds("methods", list(built), timer.step, rule, rule.time_cap_s, log=progress.line,
                       settled=timer.settled)]
    for i, ratio in enumerate(ratios):  # each budget its own paired rounds, with GC's steps as their baseline
        keys = ["gc"] * ("gc" in built) + [k for k in timer.variants if k[1] == ratio]
        cap = sweep_cap(rule, sets[0].elapsed_s, sum(s.elapsed_s for s in sets[1:]), len(ratios) - i)
        sets.append(run_rounds(f"budget {ratio}", keys, timer.step, rule, cap, log=progress.line,
                               settled=timer.settled))
    return sets


def _method_rows(built: dict[str, M.Method], timer: Timer, main, tokens: int, results: dict) -> None:
    """Each built method's row from the methods' rounds; the planners' plan, predictions and budget besides."""
    widths = half_widths(main.times)
    for name in built:
        results[name].update(_timed_row(main.times, name, tokens, widths))
        method = built[name]
        if method.drop is not None:
            results[name]["skipped_token_share"] = method.skipped_token_share
        if method.controller is not None:
            c, trained = method.controller, timer.trained[name]  # budgets at what it forwards
            results[name].update(plan=spelled(c.history[-1].plan), predicted_peak_bytes=c.history[-1].predicted_peak,
                                 budget_bytes=c.memory_budget_at(trained),
                                 gc_peak_predicted_bytes=c.predicted_peak(c.gc_plan(), trained),
                                 **timer.timed(name, main.times[name]), **timer.trial(name))


def _sweep_rows(timer: Timer, budget_sets: list, tokens: int) -> list[dict]:
    """One row per planner key of each budget's rounds: a runner-up with its plan, a planner's choice with its
    throughput over its fastest runner-up's."""
    rows = []
    for st in budget_sets:
        widths = half_widths(st.times)
        for key in (k for k in st.times if isinstance(k, tuple)):
            controller, trained = timer.variants[key], timer.trained[key[0]]
            last = controller.history[-1]
            row = {"method": key[0], "budget": key[1], "budget_bytes": controller.memory_budget_at(trained),
                   **_timed_row(st.times, key, tokens, widths), "predicted_peak_bytes": last.predicted_peak,
                   "ci_reached": st.reached, "plan_counts": plan_counts(last.plan),
                   **timer.timed(key, st.times[key]), **timer.trial(key)}
            if len(key) > 2:  # a runner-up of HiLoRe's plan at this budget
                row.update(candidate=key[2], plan=spelled(last.plan))
            else:
                row.update(_against_runner_ups(st.times, key))
            rows.append(row)
    return rows


def _peaks(config: BenchConfig, methods, built: dict[str, M.Method], results: dict, early: dict,
           progress: Progress) -> None:
    """Each method's physical peak in a fresh process (GC's from the refusal check), then HiLoRe's first step
    (profiling + calibration + one step) fresh."""
    with tempfile.TemporaryDirectory(prefix="hilore-bench-") as tmp:
        for name in methods:
            if results[name]["status"] == "ok":
                results[name].update(early.get(name) or _peak(name, config, built[name], tmp))
                if results[name].get("peak_plan", results[name].get("plan")) != results[name].get("plan"):
                    progress.line(f"WARNING: {name}'s peak process ran another plan than its timed rounds")
            progress.tick(f"peak memory {name}")
        if results.get("hilore", {}).get("status") == "ok":  # profiling + calibration + one step, fresh
            first = _peak("hilore", config, None, tmp, first_step=True)
            if "peak_error" not in first:  # its time where the kernels' caches and malloc are as in a user's job
                timed = _peak("hilore", config, None, tmp, first_step=True, as_measured=False)
                keys = ("seconds", "gc_step_s", "model_build_s")
                if "peak_error" in timed:  # no time, rather than the peak process's slower one
                    first = {**{k: v for k, v in first.items() if k not in keys}, "time_error": timed["peak_error"]}
                else:
                    first.update({k: timed[k] for k in keys})
            results["hilore"]["first_step"] = first
            progress.tick("first step hilore")


def _report(config: BenchConfig, budget: float | str, batch, tokens: int, rule: StopRule, sets: list,
            built: dict[str, M.Method], results: dict, sweep_rows: list[dict]) -> dict:
    """The report (bench/report.py reads it): the workload, the stop rule and every set of rounds, the rows,
    the environment, and its summary."""
    any_model = built[next(iter(built))].model if built else None
    spread = [st.half_width for st in sets]
    report = {"config": config.to_dict(), "budget": budget, "tokens": tokens, "padding_share": padding_share(batch),
              "stop": dataclasses.asdict(rule), "rounds": [st.to_dict() for st in sets],
              "ci_reached": all(st.reached for st in sets),
              "ci_half_width": math.nan if any(math.isnan(w) for w in spread) else max(spread),
              "static_bytes": static_bytes(any_model, config) if built else None,
              "head_flop_share": head_flop_share(any_model) if built else None, "methods": results, "sweep": sweep_rows,
              "versions": {"torch": torch.__version__, "python": sys.version.split()[0]},
              "device": "cuda" if torch.cuda.is_available() else "cpu", "threads": torch.get_num_threads()}
    report["summary"] = summarize(report)
    return report


def _failed(err: Exception) -> dict:
    """A method's result when it raised: failed, with the error's type and message."""
    return {"status": "failed", "error": f"{type(err).__name__}: {err}"}


def _against_runner_ups(times: dict, key: tuple) -> dict:
    """The chosen plan's throughput over its fastest measured runner-up's (paired, [mean, low, high])."""
    rivals = [k for k in times if isinstance(k, tuple) and len(k) > 2 and k[:2] == key]
    if not rivals:
        return {}
    fastest = min(rivals, key=lambda k: statistics.fmean(times[k]))
    return {"fastest_runner_up": fastest[2], "x_fastest_runner_up": list(paired_ratio_ci(times[fastest], times[key]))}


def stop_rule(config: BenchConfig) -> StopRule:
    return StopRule(config.target_ci, config.min_rounds, config.time_cap_s, config.rounds,
                    sweep_time_cap_s=config.sweep_time_cap_s)


def _timed_row(times: dict, key, tokens: int, widths: dict) -> dict:
    """A row's timing figures from its set's rounds: median and mean step, throughput (mean of the rounds')
    with its 95% interval, its throughput over GC's and no GC's (paired, [mean, low, high])."""
    steps = times[key]
    mean, low, high = mean_ci([tokens / s for s in steps])
    row = {"step_s": statistics.median(steps), "measured_step_s": statistics.fmean(steps), "tokens_per_s": mean,
           "tokens_per_s_ci": [low, high], "step_times_s": steps, "rounds": len(steps),
           "ci_half_width": widths.get(key, 0.0)}
    if len(steps) > 1:  # the rounds' spread: of the step time, and of its ratio to GC's in the same round
        row["round_cv"] = statistics.stdev(steps) / statistics.fmean(steps)
        if "gc" in times and key != "gc":
            ratios = [s / g for s, g in zip(steps, times["gc"])]
            row["round_cv_vs_gc"] = statistics.stdev(ratios) / statistics.fmean(ratios)
    for base in ("gc", "no_gc"):  # throughput over the baseline's, round by round
        if base in times:
            row[f"x_{base}"] = list(paired_ratio_ci(times[base], steps))
    return row


def _free_device_memory() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _refuse_if_resident_copies_do_not_fit(config: BenchConfig, methods) -> None:
    """The timed rounds interleave the methods, so every method's model copy (weights, gradients, AdamW)
    is resident at once; on a GPU that must fit beside one step's activations."""
    if not torch.cuda.is_available():
        return
    params = sum(p.numel() for p in build_model(config, "meta").parameters())
    need = params * 4 * (2 if config.master_fp32 else 1) * 2 * len(methods)  # weights + grads + 2 moments
    free, _ = torch.cuda.mem_get_info()
    if need > 0.7 * free:
        raise WorkloadRefused(f"{len(methods)} methods x {params / 1e9:.2f} B parameters stay resident for the "
                              f"interleaved rounds ({need / 2**30:.0f} GiB of {free / 2**30:.0f} GiB free): name fewer "
                              "--methods, or run `hilore-verl gpu-check`, which runs each method in its own process")


def _controller_at(method: M.Method, batch, ratio: float | str) -> Controller:
    """The method's controller (same profile and calibration) under another budget: x GC's predicted peak,
    or "no_gc", the predicted peak of keeping every unit at the tokens it forwards."""
    base = method.controller
    if ratio == "no_gc":
        budget = BudgetConfig("gib", base.predicted_peak(base.all_units(KEEP), method.layer_tokens(batch)) / 2**30)
    else:
        budget = BudgetConfig("gc_ratio", float(ratio))
    return Controller(base.runtime, base.costs, base.risk, budget, static_bytes=base.static_bytes,
                      gradient_bytes=base.gradient_bytes, risk_budget=base.risk_budget, token_bucket=base.token_bucket)


def _sweep_controllers(built: dict[str, M.Method], points, batch) -> dict[tuple, Controller]:
    return {(name, ratio): _controller_at(built[name], batch, ratio) for name, ratio in points if name in built}


# The CPU kernels' per-shape caches (ATen's oneDNN cache, oneDNN's primitives) stay resident: 62-100 MiB
# each on the default workload's per-sequence attention, not activations (docs/benchmarks/bench_cpu.md).
NO_KERNEL_CACHES = {"LRU_CACHE_CAPACITY": "1", "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "0"}


def _peak(name: str, config: BenchConfig, method: M.Method | None, tmp: str, first_step: bool = False,
          as_measured: bool = True) -> dict:
    """One method's peak (or HiLoRe's first step) in a fresh process. `as_measured` False: in this process's
    own environment instead of the one that makes peaks comparable (no kernel caches, large blocks mapped):
    times there are a user's (on the CPU a GC step took 1.2 s here, 9.6 s without the caches)."""
    state = FIRST_STEP if first_step else None
    if not first_step and method is not None and method.controller is not None:
        state = os.path.join(tmp, f"{name}.pt")
        torch.save(method.state(), state)
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}
    if as_measured:
        env = {**{k: v for k, v in env.items() if not k.startswith("MALLOC_")}, "MALLOC_MMAP_THRESHOLD_": "131072",
               **NO_KERNEL_CACHES}
    cmd = [sys.executable, "-m", "hilore_verl.bench.peak", name, json.dumps(config.to_dict())] + ([state] if state else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    if proc.returncode != 0:
        return {"peak_error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"}
    m = json.loads(proc.stdout.strip().splitlines()[-1])
    if first_step:
        return {"seconds": m["first_step_s"], "gc_step_s": m["gc_step_s"], "model_build_s": m["model_build_s"],
                "peak_bytes": (m["peak_kib"] - m["base_kib"]) * 1024}
    return {"codec_code_bytes": m["codec_code_kib"] * 1024, "peak_bytes": (m["peak_kib"] - m["base_kib"]) * 1024,
            "rest_bytes": (m["rest_kib"] - m["base_kib"]) * 1024, "runtime_held_bytes": m["runtime_held_bytes"],
            **({"peak_arm": m["arm"]} if m.get("arm") else {}), **({"peak_plan": m["plan"]} if m.get("plan") else {}),
            **({"tensor_peak_bytes": m["tensor_peak_kib"] * 1024} if m.get("tensor_peak_kib") is not None else {})}

