"""The check's model stage: a real architecture, every method in a fresh process, side by side.

Per model (a preset's architecture with random weights, layers truncated to fit the stage's time;
on CUDA bf16 compute with AdamW on fp32 master weights, as verl's FSDP2 mixed precision trains) and method:

    python -m hilore_verl.gpucheck.model METHOD CONFIG_JSON     -> one JSON line

builds the method, runs its first step (for HiLoRe: probing, profiling, calibration and one update,
through `Session`, the code verl's engine runs), then `steps` timed updates after resetting the
peak counters: median seconds, peak allocated and reserved (CUDA) or the resident high-water mark
(CPU). The stage then sets HiLoRe's measured peak and time against GC's and against its own
predictions (predicted time: no GC's measured step + the cost model's extra seconds of the plan).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

import torch

from hilore_verl.gpucheck.context import Context, StageReport
from hilore_verl.host_memory import peak_resident_bytes, resident_bytes

BASELINES = ("no_gc", "gc", "int8_boundary", "fp8_boundary")
SESSIONS = {"keep_recompute": ("gc_ratio", 1.10, 0.0), "hilore": ("gc_ratio", 1.10, 0.01),
            "hilore_auto": ("auto", 2.0, 0.01)}  # method -> budget mode, value, risk budget
METHODS = ("gc", "hilore", "no_gc", "keep_recompute", "int8_boundary", "fp8_boundary", "hilore_auto")  # run order


def workloads(ctx: Context) -> list[dict]:
    """(bench config, methods, seconds allowed per method process) per model."""
    if ctx.tiny:
        return [{"config": dict(hidden_size=128, num_layers=2, vocab_size=512, num_groups=2, group_size=4,
                                max_prompt_len=24, max_response_len=48, profile_tokens=256),
                 "methods": ("no_gc", "gc", "int8_boundary", "keep_recompute", "hilore", "hilore_auto"),
                 "timeout_s": 120, "steps": 2}]
    shape = dict(num_groups=4, group_size=8, max_prompt_len=128, max_response_len=256, master_fp32=True)
    return [{"config": dict(model="qwen2.5-1.5b", model_layers=8, **shape), "methods": METHODS,
             "timeout_s": 60, "steps": 3},
            {"config": dict(model="qwen2.5-7b", model_layers=3, **shape), "methods": ("no_gc", "gc", "hilore"),
             "timeout_s": 60, "steps": 3}]


def _reset_peaks(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")


def _peaks(cuda: bool) -> dict:
    if cuda:
        return {"peak_allocated_bytes": torch.cuda.max_memory_allocated(),
                "peak_reserved_bytes": torch.cuda.max_memory_reserved()}
    return {"peak_rss_bytes": peak_resident_bytes()}


def measure(method: str, config: dict, steps: int) -> dict:
    """One method in this process: build, first step, `steps` timed steps."""
    from hilore_verl.bench import methods as M
    from hilore_verl.bench.session_passes import SessionMethod
    from hilore_verl.bench.actor_update import BenchConfig, make_batch, tokens_of
    from hilore_verl.config import HiLoReConfig
    from hilore_verl.kernels import warm_up
    from hilore_verl.planner import BudgetConfig

    cuda = torch.cuda.is_available()
    bench = BenchConfig(**config)
    batch = make_batch(bench)
    warm_up("cuda" if cuda else "cpu")
    base = torch.cuda.memory_allocated() if cuda else resident_bytes()
    start = time.perf_counter()
    if method in SESSIONS:
        mode, value, risk = SESSIONS[method]
        built = SessionMethod(method, bench, HiLoReConfig(enable=True, budget=BudgetConfig(mode, value),
                                                          risk_budget=risk, profile_tokens=bench.profile_tokens))
    else:
        built = M.build(method, bench, batch)
    build_s = time.perf_counter() - start
    first = built.step(batch)  # HiLoRe's: probing, profiling, calibration and the update
    _reset_peaks(cuda)
    times = [built.step(batch) for _ in range(steps)]
    out = {"method": method, "tokens": tokens_of(batch), "base_bytes": base, "build_s": round(build_s, 4),
           "first_step_s": round(first, 4), "step_s": statistics.median(times), "steps_s": times, **_peaks(cuda)}
    if method in SESSIONS:
        out.update(built.predicted(tokens_of(batch)))
        out["metrics"] = {k: v for k, v in built.metrics.items() if isinstance(v, (int, float))}
    return out


def _run_method(method: str, config: dict, steps: int, timeout: float, env: dict) -> dict:
    cmd = [sys.executable, "-m", "hilore_verl.gpucheck.model", method, json.dumps(config), str(steps)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"method": method, "status": "timeout", "error": f"over {timeout:.0f} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"method": method, "status": "failed", "error": " | ".join(tail)[:400]}
    return {"status": "ok", **json.loads(lines[-1])}


def _peak_of(r: dict) -> float | None:
    """What the method itself took at its peak: the peak over the process's memory before the model was
    built (on the CPU that base is Python, torch and the libraries; on CUDA about nothing)."""
    peak = r.get("peak_allocated_bytes", r.get("peak_rss_bytes"))
    return None if peak is None else peak - r.get("base_bytes", 0)


def model_stage(report: StageReport, ctx: Context) -> None:
    env = dict(os.environ)
    deadline = float(env.get("HILORE_VERL_STAGE_DEADLINE", "inf"))
    loads = workloads(ctx)
    pending = sum(len(load["methods"]) for load in loads)
    for load in loads:  # each model gets its share of the time left, by its number of methods
        share = (deadline - time.time()) * len(load["methods"]) / pending
        pending -= len(load["methods"])
        until = min(deadline, time.time() + share)
        config = load["config"]
        label = config.get("model") or f"qwen2-shaped hidden {config['hidden_size']}"
        if config.get("model_layers"):
            label += f" ({config['model_layers']} layers)"
        results = {}
        for method in load["methods"]:
            left = until - time.time()
            if left < 10:  # a method not measured is a failed check, not a quiet gap in the table
                results[method] = r = {"method": method, "status": "skipped", "error": "no time left for this model"}
            else:
                r = _run_method(method, config, load["steps"], min(load["timeout_s"], left), env)
                results[method] = r
            report.check(f"{label}: {method} ran", r["status"] == "ok", r.get("error", ""))
            report.figure(f"{label}: methods", results)
        _compare(report, label, results, budget_is_checked=ctx.device == "cuda" and not ctx.tiny)


def _compare(report: StageReport, label: str, results: dict, budget_is_checked: bool) -> None:
    """HiLoRe against GC (peak and time ratios) and against its own predictions. The budget is a check
    on a GPU at real sizes; at tiny CPU sizes the resident high-water mark is mostly the allocator's and
    the compiled codecs' (variants compiled after the base was taken), so there it is a figure only."""
    ok = {m: r for m, r in results.items() if r.get("status") == "ok"}
    gc, no_gc = ok.get("gc"), ok.get("no_gc")
    summary = {}
    for name, r in ok.items():
        if gc is not None and _peak_of(gc) and _peak_of(r):
            summary[name] = {"peak_vs_gc": round(_peak_of(r) / _peak_of(gc), 3),
                             "time_vs_gc": round(r["step_s"] / gc["step_s"], 3)}
    for name in [m for m in SESSIONS if m in ok]:
        r = ok[name]
        peak = _peak_of(r)
        if peak and r.get("predicted_peak_bytes"):
            summary.setdefault(name, {})["predicted_peak_vs_measured"] = round(r["predicted_peak_bytes"] / peak, 3)
        if no_gc is not None and gc is not None:
            summary.setdefault(name, {}).update(
                predicted_time_vs_gc=round((no_gc["step_s"] + r["predicted_extra_s"])
                                           / (no_gc["step_s"] + r["gc_predicted_extra_s"]), 3),
                first_step_vs_gc_step=round(r["first_step_s"] / gc["step_s"], 2))
    report.figure(f"{label}: summary", summary)
    hilore = ok.get("hilore")
    if hilore is not None and gc is not None and _peak_of(hilore) and _peak_of(gc):
        ratio = _peak_of(hilore) / _peak_of(gc)
        record = report.check if budget_is_checked else lambda name, ok, detail: report.figure(name, detail)
        record(f"{label}: hilore's peak within its 1.10x GC budget (+5%)", ratio <= 1.10 * 1.05,
                     f"measured {ratio:.3f}x GC's peak")


if __name__ == "__main__":
    print(json.dumps(measure(sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]))))
