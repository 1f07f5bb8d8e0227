"""The scripts under benchmarks/ run on the product's current API and print what their docstrings say.

Each runs once at its smallest size in a child process (the documented command with small arguments);
a script that fell behind a rename fails here instead of at a reader's first try.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from pathlib import Path

import pytest

from tests.harness.subprocess import run

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
TINY = ["--hidden", "128", "--layers", "2"]


def _script(name: str, *args: str, timeout: int = 300) -> str:
    result = run([sys.executable, str(BENCHMARKS / name), *args], cwd=ROOT, timeout_s=timeout,
                 env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_every_benchmark_script_is_tested_here():
    tested = {"peak_model.py", "solver_time.py", "codec_bandwidth.py", "gc_overhead_malloc.py", "plan_peak.py",
              "hook_floor.py"}
    assert {p.name for p in BENCHMARKS.glob("*.py")} == tested


def test_peak_model_prints_the_predicted_and_measured_peak_of_each_budget():
    # the zero-exposure skip leaves this toy step one sequence of 71 tokens within the probe's bound, and
    # its head 8 rows of the probe's 136 tokens against 72 of the step's 584: the profile probes two
    # sequences (a half probe), and lm_head's logits grow with the tokens, the log-prob code's with the
    # rows (1.25-1.36 when either was missing)
    out = _script("peak_model.py", "--budgets", "1.0,1.5", *TINY, "--groups", "2", "--response-len", "32",
                  "--zero-advantage-share", "0.5")
    ratios = [float(r) for r in re.findall(r"predicted / measured ([0-9.]+)", out)]
    assert len(ratios) == 2, out
    assert all(0.95 < r < 1.08 for r in ratios), out  # the model's bound at the bench's sizes is 5%


def test_solver_time_prints_a_time_per_solve_for_each_risk_budget():
    out = _script("solver_time.py", "--units", "12", "--repeats", "2")
    times = [float(t) for t in re.findall(r"median +([0-9.]+) ms", out)]
    assert len(times) == 3 and all(math.isfinite(t) and t > 0 for t in times), out


def test_codec_bandwidth_on_the_cpu_reports_every_case(tmp_path):
    report = tmp_path / "codec.md"
    _script("codec_bandwidth.py", "--device", "cpu", "--threads", "1", "--repeats", "1", "--out", str(report))
    text = report.read_text()
    assert "copy" in text and "int8" in text, text


def test_gc_overhead_malloc_prints_both_allocator_settings():
    out = _script("gc_overhead_malloc.py", *TINY, "--vocab", "500", "--response-len", "16")
    overheads = re.findall(r"(default|caching) malloc +GC overhead +(-?[0-9.]+)%", out)
    assert [label for label, _ in overheads] == ["default", "caching"], out


def test_plan_peak_reads_a_bench_report_and_prints_a_peak(tmp_path):
    report = ROOT / "docs" / "benchmarks" / "data" / "bench_cpu_full_1624019.json"
    assert json.loads(report.read_text())["methods"]["hilore"]["status"] == "ok"
    out = _script("plan_peak.py", "--report", str(report), "--variant", "recomputed")
    assert re.search(r"[0-9.]+ MiB", out), out


def test_hook_floor_prints_both_rows_against_no_gc():
    out = _script("hook_floor.py", "--rounds", "2", *TINY, "--response-len", "16")
    ratios = re.findall(r"(bare_hooks|runtime_keep) +([0-9.]+)x \[([0-9.]+), ([0-9.]+)\]", out)
    assert [name for name, *_ in ratios] == ["bare_hooks", "runtime_keep"], out
    assert all(0.3 < float(mean) < 3 for _, mean, _, _ in ratios), out


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))

