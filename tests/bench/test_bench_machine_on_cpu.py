"""The bench's reading of the machine's load (bench/machine.py): another process's CPU time is counted as
other, the bench's own (and its finished children's) is not."""

import subprocess
import sys
import time

from hilore_verl.bench.machine import QUIET_SHARE, MachineLoad


def test_a_process_beside_the_run_is_counted_as_other_and_warned_of():
    load = MachineLoad()
    load.start()
    beside = subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 1.5\nwhile time.time() < end: pass"])
    time.sleep(1.6)  # this process idles while the other one spins a core
    out = load.stop()
    beside.wait()
    # one core of `cpus` busy for ~1.5 of ~1.6 s; the spinner is not a finished child when stop() reads
    assert out["other_cpu_share"] > 0.5 / out["cpus"] > QUIET_SHARE, out
    assert not out["quiet"] and "other processes took" in out["warning"]


def test_the_runs_own_work_is_not_other(monkeypatch):
    """The arithmetic on the counters: the system's busy seconds less this process tree's, over wall x cores."""
    from hilore_verl.bench import machine

    clock = iter([100.0, 110.0])  # 10 s of wall time
    busy = iter([1000.0, 1016.0])  # 16 CPU seconds on the machine ...
    own = iter([50.0, 65.0])  # ... 15 of them this process's and its finished children's
    monkeypatch.setattr(machine.time, "monotonic", lambda: next(clock))
    monkeypatch.setattr(machine, "_busy_s", lambda: next(busy))
    monkeypatch.setattr(machine, "_own_s", lambda: next(own))
    load = MachineLoad(cpus=2)
    load.start()
    out = load.stop()
    assert out["own_cpu_share"] == 15 / 20 and out["other_cpu_share"] == 1 / 20 and out["quiet"] is True
    assert out["warning"] is None


def test_a_finished_child_counts_as_the_runs_own():
    """The fresh-process peaks are children the bench waits for: their CPU time is the run's own."""
    load = MachineLoad()
    load.start()
    subprocess.run([sys.executable, "-c", "import time\nend = time.time() + 0.8\nwhile time.time() < end: pass"],
                   check=True)
    out = load.stop()
    assert out["own_cpu_share"] > 0.6 / out["cpus"], out


def test_the_report_says_the_load_and_each_methods_spread():
    from hilore_verl.bench.machine import warning
    from hilore_verl.bench.report import _machine_lines

    load = {"cpus": 2, "other_cpu_share": 0.3, "own_cpu_share": 0.6, "load_avg_1m": [1.0, 2.9], "quiet": False}
    load["warning"] = warning(load)
    rows = {"gc": {"round_cv": 0.02}, "hilore": {"round_cv": 0.05, "round_cv_vs_gc": 0.04, "distinct_plans": 3}, "no_gc": {"status": "failed"}}
    text = "\n".join(_machine_lines({"machine": load}, rows))
    assert "other processes 30.0%" in text and "WARNING: other processes took 30%" in text
    assert "gc 2.0%" in text and "hilore 5.0% (4.0% of its ratio to GC), 3 different plans over its timed steps" in text
    assert "WARNING" not in "\n".join(_machine_lines({"machine": {**load, "quiet": True, "warning": None}}, {}))
    trial = {"hilore": {"round_cv": 0.01, "arm": "baseline", "plan_over_baseline": 1.0104},
             "keep_recompute": {"round_cv": 0.01, "arm": "undecided", "plan_over_baseline": None}}
    text = "\n".join(_machine_lines({}, trial))
    assert "the measured trial's arm: baseline (plans / baseline 1.010)" in text
    assert "the measured trial's arm: undecided" in text and "undecided (" not in text
