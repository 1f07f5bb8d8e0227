"""`hilore-verl bench`: every method on the same GRPO actor update, side by side in one run.

Order of work: build each method (planners profile and calibrate once), one gradient each against
no GC's (same weights), then timed steps taken round-robin over methods and budget-sweep points
(alternating cancels drift), then each method's physical peak in a fresh process. A method that
fails is marked failed with its error; the others still report.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from hilore_verl.bench import methods as M
from hilore_verl.bench.peak import FIRST_STEP
from hilore_verl.bench.stats import mean_ci, paired_ratio_ci, rotated
from hilore_verl.bench.workload import (MAX_PADDING_SHARE, BenchConfig, build_model, head_flop_share, make_batch,
                                        padding_share, static_bytes, tokens_of)
from hilore_verl.planner import BudgetConfig, Controller

SWEEP = (1.0, 1.1, 1.25, 1.5)  # x the full-GC peak; plus the no-GC peak
MAX_STATIC_SHARE = 0.60  # of GC's peak, as on a GPU running GC
GC_OVERHEAD_RANGE = (0.20, 0.33)  # GC's step time over no GC's on GPU jobs


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


def run_bench(config: BenchConfig = BenchConfig(), methods: tuple[str, ...] = M.METHODS, sweep: bool = True,
              peaks: bool = True, risk_budget: float = 0.01, budget: float | str = 1.10) -> dict:
    """`budget`: the planners' memory budget for their main rows, x GC's predicted peak, or "no_gc" (the
    predicted peak of keeping every unit)."""
    batch = make_batch(config)
    tokens = tokens_of(batch)
    if padding_share(batch) > MAX_PADDING_SHARE:
        raise WorkloadRefused(f"{100 * padding_share(batch):.0f}% of the padded batch's token positions are padding "
                              f"(a GPU job packs them: at most {100 * MAX_PADDING_SHARE:.0f}%); drop --no-pack")
    results: dict[str, dict] = {m: {"status": "ok"} for m in methods}
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
    built: dict[str, M.Method] = {}
    planners = [m for m in methods if m in M.PLANNERS]
    points = [(m, r) for m in planners for r in (*SWEEP, "no_gc")] if sweep else []
    progress = Progress(len(methods) * (2 + config.rounds) + len(points)
                        + ((len(methods) + ("hilore" in methods)) if peaks else 0))
    for name in sorted(methods, key=lambda m: m != "hilore"):
        progress.tick(f"building {name}" + (" (profiling, calibrating)" if name in M.PLANNERS else ""), advance=0)
        try:
            built[name] = M.build(name, config, batch, BudgetConfig("gc_ratio", 1.10), risk_budget)
            if name in M.PLANNERS and budget != 1.10:
                built[name].controller = _controller_at(built[name], batch, budget)
        except M.Unavailable as err:
            results[name] = {"status": "unavailable", "error": str(err)}
        except Exception as err:  # noqa: BLE001 - reported per method; the others go on
            results[name] = {"status": "failed", "error": f"{type(err).__name__}: {err}"}
        progress.tick(f"built {name}")
    exact = None
    if "no_gc" in built:  # the reference gradient; no_gc may not fit where GC does
        try:
            exact = built["no_gc"].gradient(batch)
        except Exception as err:  # noqa: BLE001 - the others are still timed, without a gradient error
            results["no_gc"] = {"status": "failed", "error": f"{type(err).__name__}: {err}"}
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
            results[name] = {"status": "failed", "error": f"{type(err).__name__}: {err}"}
            built.pop(name)
        progress.tick(f"gradient + warm-up {name}")
    variants = _sweep_controllers(built, points, batch)
    times: dict[object, list[float]] = {k: [] for k in [*built, *variants]}
    planning: dict[str, list[float]] = {k: [] for k in built}  # controller time inside each method's timed steps
    for r in range(config.rounds):  # paired rounds: every method once per round, the order rotated
        for key in rotated([k for k in times if not isinstance(k, tuple) or r == 0], r):  # sweep points: one round
            method = built[key[0]] if isinstance(key, tuple) else built[key]
            if isinstance(key, tuple):
                method.controller, saved = variants[key], method.controller
            try:
                times[key].append(method.step(batch))
                if isinstance(key, str) and method.controller is not None:
                    planning[key].append(method.plan_s[-1])
            finally:
                if isinstance(key, tuple):
                    method.controller = saved
            progress.tick(f"round {r + 1} {key if isinstance(key, str) else key[0] + '@' + str(key[1])}")
    for name in built:
        t = statistics.median(times[name])
        _, low, high = mean_ci([tokens / s for s in times[name]])
        results[name].update(step_s=t, tokens_per_s=tokens / t, tokens_per_s_ci=[low, high], step_times_s=times[name])
        for base in ("gc", "no_gc"):  # throughput over the baseline's, round by round
            if base in built:
                results[name][f"x_{base}"] = list(paired_ratio_ci(times[base], times[name]))
        method = built[name]
        if method.drop is not None:
            results[name]["skipped_token_share"] = method.skipped_token_share
        if method.controller is not None:
            c, trained = method.controller, method.trained_tokens(batch)  # budgets at what it forwards
            results[name].update(plan=dict(c.history[-1].plan), predicted_peak_bytes=c.history[-1].predicted_peak,
                                 budget_bytes=c.memory_budget_at(trained),
                                 gc_peak_predicted_bytes=c.predicted_peak(c.gc_plan(), trained),
                                 controller_share=sum(planning[name]) / sum(times[name]))
    sweep_rows = []
    for key, controller in variants.items():
        t = statistics.median(times[key])
        last = controller.history[-1]
        trained = built[key[0]].trained_tokens(batch)
        sweep_rows.append({"method": key[0], "budget": key[1], "budget_bytes": controller.memory_budget_at(trained),
                           "predicted_peak_bytes": last.predicted_peak, "step_s": t, "tokens_per_s": tokens / t,
                           "plan_counts": _counts(last.plan)})
    if peaks:
        with tempfile.TemporaryDirectory(prefix="hilore-bench-") as tmp:
            for name in methods:
                if results[name]["status"] == "ok":
                    results[name].update(early.get(name) or _peak(name, config, built[name], tmp))
                progress.tick(f"peak memory {name}")
            if results.get("hilore", {}).get("status") == "ok":  # profiling + calibration + one step, fresh
                results["hilore"]["first_step"] = _peak("hilore", config, None, tmp, first_step=True)
                progress.tick("first step hilore")
    any_model = built[next(iter(built))].model if built else None
    report = {"config": config.to_dict(), "budget": budget, "tokens": tokens, "padding_share": padding_share(batch),
              "static_bytes": static_bytes(any_model, config) if built else None,
              "head_flop_share": head_flop_share(any_model) if built else None, "methods": results, "sweep": sweep_rows,
              "versions": {"torch": torch.__version__, "python": sys.version.split()[0]},
              "device": "cuda" if torch.cuda.is_available() else "cpu", "threads": torch.get_num_threads()}
    report["summary"] = summarize(report)
    return report


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


def _all(controller: Controller, choice: str) -> dict[str, str]:
    return {u.name: choice for u in controller.costs.units}


def _controller_at(method: M.Method, batch, ratio: float | str) -> Controller:
    """The method's controller (same profile and calibration) under another budget: x GC's predicted peak,
    or "no_gc", the predicted peak of keeping every unit at the tokens it forwards."""
    base = method.controller
    if ratio == "no_gc":
        budget = BudgetConfig("gib", base.predicted_peak(_all(base, "keep"), method.trained_tokens(batch)) / 2**30)
    else:
        budget = BudgetConfig("gc_ratio", float(ratio))
    return Controller(base.runtime, base.costs, base.risk, budget, static_bytes=base.static_bytes,
                      risk_budget=base.risk_budget, token_bucket=base.token_bucket)


def _sweep_controllers(built: dict[str, M.Method], points, batch) -> dict[tuple, Controller]:
    return {(name, ratio): _controller_at(built[name], batch, ratio) for name, ratio in points if name in built}


def _peak(name: str, config: BenchConfig, method: M.Method | None, tmp: str, first_step: bool = False) -> dict:
    state = FIRST_STEP if first_step else None
    if not first_step and method is not None and method.controller is not None:
        state = os.path.join(tmp, f"{name}.pt")
        torch.save(M.planner_state(method), state)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")},
           "MALLOC_MMAP_THRESHOLD_": "131072", "OMP_NUM_THREADS": str(torch.get_num_threads())}
    cmd = [sys.executable, "-m", "hilore_verl.bench.peak", name, json.dumps(config.to_dict())] + ([state] if state else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    if proc.returncode != 0:
        return {"peak_error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"}
    m = json.loads(proc.stdout.strip().splitlines()[-1])
    if first_step:
        return {"seconds": m["first_step_s"], "gc_step_s": m["gc_step_s"],
                "peak_bytes": (m["peak_kib"] - m["base_kib"]) * 1024}
    return {"codec_code_bytes": m["codec_code_kib"] * 1024, "peak_bytes": (m["peak_kib"] - m["base_kib"]) * 1024,
            "rest_bytes": (m["rest_kib"] - m["base_kib"]) * 1024, "runtime_held_bytes": m["runtime_held_bytes"]}


def _counts(plan: dict[str, str]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for choice in plan.values():
        counts[choice] = counts.get(choice, 0) + 1
    return counts


def summarize(report: dict) -> dict:
    """The headline figures and the issue's targets, from measured numbers only."""
    r = report["methods"]
    ok = {k: v for k, v in r.items() if v.get("status") == "ok"}
    out: dict = {}
    if "gc" in ok and "no_gc" in ok:
        t_gc, t_no = ok["gc"]["step_s"], ok["no_gc"]["step_s"]
        out["gc_overhead"] = t_gc / t_no - 1
        out["gc_overhead_in_range"] = GC_OVERHEAD_RANGE[0] <= out["gc_overhead"] <= GC_OVERHEAD_RANGE[1]
        if "peak_bytes" in ok["gc"]:
            out["static_share_of_gc_peak"] = report["static_bytes"] / ok["gc"]["peak_bytes"]
    if "gc" in ok:
        t_gc = ok["gc"]["step_s"]
        if "hilore" in ok:
            t_h = ok["hilore"]["step_s"]
            if "no_gc" in ok:
                t_no = ok["no_gc"]["step_s"]
                out["hilore_recovered_share"] = (t_gc - t_h) / (t_gc - t_no) if t_gc > t_no else None
            out["hilore_throughput_vs_gc"] = t_gc / t_h
            out["hilore_throughput_vs_gc_ci"] = ok["hilore"].get("x_gc")  # [mean, low, high] of paired rounds
            if "gc_drop_zero_adv" in ok:
                t_d = ok["gc_drop_zero_adv"]["step_s"]
                out["hilore_vs_gc_drop_zero_adv"] = t_d / t_h
                out["hilore_vs_gc_drop_zero_adv_ci"] = list(paired_ratio_ci(ok["gc_drop_zero_adv"]["step_times_s"],
                                                                            ok["hilore"]["step_times_s"]))
            if "peak_bytes" in ok["hilore"] and "peak_bytes" in ok["gc"]:
                out["hilore_peak_vs_gc"] = ok["hilore"]["peak_bytes"] / ok["gc"]["peak_bytes"]
                limit = 1.10 * ok["gc"]["peak_bytes"]
                rivals = [k for k, v in ok.items() if k not in ("hilore", "no_gc", *M.RUNTIME_ONLY)
                          and v.get("peak_bytes", 1e30) <= limit]
                if rivals:
                    best = min(rivals, key=lambda k: ok[k]["step_s"])
                    out["best_other_within_budget"] = best
                    out["hilore_vs_best_other"] = ok[best]["step_s"] / t_h
            first = ok["hilore"].get("first_step", {})
            if "seconds" in first:  # profiling + calibration + one update, against a GC step in that process
                out["hilore_first_step_vs_gc_step"] = first["seconds"] / first["gc_step_s"]
                if "peak_bytes" in ok["gc"]:
                    out["hilore_first_step_peak_vs_gc"] = first["peak_bytes"] / ok["gc"]["peak_bytes"]
            out["hilore_grad_cosine"] = ok["hilore"].get("grad_cosine")
            out["hilore_controller_share"] = ok["hilore"].get("controller_share")
        if "runtime_keep" in ok and "no_gc" in ok:  # the runtime's own cost: hooks, bookkeeping, nothing to save
            out["runtime_keep_vs_no_gc"] = ok["runtime_keep"]["step_s"] / ok["no_gc"]["step_s"]
        if "runtime_recompute" in ok:  # unit-by-unit re-runs against one checkpointed region per layer
            out["runtime_recompute_vs_gc"] = ok["runtime_recompute"]["step_s"] / t_gc
    return out


def _ratio(ci) -> str:
    """'1.234 [1.200, 1.268]' from [mean, low, high] (no interval from one round)."""
    if not ci:
        return ""
    mean, low, high = ci
    return f"{mean:.3f}" + ("" if low != low else f" [{low:.3f}, {high:.3f}]")


def table(report: dict) -> str:
    r = report["methods"]
    gc = r.get("gc", {})
    lines = [f"{'method':<16} {'tokens/s':>9} {'x GC (95% CI, paired rounds)':>28} {'peak MiB':>9} {'x GC':>6} "
             f"{'held MiB':>9} {'grad cos':>9} {'rel err':>8} {'skipped':>7}  status"]
    for name, v in r.items():
        if v.get("status") != "ok":
            lines.append(f"{name:<16} {'':>9} {'':>28} {'':>9} {'':>6} {'':>9} {'':>9} {'':>8} {'':>7}  "
                         f"{v['status']}: {v.get('error', '')}")
            continue
        tput = f"{v['tokens_per_s']:9.0f} {_ratio(v.get('x_gc')):>28}"
        peak = (f"{v['peak_bytes'] / 2**20:9.1f} {v['peak_bytes'] / gc['peak_bytes']:6.3f}"
                if "peak_bytes" in v and "peak_bytes" in gc else f"{v.get('peak_error', '-')[:16]:>16}")
        held = f"{v['runtime_held_bytes'] / 2**20:9.1f}" if v.get("runtime_held_bytes") else f"{'-':>9}"
        skipped = f"{100 * v['skipped_token_share']:6.1f}%" if "skipped_token_share" in v else f"{'-':>7}"
        lines.append(f"{name:<16} {tput} {peak} {held} {v.get('grad_cosine', float('nan')):9.6f} "
                     f"{v.get('grad_rel_error', float('nan')):8.2e} {skipped}  ok")
    s = report["summary"]
    lines.append("")
    if "gc_overhead" in s:
        lines.append(f"GC overhead over no GC: {100 * s['gc_overhead']:.1f}% (GPU jobs: 20-33%"
                     + ("" if s["gc_overhead_in_range"] else "; OUT OF RANGE, ratios below are not a GPU job's") + "); "
                     f"padding {100 * report['padding_share']:.0f}% of token positions; "
                     f"vocabulary head {100 * report['head_flop_share']:.1f}% of forward matmul FLOPs; static "
                     f"{report['static_bytes'] / 2**20:.0f} MiB"
                     + (f" = {100 * s['static_share_of_gc_peak']:.0f}% of GC's peak" if "static_share_of_gc_peak" in s else ""))
    if s.get("hilore_throughput_vs_gc_ci"):
        lines.append(f"HiLoRe throughput over GC's, paired rounds: {_ratio(s['hilore_throughput_vs_gc_ci'])}")
    if s.get("hilore_vs_gc_drop_zero_adv_ci"):
        lines.append(f"HiLoRe throughput over gc_drop_zero_adv's, paired rounds: "
                     f"{_ratio(s['hilore_vs_gc_drop_zero_adv_ci'])}")
    if s.get("hilore_recovered_share") is not None:
        lines.append(f"HiLoRe: {s['hilore_throughput_vs_gc']:.3f}x GC throughput, recovers "
                     f"{100 * s['hilore_recovered_share']:.0f}% of GC's recompute overhead (target >= 60%)")
    if "runtime_keep_vs_no_gc" in s:
        lines.append(f"Runtime, every unit kept: {s['runtime_keep_vs_no_gc']:.3f}x no GC's step time")
    if "runtime_recompute_vs_gc" in s:
        lines.append(f"Runtime, every unit recomputed: {s['runtime_recompute_vs_gc']:.3f}x GC's step time")
    if "hilore_peak_vs_gc" in s:
        lines.append(f"HiLoRe peak: {s['hilore_peak_vs_gc']:.3f}x GC's (target <= 1.10)")
    if "hilore_first_step_peak_vs_gc" in s:
        lines.append(f"HiLoRe's first step (profiling, calibration, one update; fresh process): "
                     f"{s['hilore_first_step_vs_gc_step']:.2f}x a GC step's time (target <= 3), "
                     f"{s['hilore_first_step_peak_vs_gc']:.3f}x GC's peak (target <= 1.10)")
    if "hilore_vs_best_other" in s:
        lines.append(f"HiLoRe vs the fastest other method within 1.10x GC's peak ({s['best_other_within_budget']}): "
                     f"{s['hilore_vs_best_other']:.3f}x (target >= 1.05)")
    if s.get("hilore_controller_share") is not None:
        cosine = s.get("hilore_grad_cosine")
        lines.append(f"HiLoRe controller + solver: {100 * s['hilore_controller_share']:.2f}% of update time "
                     f"(target <= 2%)" + ("" if cosine is None else f"; gradient cosine {cosine:.6f} (target >= 0.999)"))
    if report["sweep"]:
        lines += ["", "budget sweep (predicted peak from the runtime's cost table; time measured)",
                  f"{'method':<15} {'budget':>8} {'budget MiB':>11} {'tokens/s':>9}  plan"]
        for row in report["sweep"]:
            lines.append(f"{row['method']:<15} {str(row['budget']):>8} {row['budget_bytes'] / 2**20:11.1f} "
                         f"{row['tokens_per_s']:9.0f}  {row['plan_counts']}")
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, v in report["methods"].items():
        if v.get("status") == "ok" and "peak_bytes" in v:
            ax.scatter(v["peak_bytes"] / 2**20, v["tokens_per_s"], label=name)
    for method in M.PLANNERS:
        rows = [r for r in report["sweep"] if r["method"] == method]
        if rows:
            ax.plot([r["predicted_peak_bytes"] / 2**20 for r in rows], [r["tokens_per_s"] for r in rows], "--",
                    marker="x", label=f"{method} budget sweep (predicted peak)")
    ax.set_xlabel("peak memory of the step, MiB")
    ax.set_ylabel("tokens / s")
    ax.set_title(f"actor update throughput against peak memory ({report['device']})")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def save_json(report: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(report, f, indent=1, default=lambda o: dataclasses.asdict(o) if dataclasses.is_dataclass(o) else str(o))


def append_record(report: dict, path: str, command: str) -> None:
    """One JSON line per run: when, what command, the summary and the per-method figures (no plans)."""
    methods = {k: {f: v for f, v in m.items() if f != "plan"} for k, m in report["methods"].items()}
    record = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "command": command,
              "device": report["device"], "threads": report["threads"], "versions": report["versions"],
              "config": report["config"], "summary": report["summary"], "methods": methods, "sweep": report["sweep"]}
    with open(path, "a") as f:
        f.write(json.dumps(record, default=str) + "\n")
