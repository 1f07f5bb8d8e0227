"""`hilore-verl demo` as the README runs it (fewer steps): exits 0, prints the side-by-side table,
both arms train from the same seed (identical first rollouts), HiLoRe reports its plan."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hilore_verl.integration.demo import DIGITS as DEMO_TASK_DIGITS
from hilore_verl.integration.demo import grpo_advantages, make_prompts


def test_demo_command(tmp_path):
    out = tmp_path / "demo.json"
    cli = Path(sys.executable).with_name("hilore-verl")
    proc = subprocess.run([str(cli), "demo", "--steps", "2", "--json", str(out)], capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "[hilore] step  2/2" in proc.stdout and "[    gc] step  2/2" in proc.stdout
    assert "HiLoRe / GC actor-update time:" in proc.stdout
    result = json.loads(out.read_text())
    hilore, gc = result["arms"]["hilore"], result["arms"]["gc"]
    assert len(hilore["steps"]) == len(gc["steps"]) == 2
    assert hilore["steps"][0]["reward"] == gc["steps"][0]["reward"]  # same seed, same initial policy
    for step in hilore["steps"] + gc["steps"]:
        assert 0.0 <= step["reward"] <= 1.0 and step["update_s"] > 0
    assert hilore["steps"][-1]["predicted_peak_gib"] <= hilore["steps"][-1]["budget_gib"]
    assert hilore["peak_rss_gib"] > 0 and gc["peak_rss_gib"] > 0


def test_demo_bad_arm():
    proc = subprocess.run([str(Path(sys.executable).with_name("hilore-verl")), "demo", "--arms", "hilore,nogc"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "unknown demo arm 'nogc'; valid: hilore, gc" in proc.stderr


def test_task_and_advantages():
    import torch

    prompts, answers = make_prompts(64, torch.Generator().manual_seed(0))
    assert prompts.shape == (64, 6) and torch.equal(answers, prompts[:, 1])
    assert set(prompts[:, 1:5].flatten().tolist()) <= set(DEMO_TASK_DIGITS.tolist())
    # verl's GRPO estimator: per group, (r - mean) / (std + eps) on every response token
    reward = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    mask = torch.ones(8, 3, dtype=torch.long)
    adv = grpo_advantages(reward, mask, group_size=4, offset=0)
    assert torch.allclose(adv[:4, 0], (reward[:4] - 0.25) / (reward[:4].std() + 1e-6), atol=1e-5)
    assert torch.all(adv[4:] == 0)  # a group with one reward for every response has no advantage
