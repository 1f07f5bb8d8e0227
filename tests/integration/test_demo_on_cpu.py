"""`hilore-verl demo` as the README runs it (fewer steps): verl's main_ppo per arm, exits 0, prints the
per-step lines and the side-by-side table, and writes verl's per-step metrics as JSON. Its GC arm is the
flag-off run through verl's trainer (hilore.enable=false: no hilore metric in any step; that the update
is bitwise stock verl's is tests/integration/test_flag_off_on_cpu.py's)."""

import json
import sys
from pathlib import Path

import pytest

from hilore_verl.integration.tools.demo import DemoConfig, arm_command, step_record
from tests.harness import subprocess as harness


@pytest.mark.slow
def test_demo_command(tmp_path):
    out = tmp_path / "demo.json"
    cli = Path(sys.executable).with_name("hilore-verl")
    picture = tmp_path / "demo.png"
    proc = harness.run([str(cli), "demo", "--steps", "2", "--json", str(out), "--plot", str(picture)], timeout_s=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "[hilore] step  2/2" in proc.stdout and "[    gc] step  2/2" in proc.stdout
    assert "HiLoRe / GC actor-update time:" in proc.stdout
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"wrote {picture}" in proc.stdout
    result = json.loads(out.read_text())
    assert result["config"]["recipe"] == "demo_cpu" and set(result["summary"]) == {"hilore", "gc", "hilore_vs_gc"}
    hilore, gc = result["arms"]["hilore"], result["arms"]["gc"]
    assert len(hilore["steps"]) == len(gc["steps"]) == 2
    for step in hilore["steps"] + gc["steps"]:
        assert 0.0 <= step["reward"] <= 1.0 and step["update_s"] > 0
    last = hilore["steps"][-1]  # within its budget, or the budget below what recomputing every unit needs
    assert last["predicted_peak_gib"] <= last["budget_gib"] or "recompute" in last["plan"], last
    assert "keep" in hilore["steps"][-1]["plan"] or "recompute" in hilore["steps"][-1]["plan"]
    # the shared prompt on by default: its self-check passed, each group's prompt computed once
    assert all(s["shared_prompt_on"] == 1.0 and 0 < s["shared_share"] < 1 for s in hilore["steps"]), hilore["steps"]
    assert all(0 < s["response_length"] < 16 for s in hilore["steps"] + gc["steps"])  # EOS, not all at the cap
    for step in gc["steps"]:  # flag off: verl logged no hilore metric at all
        assert step["plan"] == "full recompute (verl GC)"
        assert not [k for k in step if "share" in k or "budget" in k], step
    # the summary is the steps' own figures: the update time from step 2 on, the peaks of the arms' process trees
    ratio = result["summary"]["hilore_vs_gc"]
    assert ratio["update_time"] == pytest.approx(hilore["steps"][1]["update_s"] / gc["steps"][1]["update_s"])
    assert ratio["peak_rss"] == pytest.approx(hilore["peak_rss_gib"] / gc["peak_rss_gib"])
    assert min(hilore["peak_rss_gib"], gc["peak_rss_gib"]) >= 0.2  # a trainer with torch loaded, at least


def test_demo_bad_arm():
    proc = harness.run([str(Path(sys.executable).with_name("hilore-verl")), "demo", "--arms", "hilore,nogc"],
                       timeout_s=300)
    assert proc.returncode != 0 and "unknown demo arm 'nogc'; valid: hilore, gc" in proc.stderr


def test_step_record_reads_verls_metric_names():
    metrics = {"critic/score/mean": 0.25, "timing_s/update_actor": 1.5, "timing_s/step": 4.0,
               "actor/hilore/plan/units_keep": 2.0, "actor/hilore/plan/units_recompute": 11.0,
               "actor/hilore/plan/predicted_peak_gib": 0.5, "actor/hilore/plan/budget_gib": 0.6}
    record = step_record(3, {**metrics, "actor/hilore/shared/token_share": 0.4, "actor/hilore/shared_prompt_on": 1.0,
                             "timing_s/gen": 2.0, "response_length/mean": 9.0})
    assert record == {"step": 3, "reward": 0.25, "update_s": 1.5, "step_s": 4.0, "plan": "keep:2 recompute:11",
                      "predicted_peak_gib": 0.5, "budget_gib": 0.6, "gen_s": 2.0, "response_length": 9.0,
                      "response_clip_ratio": None, "shared_share": 0.4, "shared_prompt_on": 1.0}
    assert step_record(1, {"critic/score/mean": 0.0, "timing_s/update_actor": 1.0,
                           "timing_s/step": 2.0})["plan"] == "full recompute (verl GC)"


def test_both_arms_run_the_same_command_but_the_flag():
    config = DemoConfig(steps=3, seed=5, overrides=("data.train_batch_size=16",))
    hilore, gc = arm_command("hilore", config), arm_command("gc", config)
    differ = [(a, b) for a, b in zip(hilore, gc) if a != b]
    assert differ == [("actor_rollout_ref.actor.hilore.enable=true", "actor_rollout_ref.actor.hilore.enable=false"),
                      ("trainer.experiment_name=demo_hilore", "trainer.experiment_name=demo_gc")]
    assert hilore[1:3] == ["-m", "verl.trainer.main_ppo"] and "data.seed=5" in hilore
    assert hilore[-1] == "data.train_batch_size=16"
