"""`hilore-verl plan`: presets load to the published sizes, the plan fits its budget, bad input is one line."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hilore_verl.presets import PRESETS, load_config

CLI = str(Path(sys.executable).with_name("hilore-verl"))

# parameter counts (billions) as published for each preset's model
PUBLISHED_B = {"qwen2.5-0.5b": 0.49, "qwen2.5-1.5b": 1.54, "qwen2.5-3b": 3.09, "qwen2.5-7b": 7.62,
               "qwen2.5-14b": 14.7, "qwen2.5-32b": 32.8, "qwen2.5-72b": 72.7, "llama-3-8b": 8.03,
               "llama-3-70b": 70.6, "llama-3.2-1b": 1.24, "llama-3.2-3b": 3.21}


def test_presets_have_the_published_sizes():
    import torch
    from transformers import AutoModelForCausalLM

    assert sorted(PUBLISHED_B) == PRESETS
    for name, billions in PUBLISHED_B.items():
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(load_config(name))
        assert sum(p.numel() for p in model.parameters()) / 1e9 == pytest.approx(billions, rel=0.02), name


def test_plan_of_a_preset(tmp_path):
    out = tmp_path / "plan.json"
    proc = subprocess.run([CLI, "plan", "--model", "qwen2.5-0.5b", "--gpu-mem-gib", "40", "--micro-batch-tokens",
                           "4096", "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "predicted actor-update time saved against full GC" in proc.stdout and "layer 23" in proc.stdout
    result = json.loads(out.read_text())
    assert result["peak_gib"] <= result["budget_gib"] <= 40
    assert result["budget_gib"] == pytest.approx(1.10 * result["gc_peak_gib"])
    assert result["gc_peak_gib"] < result["no_gc_peak_gib"]
    assert len(result["plan"]) == 24 * 6 + 1 and set(result["plan"].values()) <= {"keep", "recompute"}
    assert 0 <= result["saved_vs_gc"] < 0.25


def test_plan_of_a_model_directory(tmp_path):
    load_config("llama-3.2-1b").save_pretrained(tmp_path)
    proc = subprocess.run([CLI, "plan", "--model", str(tmp_path), "--micro-batch-tokens", "1024", "--budget", "gib:20"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "budget 20.00 GiB" in proc.stdout


@pytest.mark.parametrize("args, message", [
    (["--model", "qwen9-1t"], "cannot read a model config from 'qwen9-1t'"),
    (["--model", "qwen2.5-0.5b", "--budget", "percent:3"], "bad --budget 'percent:3'"),
    (["--model", "qwen2.5-0.5b", "--budget", "gib:500"], "more than the 80 GiB of the device"),
    (["--model", "qwen2.5-7b", "--gpus", "1", "--gpu-mem-gib", "24"], "full recompute alone needs"),
])
def test_bad_input_is_one_line(args, message):
    proc = subprocess.run([CLI, "plan", *args, "--micro-batch-tokens", "1024"], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
