"""The check's order of work: each stage in a fresh process under its own time limit, the report after each.

A stage process (`python -m hilore_verl.gpucheck.stage NAME ...`) writes DIR/stage_NAME.json as it
goes (`StageReport`), so a stage killed at its limit still leaves what it measured. Here each
stage's outcome is read back: passed (every check ok), failed (a check failed, or the stage raised),
timeout (what it measured is kept), or skipped (no time left, or no CUDA device). Limits follow what
the environment stage measured (limits.py). A run of some stages (`--only`) replaces those stages'
rows in the report already in DIR and keeps the others, each row saying which run it came from.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import time

from hilore_verl.gpucheck import limits, process
from hilore_verl.gpucheck.report import markdown

STAGES = ("environment", "codecs", "runtime", "shared_prompt", "model", "profile")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the clone or site-packages
DEADLINE = "HILORE_VERL_STAGE_DEADLINE"  # epoch seconds by which a stage process should have finished
COMMIT = "HILORE_VERL_COMMIT"  # the commit a copied tree was made from, where it has no .git


def stage_env(device: str) -> dict[str, str]:
    """The stage processes' environment: the project importable from a clone; on the CPU no CUDA and
    Triton's interpreter; on CUDA deterministic cuBLAS (the bitwise checks need it)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH", "")) if p)
    if device == "cpu":
        env.setdefault("OMP_NUM_THREADS", "1")
        env["CUDA_VISIBLE_DEVICES"] = ""
        env["TRITON_INTERPRET"] = "1"
    else:
        env.pop("TRITON_INTERPRET", None)
        env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    return env


def commit() -> str | None:
    """The commit the check runs: $HILORE_VERL_COMMIT, else the clone's HEAD (with '+changes' when dirty)."""
    if os.environ.get(COMMIT):
        return os.environ[COMMIT]
    try:
        head = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


def _tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def _run_stage(name: str, out: str, device: str, tiny: bool, limit: float) -> dict:
    path = os.path.join(out, f"stage_{name}.json")
    if os.path.exists(path):
        os.remove(path)
    cmd = [sys.executable, "-m", "hilore_verl.gpucheck.stage", name, "--device", device, "--out", out,
           *(["--tiny"] if tiny else [])]
    start = time.perf_counter()
    status, error = None, ""
    try:
        env = {**stage_env(device), DEADLINE: str(time.time() + limit - 5)}
        proc = process.run(cmd, env, limit)
        if proc.returncode != 0:
            status, error = "failed", _tail(proc.stderr or proc.stdout)
    except subprocess.TimeoutExpired as err:
        status = "timeout"
        error = f"stopped at its limit of {limit:.0f} s\n" + _tail(err.stderr or "")
    seconds = time.perf_counter() - start
    result = {"checks": [], "figures": {}}
    if os.path.exists(path):
        with open(path) as f:
            result = json.load(f)
    if status is None:
        status = "passed" if all(c["ok"] for c in result["checks"]) else "failed"
    return {"name": name, "status": status, "seconds": round(seconds, 2), "limit_s": round(limit, 1),
            "error": error, **result}


def _skipped(name: str, why: str) -> dict:
    return {"name": name, "status": "skipped", "seconds": 0.0, "limit_s": 0, "checks": [], "figures": {}, "error": why}


def _earlier(out: str, stages: tuple[str, ...]) -> tuple[list[dict], list[dict]]:
    """(runs, stage rows of stages not in `stages`) of the report already in `out`, if any."""
    try:
        with open(os.path.join(out, "gpu_check.json")) as f:
            old = json.load(f)
    except (OSError, ValueError):
        return [], []
    return old.get("runs", []), [s for s in old.get("stages", []) if s["name"] not in stages]


def run_check(out: str, device: str = "cuda", tiny: bool = False, stages: tuple[str, ...] = STAGES,
              total_s: float | None = None, command: str = "", echo=print, keep_others: bool = False) -> dict:
    """Run `stages` in order; returns the report (also written to OUT/gpu_check.json and .md).
    `keep_others`: the other stages' rows of the report already in `out` stay (a rerun of some stages)."""
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        raise ValueError(f"unknown stage {unknown[0]!r}; valid: {', '.join(STAGES)}")
    if total_s is None:  # the CPU rehearsal: the sum of its fixed limits
        total_s = sum(limits.COSTS[s].tiny_s for s in stages) if tiny else limits.TOTAL_S
    os.makedirs(out, exist_ok=True)
    runs, others = _earlier(out, stages) if keep_others else ([], [])
    run = {"run": len(runs) + 1, "command": command, "commit": commit(), "stages": list(stages),
           "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
    report = {"device": device, "tiny": tiny, "total_limit_s": total_s, "runs": [*runs, run], "stages": others}
    start, no_device = time.perf_counter(), None
    for i, name in enumerate(stages):
        left = total_s - (time.perf_counter() - start)
        limit = limits.limit(name, list(stages[i:]), left, out, tiny)
        if no_device is not None:
            result = _skipped(name, no_device)
        elif limit < 5:
            result = _skipped(name, f"no time left of the check's {total_s:.0f} s")
        else:
            echo(f"gpu-check: {name} (limit {limit:.0f} s) ...")
            result = _run_stage(name, out, device, tiny, limit)
        result["run"] = run["run"]
        failed = [c["name"] for c in result["checks"] if not c["ok"]]
        echo(f"gpu-check: {name}: {result['status']} in {result['seconds']:.0f} s"
             + (f"; failed checks: {', '.join(failed)}" if failed else "")
             + (f"\n{result['error']}" if result["error"] and result["status"] != "passed" else ""))
        report["stages"] = [s for s in report["stages"] if s["name"] != name] + [result]
        if name == "environment" and result["figures"].get("cuda_available") is False:
            no_device = "no usable CUDA device (see the environment stage for what is missing)"
        write(report, out)
    report["stages"].sort(key=lambda s: STAGES.index(s["name"]))
    run["seconds"] = round(time.perf_counter() - start, 2)
    report["passed"] = all(s["status"] == "passed" for s in report["stages"])
    write(report, out)
    return report


def write(report: dict, out: str) -> None:
    with open(os.path.join(out, "gpu_check.json"), "w") as f:
        json.dump(report, f, indent=1)
    with open(os.path.join(out, "gpu_check.md"), "w") as f:
        f.write(markdown(report))
