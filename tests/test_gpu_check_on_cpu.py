"""`hilore-verl gpu-check`: its CPU rehearsal end to end on a machine without verl, Ray, hydra or omegaconf
(as the bare GPU machine it is written for), the report written whatever a stage does, and its refusals."""

import json
import os
import sys
import textwrap

import pytest

from hilore_verl.gpucheck import run as gpu_run
from tests.harness import subprocess as harness

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BLOCKED = ("verl", "ray", "hydra", "omegaconf")
CORE = ("hilore_verl", "hilore_verl.runtime", "hilore_verl.kernels", "hilore_verl.kernels.triton_codec",
        "hilore_verl.planner", "hilore_verl.session", "hilore_verl.config", "hilore_verl.bench",
        "hilore_verl.bench.session_passes", "hilore_verl.gpucheck", "hilore_verl.gpucheck.stages",
        "hilore_verl.gpucheck.model", "hilore_verl.gpucheck.profiling", "hilore_verl.cli", "hilore_verl.doctor")


def _blocking_site(tmp_path) -> str:
    """A sitecustomize that makes `import verl` (and Ray, hydra, omegaconf) fail in every process started
    with it on PYTHONPATH, as on a machine where they are not installed."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(textwrap.dedent(f"""
        import importlib.abc, sys
        BLOCKED = {BLOCKED!r}
        class _Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in BLOCKED:
                    raise ImportError(f"{{name}} is not installed here (blocked)")
                return None
        sys.meta_path.insert(0, _Block())
    """))
    return str(site)


def _env(site: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([site, ROOT])
    return env


def test_the_core_imports_without_verl_ray_hydra_or_omegaconf(tmp_path):
    site = _blocking_site(tmp_path)
    code = "import importlib\n" + "".join(f"importlib.import_module({m!r})\n" for m in CORE) + textwrap.dedent("""
        try:
            import verl
        except ImportError:
            print("blocked")
    """)
    proc = harness.run([sys.executable, "-c", code], env=_env(site), cwd=tmp_path, timeout_s=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "blocked"  # the blocker works, so the imports above really ran without verl


@pytest.mark.slow
def test_the_cpu_rehearsal_runs_every_stage_without_verl(tmp_path):
    site, out = _blocking_site(tmp_path), tmp_path / "check"
    proc = harness.run([sys.executable, "-m", "hilore_verl", "gpu-check", "--out", str(out), "--device", "cpu",
                        "--tiny"], env=_env(site), cwd=tmp_path, timeout_s=900)
    report = json.loads((out / "gpu_check.json").read_text())
    stages = {s["name"]: s for s in report["stages"]}
    assert list(stages) == list(gpu_run.STAGES)
    failed = {n: [c for c in s["checks"] if not c["ok"]] or s["error"] for n, s in stages.items()
              if s["status"] != "passed"}
    assert not failed and proc.returncode == 0, (failed, proc.stdout[-3000:])
    assert all(s["checks"] for s in stages.values())  # every stage checked something
    methods = stages["model"]["figures"]["qwen2-shaped hidden 128: methods"]
    assert {"no_gc", "gc", "hilore", "keep_recompute"} <= set(methods)
    assert methods["hilore"]["predicted_peak_bytes"] > 0 and methods["hilore"]["first_step_s"] > 0
    assert stages["profile"]["figures"]["top_by_self_cpu_time"]
    md = (out / "gpu_check.md").read_text()
    assert "| model | passed |" in md and "Command: `hilore-verl gpu-check" in md


def test_a_stage_past_its_limit_is_recorded_and_the_next_one_runs(tmp_path, monkeypatch):
    # the codec stage's process stalls at start-up (a sitecustomize on its path), so it cannot finish in
    # its 6 s however fast the machine; the environment stage runs normally
    site = tmp_path / "stall"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import sys, time\nif 'codecs' in sys.argv: time.sleep(60)\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setitem(gpu_run.STAGES, "codecs", (6, 6))
    report = gpu_run.run_check(str(tmp_path), "cpu", tiny=True, stages=("codecs", "environment"), echo=lambda _: None)
    codecs, environment = report["stages"]
    assert codecs["status"] == "timeout" and "limit" in codecs["error"]
    assert environment["status"] == "passed"
    assert report["passed"] is False
    saved = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [s["status"] for s in saved["stages"]] == ["timeout", "passed"]
    assert "| codecs | timeout |" in (tmp_path / "gpu_check.md").read_text()


def test_a_stage_without_time_or_that_raises_is_recorded(tmp_path, monkeypatch):
    report = gpu_run.run_check(str(tmp_path), "cpu", tiny=True, stages=("environment",), total_s=2,
                               echo=lambda _: None)  # 2 s in all: below a stage's minimum, so it is skipped
    assert report["stages"][0]["status"] == "skipped"
    assert (tmp_path / "gpu_check.md").exists()
    from hilore_verl.gpucheck import stage

    monkeypatch.setattr(stage, "_stages", lambda: {"environment": lambda r, c: 1 / 0})
    assert stage.main(["environment", "--device", "cpu", "--out", str(tmp_path)]) == 1
    saved = json.loads((tmp_path / "stage_environment.json").read_text())
    assert saved["checks"] == [{"name": "stage ran to the end", "ok": False, "detail": "ZeroDivisionError: division by zero"}]


def test_gpu_check_refuses_cuda_without_a_gpu_and_unknown_stages(tmp_path):
    import torch

    from hilore_verl.cli import main

    if not torch.cuda.is_available():
        assert main(["gpu-check", "--out", str(tmp_path)]) == 2
    assert main(["gpu-check", "--out", str(tmp_path), "--device", "cpu", "--stages", "codecs,nope"]) == 2
