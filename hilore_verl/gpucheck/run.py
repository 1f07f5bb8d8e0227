"""The check's order of work: each stage in a fresh process under its own time limit, the report after each.

A stage process (`python -m hilore_verl.gpucheck.stage NAME ...`) writes DIR/stage_NAME.json as it
goes (`StageReport`), so a stage killed at its limit still leaves what it measured. Here each
stage's outcome is read back: passed (every check ok), failed (a check failed, or the stage raised),
timeout, or skipped (no time left).
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import time

from hilore_verl.gpucheck.report import markdown

# stage -> (time limit in seconds on a GPU, with --device cpu --tiny)
STAGES = {"environment": (30, 120), "codecs": (90, 180), "runtime": (60, 180), "shared_prompt": (45, 120),
          "model": (210, 420), "profile": (45, 120)}
TOTAL_S = 480  # the whole check on a GPU: 8 minutes
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the clone or site-packages


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


def _tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


DEADLINE = "HILORE_VERL_STAGE_DEADLINE"  # epoch seconds by which a stage process should have finished


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
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=limit)
        if proc.returncode != 0:
            status, error = "failed", _tail(proc.stderr or proc.stdout)
    except subprocess.TimeoutExpired as err:
        status = "timeout"
        error = f"stopped at its limit of {limit:.0f} s\n" + _tail((err.stderr or b"").decode(errors="replace")
                                                                 if isinstance(err.stderr, bytes) else err.stderr or "")
    seconds = time.perf_counter() - start
    result = {"checks": [], "figures": {}}
    if os.path.exists(path):
        with open(path) as f:
            result = json.load(f)
    if status is None:
        status = "passed" if all(c["ok"] for c in result["checks"]) else "failed"
    return {"name": name, "status": status, "seconds": round(seconds, 2), "limit_s": limit, "error": error,
            **result}


def run_check(out: str, device: str = "cuda", tiny: bool = False, stages: tuple[str, ...] = tuple(STAGES),
              total_s: float = TOTAL_S, command: str = "", echo=print) -> dict:
    """Run `stages` in order; returns the report (also written to OUT/gpu_check.json and .md)."""
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        raise ValueError(f"unknown stage {unknown[0]!r}; valid: {', '.join(STAGES)}")
    os.makedirs(out, exist_ok=True)
    report = {"command": command, "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "device": device, "tiny": tiny, "total_limit_s": total_s, "stages": []}
    start = time.perf_counter()
    for name in stages:
        left = total_s - (time.perf_counter() - start)
        limit = min(STAGES[name][1 if tiny else 0], left)
        if limit < 5:
            result = {"name": name, "status": "skipped", "seconds": 0.0, "limit_s": 0, "checks": [], "figures": {},
                      "error": f"no time left of the check's {total_s:.0f} s"}
        else:
            echo(f"gpu-check: {name} (limit {limit:.0f} s) ...")
            result = _run_stage(name, out, device, tiny, limit)
        failed = [c["name"] for c in result["checks"] if not c["ok"]]
        echo(f"gpu-check: {name}: {result['status']} in {result['seconds']:.0f} s"
             + (f"; failed checks: {', '.join(failed)}" if failed else "")
             + (f"\n{result['error']}" if result["error"] and result["status"] != "passed" else ""))
        report["stages"].append(result)
        write(report, out)
    report["seconds"] = round(time.perf_counter() - start, 2)
    report["passed"] = all(s["status"] == "passed" for s in report["stages"])
    write(report, out)
    return report


def write(report: dict, out: str) -> None:
    with open(os.path.join(out, "gpu_check.json"), "w") as f:
        json.dump(report, f, indent=1)
    with open(os.path.join(out, "gpu_check.md"), "w") as f:
        f.write(markdown(report))
