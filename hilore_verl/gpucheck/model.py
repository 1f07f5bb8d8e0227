"""The check's model stage: a real architecture, every method in a fresh process, side by side.

Per model (a preset's architecture with random weights, layers truncated to fit the stage's time;
on CUDA bf16 compute with AdamW on fp32 master weights, as verl's FSDP2 mixed precision trains) and method:

    python -m hilore_verl.gpucheck.model METHOD CONFIG_JSON     -> one JSON line

builds the method, runs its first step (for HiLoRe: probing, profiling, calibration and one update,
through `Session`, the code verl's engine runs), then `steps` timed updates after emptying the
allocator's cache and resetting the peak counters: median seconds, peak allocated and reserved (CUDA)
or the resident high-water mark (CPU). The stage runs the rows of ROWS (each a method on a workload
where every compared row does the same work), most important first, writes each row as it completes,
then sets each pair of PAIRS side by side and each planner against its own predictions (predicted
time: no GC's measured step + the cost model's extra seconds of the plan).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

import torch

from hilore_verl.gpucheck import process
from hilore_verl.gpucheck.context import Context, StageReport
from hilore_verl.measure.host_memory import peak_resident_bytes, resident_bytes

SESSIONS = {"keep_recompute": ("gc_ratio", 1.10, 0.0), "hilore": ("gc_ratio", 1.10, 0.01),
            "hilore_shared": ("gc_ratio", 1.10, 0.01), "hilore_auto": ("auto", 2.0, 0.01)}
# method -> budget mode, value, risk budget

# The rows a model is measured in, each (row, method, workload): "plain" gives every token a loss term,
# so every method does the same work; "skip" puts half the groups at zero advantage and attends per
# sequence (the shared-prompt attention with nothing shared: the pairs a varlen kernel computes), so
# GC with those sequences dropped, HiLoRe (which skips them itself) and HiLoRe with each group's prompt
# computed once compare on the same tokens. Rows are run in ROWS' order (ROW_ORDER) across the models: what the check
# is for first, so a stage stopped at its limit has measured it.
ROWS = {"gc": ("gc", "plain"), "hilore": ("hilore", "plain"), "no_gc": ("no_gc", "plain"),
        "gc+skip": ("gc_drop_zero_adv", "skip"), "hilore+skip": ("hilore", "skip"),
        "hilore+skip+shared": ("hilore_shared", "skip"), "keep_recompute": ("keep_recompute", "plain"),
        "int8_boundary": ("int8_boundary", "plain"), "fp8_boundary": ("fp8_boundary", "plain"),
        "hilore_auto": ("hilore_auto", "plain")}
ROW_ORDER = tuple(ROWS)
WORKLOADS = {"plain": dict(zero_advantage_share=0.0), "skip": dict(zero_advantage_share=0.5, per_sequence_attention=True)}


def workloads(ctx: Context) -> list[dict]:
    """Per model: its bench config, its rows, seconds allowed per row's process, timed steps."""
    if ctx.tiny:
        return [{"config": dict(hidden_size=128, num_layers=2, vocab_size=512, num_groups=2, group_size=4,
                                max_prompt_len=24, max_response_len=48, profile_tokens=256),
                 "rows": tuple(r for r in ROW_ORDER if r != "fp8_boundary"), "timeout_s": 120, "steps": 2}]
    shape = dict(num_groups=4, group_size=8, max_prompt_len=128, max_response_len=256, master_fp32=True)
    return [{"config": dict(model="qwen2.5-1.5b", model_layers=8, **shape), "rows": ROW_ORDER,
             "timeout_s": 90, "steps": 3},
            {"config": dict(model="qwen2.5-7b", model_layers=3, **shape), "rows": ("gc", "hilore", "no_gc"),
             "timeout_s": 90, "steps": 3}]


def schedule(loads: list[dict]) -> list[tuple[int, str]]:
    """(model index, row) in the order they run: row by row of ROW_ORDER, each model in turn."""
    return [(i, row) for row in ROW_ORDER for i, load in enumerate(loads) if row in load["rows"]]


def _reset_peaks(cuda: bool) -> None:
    if cuda:  # the cache the first step grew (probes, profiling) is not the steady step's reserve
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
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
    """One method in this process: build, first step, `steps` timed steps (peaks over those)."""
    from hilore_verl.bench import methods as M
    from hilore_verl.bench.session_passes import SessionMethod
    from hilore_verl.bench.actor_update import BenchConfig, make_batch, tokens_of
    from hilore_verl.training.config import HiLoReConfig
    from hilore_verl.kernels import warm_up
    from hilore_verl.planner import BudgetConfig

    cuda = torch.cuda.is_available()
    bench = BenchConfig(**config)
    batch = make_batch(bench)
    warm_up("cuda" if cuda else "cpu")
    base = torch.cuda.memory_allocated() if cuda else resident_bytes()
    base_reserved = torch.cuda.memory_reserved() if cuda else None
    start = time.perf_counter()
    if method in SESSIONS:
        mode, value, risk = SESSIONS[method]
        built = SessionMethod(method, bench, HiLoReConfig(enable=True, budget=BudgetConfig(mode, value),
                                                          risk_budget=risk, profile_tokens=bench.profile_tokens),
                              shared=method == "hilore_shared")
    else:
        built = M.build(method, bench, batch)
    build_s = time.perf_counter() - start
    first = built.step(batch)  # HiLoRe's: probing, profiling, calibration and the update
    _reset_peaks(cuda)
    times = [built.step(batch) for _ in range(steps)]
    out = {"method": method, "tokens": tokens_of(batch), "trained_tokens": built.trained_tokens(batch),
           "layer_tokens": built.layer_tokens(batch), "base_bytes": base, "base_reserved_bytes": base_reserved,
           "build_s": round(build_s, 4),
           "first_step_s": round(first, 4), "step_s": statistics.median(times), "steps_s": times, **_peaks(cuda)}
    if method in SESSIONS:
        out.update(built.predicted(tokens_of(batch)))
        out["metrics"] = {k: v for k, v in built.metrics.items() if isinstance(v, (int, float))}
    return out


def _run_method(method: str, config: dict, steps: int, timeout: float, env: dict) -> dict:
    cmd = [sys.executable, "-m", "hilore_verl.gpucheck.model", method, json.dumps(config), str(steps)]
    try:
        proc = process.run(cmd, env, timeout)
    except subprocess.TimeoutExpired:
        return {"method": method, "status": "timeout", "error": f"over {timeout:.0f} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"method": method, "status": "failed", "error": " | ".join(tail)[:400]}
    return {"status": "ok", **json.loads(lines[-1])}


def _peak_of(r: dict, reserved: bool = False) -> float | None:
    """What the method itself took at its peak: the peak over the process's memory before the model was
    built (on the CPU that base is Python, torch and the libraries; on CUDA about nothing). `reserved`:
    the CUDA caching allocator's reserved peak (what the device gave the process) instead of allocated."""
    if reserved:
        peak, base = r.get("peak_reserved_bytes"), r.get("base_reserved_bytes") or 0
    else:
        peak, base = r.get("peak_allocated_bytes", r.get("peak_rss_bytes")), r.get("base_bytes", 0)
    return None if peak is None else peak - base


def _label(config: dict) -> str:
    label = config.get("model") or f"qwen2-shaped hidden {config['hidden_size']}"
    return label + (f" ({config['model_layers']} layers)" if config.get("model_layers") else "")


def model_stage(report: StageReport, ctx: Context) -> None:
    env = dict(os.environ)
    deadline = float(env.get("HILORE_VERL_STAGE_DEADLINE", "inf"))
    loads = workloads(ctx)
    results: list[dict] = [{} for _ in loads]
    for index, row in schedule(loads):
        load = loads[index]
        label, (method, workload) = _label(load["config"]), ROWS[row]
        left = deadline - time.time()
        if left < 10:  # a row not measured is a failed check, not a quiet gap in the table
            r = {"method": method, "status": "skipped", "error": "no time left in the stage"}
        else:
            config = {**load["config"], **WORKLOADS[workload]}
            r = _run_method(method, config, load["steps"], min(load["timeout_s"], left), env)
        results[index][row] = {"workload": workload, **r}
        report.check(f"{label}: {row} ran", r["status"] == "ok", r.get("error", ""))
        report.figure(f"{label}: methods", results[index])  # each row as it completes
    targets = ctx.device == "cuda" and not ctx.tiny
    for load, rows in zip(loads, results):
        _compare(report, _label(load["config"]), rows, targets)


# (row, against): the comparisons the stage reports, each on the same tokens and the same work
PAIRS = (("hilore", "gc"), ("keep_recompute", "gc"), ("hilore_auto", "gc"), ("no_gc", "gc"), ("int8_boundary", "gc"),
         ("fp8_boundary", "gc"), ("gc+skip", "gc"), ("hilore+skip", "gc+skip"), ("hilore+skip+shared", "hilore+skip"),
         ("hilore+skip+shared", "gc+skip"))


def _compare(report: StageReport, label: str, rows: dict, targets: bool) -> None:
    """Peak and time ratios of each pair in PAIRS; each planner's predictions against its measurements;
    on a GPU at real sizes the issue's targets as checks (at tiny CPU sizes the resident high-water mark
    is mostly the allocator's and the compiled codecs', so there they are figures)."""
    ok = {row: r for row, r in rows.items() if r.get("status") == "ok"}
    ratios = {}
    for row, against in PAIRS:
        a, b = ok.get(row), ok.get(against)
        if a is None or b is None or not (_peak_of(a) and _peak_of(b)):
            continue
        ratios[f"{row} / {against}"] = {"peak": round(_peak_of(a) / _peak_of(b), 3),
                                       "throughput": round(b["step_s"] / a["step_s"], 3)}
        if _peak_of(a, reserved=True) and _peak_of(b, reserved=True):
            ratios[f"{row} / {against}"]["reserved_peak"] = round(_peak_of(a, True) / _peak_of(b, True), 3)
    report.figure(f"{label}: ratios", ratios)
    predictions = {}
    no_gc = ok.get("no_gc")
    for row in [r for r in ok if ROWS[r][0] in SESSIONS and ROWS[r][1] == "plain"]:
        r, entry = ok[row], {}
        if _peak_of(r) and r.get("predicted_peak_bytes"):
            entry["peak"] = round(r["predicted_peak_bytes"] / _peak_of(r), 3)
        if no_gc is not None:  # predicted step: keeping every unit (no GC, measured) + the plan's extra seconds
            entry["step"] = round((no_gc["step_s"] + r["predicted_extra_s"]) / r["step_s"], 3)
            if "gc" in ok:
                entry["gc_step"] = round((no_gc["step_s"] + r["gc_predicted_extra_s"]) / ok["gc"]["step_s"], 3)
        entry["first_step_vs_gc_step"] = round(r["first_step_s"] / ok["gc"]["step_s"], 2) if "gc" in ok else None
        predictions[row] = entry
    report.figure(f"{label}: predicted / measured", predictions)
    _targets(report, label, ratios.get("hilore / gc"), predictions.get("hilore"), targets)


def _targets(report: StageReport, label: str, ratio: dict | None, predicted: dict | None, checked: bool) -> None:
    """HiLoRe against GC and against its own predictions: checks on a GPU at real sizes, figures elsewhere."""
    record = report.check if checked else (lambda name, ok, detail: report.figure(name, detail))
    if ratio is None:
        record(f"{label}: hilore and gc both measured", False, "a row did not run")
        return
    peak = ratio.get("reserved_peak", ratio["peak"])
    record(f"{label}: target: hilore's peak at most 1.10x GC's (reserved)", peak <= 1.10,
           f"{peak:.3f}x (allocated {ratio['peak']:.3f}x)")
    record(f"{label}: target: hilore at least 1.10x GC's throughput", ratio["throughput"] >= 1.10,
           f"{ratio['throughput']:.3f}x")
    if predicted is not None and "peak" in predicted:
        record(f"{label}: target: predicted peak within 5% of measured", abs(predicted["peak"] - 1) <= 0.05,
               f"predicted / measured {predicted['peak']:.3f}")
    if predicted is not None and "step" in predicted:
        record(f"{label}: target: predicted step time within 10% of measured", abs(predicted["step"] - 1) <= 0.10,
               f"predicted / measured {predicted['step']:.3f}")


if __name__ == "__main__":
    print(json.dumps(measure(sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]))))
