"""recipes/grpo/gpu_ab_0.5b.sh run with verl stubbed out: the settings each arm gets and the table it writes."""

import os
import shutil
import stat
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

RUN_STUB = """#!/usr/bin/env bash
echo "ARGS $* PEAK_SWITCH=${HILORE_VERL_PEAK_PER_MINI_BATCH:-unset}"
case "$2" in gc) t=2.0; p=0.020; m=10.0 ;; *) t=1.5; p=0.015; m=10.5 ;; esac
for step in 1 2 3; do
  echo "step:$step - timing_s/update_actor:$t - timing_per_token_ms/update_actor:$p - perf/max_memory_allocated_gb:$m"
done
"""


def _executable(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def test_the_ab_script_runs_both_arms_alike_on_every_gpu_and_never_resumes(tmp_path):
    """Every GPU of the node, HiLoRe exact with no fallback to GC's plan, each arm its own experiment
    name and never resumed, peaks per mini-batch in both arms; the table from verl's metrics."""
    root = tmp_path / "repo"
    shutil.copytree(ROOT / "recipes", root / "recipes")
    (root / "docs" / "benchmarks").mkdir(parents=True)
    _executable(root / "recipes" / "grpo" / "run.sh", RUN_STUB)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _executable(bin_dir / "nvidia-smi", "#!/usr/bin/env bash\nprintf 'NVIDIA H100\\nNVIDIA H100\\n'\n")
    home = tmp_path / "home"
    (home / "data" / "gsm8k").mkdir(parents=True)
    (home / "data" / "gsm8k" / "train.parquet").write_text("")
    env = {**os.environ, "HOME": str(home), "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    proc = subprocess.run(["bash", str(root / "recipes" / "grpo" / "gpu_ab_0.5b.sh"), "3"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    args = {m: (root / "runs" / "ab_0.5b" / f"{m}.log").read_text().splitlines()[0] for m in ("gc", "hilore")}
    for method, line in args.items():
        assert f"qwen2.5-0.5b_gsm8k {method} " in line
        assert "trainer.n_gpus_per_node=2" in line  # every GPU of the node by default
        assert f"trainer.experiment_name=ab_0.5b_{method}" in line and "trainer.resume_mode=disable" in line
        assert line.endswith("PEAK_SWITCH=1")  # both arms' peaks per mini-batch (ab_peak.py)
    assert "hilore.risk_budget=0" in args["hilore"] and "hilore.measure_baseline=false" in args["hilore"]
    assert "hilore." not in args["gc"]
    table = (root / "docs" / "benchmarks" / "recipe_qwen2.5-0.5b_gpu.md").read_text()
    assert "| gc | 2.00 | 1.000 | 0.0200 | 1.000 | 10.00 | 1.000 |" in table
    assert "| hilore | 1.50 | 0.750 | 0.0150 | 0.750 | 10.50 | 1.050 |" in table


def test_verl_engine_resets_the_peak_per_mini_batch_only_when_asked(monkeypatch):
    """The A/B's environment switch: verl's own train_batch resets the device's peak counter as it starts,
    as HiLoRe's engine does; without it verl's engine is untouched."""
    import verl.utils.device
    import verl.workers.engine.base as base

    from hilore_verl.integration.tools import ab_peak

    monkeypatch.delenv(ab_peak.ENV, raising=False)
    assert ab_peak.install() == [] and not getattr(base.BaseEngine.train_batch, "resets_peak", False)
    calls = []

    class Device:
        @staticmethod
        def reset_peak_memory_stats():
            calls.append("reset")

    class Engine:
        def train_batch(self, data, loss_function):
            calls.append(("train", data, loss_function))
            return "metrics"

    monkeypatch.setattr(verl.utils.device, "get_torch_device", lambda: Device)
    module = type("Module", (), {"BaseEngine": Engine})
    ab_peak._wrap(module)
    ab_peak._wrap(module)  # once only
    assert Engine().train_batch("batch", "loss") == "metrics"
    assert calls == ["reset", ("train", "batch", "loss")]
    waited = []
    monkeypatch.setattr(ab_peak, "when_imported", lambda name, fn: waited.append((name, fn)))
    monkeypatch.setenv(ab_peak.ENV, "1")
    assert ab_peak.install() == ["engine:peak-per-mini-batch"] and waited == [(ab_peak.ENGINE_MODULE, ab_peak._wrap)]
