"""recipes/grpo/gpu_ab_0.5b.sh run with verl stubbed out: the settings each arm gets and the table it writes."""

import os
import shutil
import stat
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

RUN_STUB = """#!/usr/bin/env bash
echo "ARGS $*"
case "$2" in gc) t=2.0; p=0.020 ;; *) t=1.5; p=0.015 ;; esac
for step in 1 2 3; do echo "step:$step - timing_s/update_actor:$t - timing_per_token_ms/update_actor:$p"; done
"""


def _executable(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def test_the_ab_script_runs_both_arms_alike_on_every_gpu_and_never_resumes(tmp_path):
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
    assert "hilore.risk_budget=0" in args["hilore"] and "hilore.measure_baseline=false" in args["hilore"]
    assert "hilore." not in args["gc"]
    table = (root / "docs" / "benchmarks" / "recipe_qwen2.5-0.5b_gpu.md").read_text()
    assert "| gc | 2.00 | 1.000 | 0.0200 | 1.000 |" in table
    assert "| hilore | 1.50 | 0.750 | 0.0150 | 0.750 |" in table
