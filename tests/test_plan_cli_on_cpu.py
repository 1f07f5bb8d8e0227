"""`hilore-verl plan`: presets load to the published sizes, the plan fits its budget, bad input is one line."""

import json
import sys
from pathlib import Path

import pytest

from hilore_verl.presets import PRESETS, load_config
from tests.harness import subprocess as harness

CLI = str(Path(sys.executable).with_name("hilore-verl"))

# parameter counts (billions) as published for each preset's model
PUBLISHED_B = {"qwen2.5-0.5b": 0.49, "qwen2.5-1.5b": 1.54, "qwen2.5-3b": 3.09, "qwen2.5-7b": 7.62,
               "qwen2.5-14b": 14.7, "qwen2.5-32b": 32.8, "qwen2.5-72b": 72.7, "llama-3-8b": 8.03,
               "llama-3-70b": 70.6, "llama-3.2-1b": 1.24, "llama-3.2-3b": 3.21, "llama-3.1-8b": 8.03,
               "qwen3-8b": 8.19, "qwen3-30b-a3b": 30.5, "mixtral-8x7b": 46.7, "gpt-oss-20b": 20.9, "olmo-2-7b": 7.30,
               "gemma-3-12b": 12.2 - 0.42}  # Gemma-3-12B: the language model, without its 0.42 B vision encoder
# active parameters (billions) as published for the MoE presets; GPT-OSS counts them without the embedding table
PUBLISHED_ACTIVE_B = {"qwen3-30b-a3b": (3.3, True), "mixtral-8x7b": (12.9, True), "gpt-oss-20b": (3.6, False)}


def test_presets_have_the_published_sizes():
    import torch
    from transformers import AutoModelForCausalLM

    assert sorted(PUBLISHED_B) == PRESETS
    for name, billions in PUBLISHED_B.items():
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(load_config(name))
        assert sum(p.numel() for p in model.parameters()) / 1e9 == pytest.approx(billions, rel=0.02), name


def test_moe_presets_have_the_published_active_sizes():
    import torch
    from transformers import AutoModelForCausalLM

    from hilore_verl.planner.analytic import active_parameters

    for name, (billions, with_embedding) in PUBLISHED_ACTIVE_B.items():
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(load_config(name))
        active = active_parameters(model) - (0 if with_embedding else model.get_input_embeddings().weight.numel())
        assert active / 1e9 == pytest.approx(billions, rel=0.03), name


@pytest.mark.parametrize("preset", ["qwen3-30b-a3b", "gpt-oss-20b", "gemma-3-12b"])
def test_plan_of_other_family_presets(tmp_path, preset):
    out = tmp_path / "plan.json"
    proc = harness.run([CLI, "plan", "--model", preset, "--gpu-mem-gib", "140", "--micro-batch-tokens", "4096",
                        "--json", str(out)], timeout_s=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["peak_gib"] <= result["budget_gib"] and result["gc_peak_gib"] < result["no_gc_peak_gib"]
    if preset != "gemma-3-12b":
        assert any(unit.endswith("mlp.experts") for unit in result["plan"]), result["plan"]


def test_plan_of_a_preset(tmp_path):
    out = tmp_path / "plan.json"
    proc = harness.run([CLI, "plan", "--model", "qwen2.5-0.5b", "--gpu-mem-gib", "40", "--micro-batch-tokens",
                        "4096", "--json", str(out)], timeout_s=600)
    assert proc.returncode == 0, proc.stderr
    assert "predicted actor-update time saved against full GC" in proc.stdout and "layer 23" in proc.stdout
    assert "peaks, lower bounds" in proc.stdout
    result = json.loads(out.read_text())
    assert result["peak_gib"] <= result["budget_gib"] <= 40
    assert result["budget_gib"] == pytest.approx(1.10 * result["gc_peak_gib"])
    assert result["gc_peak_gib"] < result["no_gc_peak_gib"]
    assert len(result["plan"]) == 24 * 6 + 1 and set(result["plan"].values()) <= {"keep", "recompute"}
    assert 0 <= result["saved_vs_gc"] < 0.25


def test_plan_of_a_model_directory(tmp_path):
    load_config("llama-3.2-1b").save_pretrained(tmp_path)
    proc = harness.run([CLI, "plan", "--model", str(tmp_path), "--micro-batch-tokens", "1024", "--budget", "gib:20"],
                       timeout_s=600)
    assert proc.returncode == 0, proc.stderr
    assert "budget 20.00 GiB" in proc.stdout


def test_a_model_the_meta_device_cannot_run_is_refused_in_one_line(tmp_path, capsys, monkeypatch):
    """GraniteMoE's router takes its expert split sizes from tensor values (`.tolist()`), which meta
    tensors lack: it plans through its stand-in, and without one it would be refused in one line."""
    from hilore_verl import cli
    from hilore_verl.planner import analytic
    from hilore_verl.tiny.models import tiny_config

    tiny_config("granitemoe").save_pretrained(tmp_path)
    command = ["plan", "--model", str(tmp_path), "--micro-batch-tokens", "256", "--gpus", "1"]
    assert cli.main(command) == 0 and "unit plan" in capsys.readouterr().out
    monkeypatch.setattr(analytic, "META_ROUTERS", {})
    assert cli.main(command) == 2
    err = capsys.readouterr().err
    assert "GraniteMoeForCausalLM (granitemoe) has no analytic estimate" in err and "hilore.enable=true" in err
    assert len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("args, message", [
    (["--model", "qwen9-1t"], "cannot read a model config from 'qwen9-1t'"),
    (["--model", "qwen2.5-0.5b", "--budget", "percent:3"], "bad --budget 'percent:3'"),
    (["--model", "qwen2.5-0.5b", "--budget", "gib:500"], "more than the 80 GiB of the device"),
    (["--model", "qwen2.5-0.5b", "--budget", "auto"], "bad --budget 'auto': a value is needed (auto: the GiB of headroom"),
    (["--model", "qwen2.5-7b", "--gpus", "1", "--gpu-mem-gib", "24"], "full recompute alone needs"),
])
def test_bad_input_is_one_line(args, message):
    proc = harness.run([CLI, "plan", *args, "--micro-batch-tokens", "1024"], timeout_s=600)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def _no_work(args):
    raise AssertionError("the command started its work")


@pytest.mark.parametrize("args, message", [
    (["plan", "--model", "qwen2.5-0.5b", "--gpu-mem-gib", "nan"],
     "--gpu-mem-gib: expected a finite number > 0, got 'nan'"),
    (["plan", "--model", "qwen2.5-0.5b", "--gpu-mem-gib", "inf"], "--gpu-mem-gib: expected a finite number > 0"),
    (["plan", "--model", "qwen2.5-0.5b", "--gpu-mem-gib", "-1"], "--gpu-mem-gib: expected a finite number > 0"),
    (["plan", "--model", "qwen2.5-0.5b", "--gpu-mem-gib", "0"], "--gpu-mem-gib: expected a finite number > 0"),
    (["plan", "--model", "qwen2.5-0.5b", "--gpu-mem-gib", "lots"], "--gpu-mem-gib: expected a finite number > 0"),
    (["plan", "--model", "qwen2.5-0.5b", "--gpus", "0"], "--gpus: expected an integer >= 1, got '0'"),
    (["plan", "--model", "qwen2.5-0.5b", "--micro-batch-tokens", "1e3"], "--micro-batch-tokens: expected an integer"),
    (["demo", "--steps", "0"], "--steps: expected an integer >= 1"),
    (["demo", "--seed", "-1"], "--seed: expected an integer in [0, 2**63)"),
])
def test_bad_numbers_fail_at_parse_time_in_one_line(args, message, monkeypatch, capsys):
    from hilore_verl import cli

    monkeypatch.setattr(cli, "_plan", _no_work)
    monkeypatch.setattr(cli, "_demo", _no_work)
    with pytest.raises(SystemExit) as exit_:
        cli.main(args)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("command", [["plan", "--model", "qwen2.5-0.5b"], ["demo"]])
def test_json_under_a_file_or_onto_a_folder_fails_at_parse_time(command, tmp_path, monkeypatch, capsys):
    from hilore_verl import cli

    monkeypatch.setattr(cli, "_plan", _no_work)
    monkeypatch.setattr(cli, "_demo", _no_work)
    (tmp_path / "a_file").write_text("")
    cases = ((tmp_path / "a_file" / "out.json", "is not a folder"), (tmp_path, "is a folder"),
             (f"{tmp_path}/missing/", "is a folder"))  # a trailing separator names a folder, even a missing one
    for path, message in cases:
        with pytest.raises(SystemExit) as exit_:
            cli.main([*command, "--json", str(path)])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and "--json: " in err and message in err, err
        assert len(err.strip().splitlines()) == 1, err


def test_json_into_a_missing_folder_creates_it_before_the_work(tmp_path, capsys):
    from hilore_verl import cli

    out = tmp_path / "new" / "deeper" / "plan.json"
    assert cli.main(["plan", "--model", "qwen2.5-0.5b", "--micro-batch-tokens", "1024", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["gpu_mem_gib"] == 80
    missing = tmp_path / "other" / "plan.json"
    assert cli.main(["plan", "--model", "qwen9-1t", "--json", str(missing)]) == 2  # bad model: found after parsing
    assert missing.parent.is_dir() and not missing.exists()


def test_plan_predicts_a_shared_prompt_from_the_group_shape():
    from hilore_verl.planner.whatif import shared_tokens

    assert shared_tokens(5120, 512, 128, 8) == 1536  # one group: 8 x (512 + 128) -> 512 + 8 x 128
    assert shared_tokens(1000, 100, 100, 1) == 1000  # one response per prompt: nothing to share
    argv = [CLI, "plan", "--model", "qwen2.5-0.5b", "--gpu-mem-gib", "80", "--micro-batch-tokens", "10240",
            "--gpus", "1"]
    proc = harness.run(argv + ["--prompt-len", "512", "--response-len", "128", "--group-size", "8"], timeout_s=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    line = next(line for line in out.splitlines() if line.startswith("shared prompt"))
    assert "3072 instead of 10240 tokens per micro-batch (70% fewer)" in line, line
    saved = float(line.split("with full GC")[0].rsplit(":", 1)[1].strip().rstrip("%,").strip("% "))
    assert 50 < saved < 80, line  # fewer tokens, less time: about their share
    bad = harness.run(argv + ["--prompt-len", "512"], timeout_s=300)
    assert bad.returncode == 2 and "go together" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
