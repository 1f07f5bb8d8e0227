"""`hilore-verl gpu-check`: its CPU rehearsal end to end on a machine without verl, Ray, hydra or omegaconf
(as the bare GPU machine it is written for), the report written whatever a stage does, and its refusals."""

import json
import os
import sys
import textwrap

import pytest

from hilore_verl.gpucheck import limits
from hilore_verl.gpucheck import run as gpu_run
from tests.harness import subprocess as harness

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BLOCKED = ("verl", "ray", "hydra", "omegaconf")
CORE = ("hilore_verl", "hilore_verl.runtime", "hilore_verl.kernels", "hilore_verl.kernels.triton_codec",
        "hilore_verl.planner", "hilore_verl.training.session", "hilore_verl.training.config", "hilore_verl.bench",
        "hilore_verl.bench.session_passes", "hilore_verl.gpucheck", "hilore_verl.gpucheck.stages",
        "hilore_verl.gpucheck.model", "hilore_verl.gpucheck.profile_stage", "hilore_verl.cli", "hilore_verl.doctor")


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
    # the wait outlasts every stage's own limit (a slow runner's stage that runs out of time fails on its
    # report's own line, not on this test's clock)
    assert sum(c.tiny_s for c in limits.COSTS.values()) + 60 <= 1320
    proc = harness.run([sys.executable, "-m", "hilore_verl", "gpu-check", "--out", str(out), "--device", "cpu",
                        "--tiny"], env=_env(site), cwd=tmp_path, timeout_s=1320)
    report = json.loads((out / "gpu_check.json").read_text())
    stages = {s["name"]: s for s in report["stages"]}
    assert list(stages) == list(gpu_run.STAGES)
    failed = {n: [c for c in s["checks"] if not c["ok"]] or s["error"] for n, s in stages.items()
              if s["status"] != "passed"}
    assert not failed and proc.returncode == 0, (failed, proc.stdout[-3000:])
    assert all(s["checks"] for s in stages.values())  # every stage checked something
    methods = stages["model"]["figures"]["qwen2-shaped hidden 128: methods"]
    assert list(methods)[:2] == ["gc", "hilore"]  # what the check is for first
    assert {"no_gc", "keep_recompute", "gc+skip", "hilore+skip", "hilore+skip+shared"} <= set(methods)
    assert methods["hilore"]["predicted_peak_bytes"] > 0 and methods["hilore"]["first_step_s"] > 0
    # like for like: the plain rows compute every token, the skip rows leave the same sequences out
    assert methods["hilore"]["workload"] == methods["gc"]["workload"] == "plain"
    assert methods["hilore"]["trained_tokens"] == methods["gc"]["trained_tokens"] == methods["gc"]["tokens"]
    skip = methods["gc+skip"]["trained_tokens"]
    assert skip < methods["gc"]["tokens"]
    assert methods["hilore+skip"]["trained_tokens"] == methods["hilore+skip+shared"]["trained_tokens"] == skip
    assert methods["hilore+skip+shared"]["layer_tokens"] < skip == methods["hilore+skip"]["layer_tokens"]
    ratios = stages["model"]["figures"]["qwen2-shaped hidden 128: ratios"]
    assert {"hilore / gc", "hilore+skip / gc+skip", "hilore+skip+shared / hilore+skip"} <= set(ratios)
    assert stages["model"]["figures"]["qwen2-shaped hidden 128: predicted / measured"]["hilore"]["step"] > 0
    assert stages["profile"]["figures"]["top_by_self_cpu_time"]
    md = (out / "gpu_check.md").read_text()
    assert "| model | 1 | passed |" in md and "Run 1: `hilore-verl gpu-check" in md


def test_a_stage_past_its_limit_is_recorded_and_the_next_one_runs(tmp_path, monkeypatch):
    # the codec stage's process stalls at start-up (a sitecustomize on its path), so it cannot finish in
    # its 6 s however fast the machine; the environment stage runs normally
    site = tmp_path / "stall"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import sys, time\nif 'codecs' in sys.argv: time.sleep(60)\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setitem(limits.COSTS, "codecs", limits.StageCost(30, 0, 40, tiny_s=6))
    report = gpu_run.run_check(str(tmp_path), "cpu", tiny=True, stages=("codecs", "environment"), echo=lambda _: None)
    environment, codecs = report["stages"]  # in the check's order, whatever order they ran in
    assert codecs["status"] == "timeout" and "limit" in codecs["error"]
    assert environment["status"] == "passed"
    assert report["passed"] is False
    saved = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [s["status"] for s in saved["stages"]] == ["passed", "timeout"]
    assert "| codecs | 1 | timeout |" in (tmp_path / "gpu_check.md").read_text()


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


def test_without_cuda_the_check_writes_what_is_missing_and_refuses_unknown_stages(tmp_path, monkeypatch, capsys):
    import torch

    from hilore_verl.cli import main

    assert main(["gpu-check", "--out", str(tmp_path), "--device", "cpu", "--stages", "codecs,nope"]) == 2
    assert main(["gpu-check", "--out", str(tmp_path), "--only", "nope"]) == 2
    monkeypatch.delenv("OUT", raising=False)
    assert main(["gpu-check"]) == 2 and "--out" in capsys.readouterr().err
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    monkeypatch.setenv("OUT", str(tmp_path / "out"))  # the default folder: what comes back from a GPU machine
    assert main(["gpu-check"]) == 1
    report = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    environment, *rest = report["stages"]
    assert environment["name"] == "environment" and environment["status"] == "failed"
    assert environment["figures"]["cuda_available"] is False and environment["figures"]["missing"]
    detail = environment["checks"][0]["detail"]
    assert "CUDA build of torch" in detail or "NVIDIA driver" in detail or "libcuda" in detail, detail
    assert [s["status"] for s in rest] == ["skipped"] * (len(gpu_run.STAGES) - 1)
    assert "no usable CUDA device" in rest[0]["error"]
    assert "| environment | 1 | failed |" in (tmp_path / "out" / "gpu_check.md").read_text()


def test_limits_follow_the_measured_compile_and_leave_the_later_stages_their_time(tmp_path):
    stages = list(gpu_run.STAGES)
    assert limits.compile_figures(str(tmp_path))[2].startswith("defaults")
    first = {s: limits.limit(s, stages[i:], limits.TOTAL_S, str(tmp_path), False) for i, s in enumerate(stages)}
    (tmp_path / "stage_environment.json").write_text(json.dumps(
        {"checks": [], "figures": {"inductor_compile_s": 60.0, "triton_first_launch_s": 1.0}}))
    slow = {s: limits.limit(s, stages[i:], limits.TOTAL_S, str(tmp_path), False) for i, s in enumerate(stages)}
    assert slow["shared_prompt"] > first["shared_prompt"] and slow["codecs"] < first["codecs"]
    # whatever the figures, a stage never takes what the stages after it are estimated to need
    for compile_s in (1.0, 20.0, 200.0):
        estimates = {s: limits.estimate(s, compile_s, 1.0, False) for s in stages}
        left = limits.TOTAL_S
        for i, name in enumerate(stages):
            (tmp_path / "stage_environment.json").write_text(json.dumps(
                {"checks": [], "figures": {"inductor_compile_s": compile_s, "triton_first_launch_s": 1.0}}))
            got = limits.limit(name, stages[i:], left, str(tmp_path), False)
            after = sum(estimates[s] for s in stages[i + 1:])
            assert 0 < got <= left and (got <= left - after + 1e-9 or got <= left * estimates[name] / (after + estimates[name]) + 1e-9)
            left -= got  # every stage runs to its limit: the worst case
        assert left >= -1e-9  # the check as a whole stays within its 7 minutes


def test_a_rerun_of_one_stage_keeps_the_other_stages_rows(tmp_path):
    first = gpu_run.run_check(str(tmp_path), "cpu", tiny=True, stages=("environment",), echo=lambda _: None)
    assert first["runs"][0]["commit"]
    gpu_run.write({**first, "stages": first["stages"] + [{**gpu_run._skipped("codecs", "earlier"), "run": 1}]}, str(tmp_path))
    again = gpu_run.run_check(str(tmp_path), "cpu", tiny=True, stages=("environment",), echo=lambda _: None,
                              keep_others=True)
    assert [s["name"] for s in again["stages"]] == ["environment", "codecs"]
    assert [s["run"] for s in again["stages"]] == [2, 1] and len(again["runs"]) == 2
    md = (tmp_path / "gpu_check.md").read_text()
    assert "Run 1:" in md and "Run 2:" in md


def test_host_synchronisations_are_judged_per_micro_batch_against_the_plain_models():
    from hilore_verl.gpucheck.stages import MICRO_BATCHES, host_sync_verdict

    plain = {"plain model": 3}
    assert host_sync_verdict({**plain, "runtime: keep": 3, "runtime: int8": 3 + MICRO_BATCHES})[0]
    ok, detail = host_sync_verdict({**plain, "runtime: keep": 4, "runtime: int8": 3})
    assert not ok and "runtime: keep" in detail
    assert not host_sync_verdict({**plain, "runtime: int8 + offload": 4 + MICRO_BATCHES})[0]


def test_the_shared_prompt_stage_names_the_kernel_that_served_and_fails_on_a_fallback(tmp_path, monkeypatch):
    """The kernel in the report is the one that ran the measured forward and backward: on the CPU the
    per-segment path (a pass); on a device meant to run FlexAttention whose kernel raised (as when its
    backward fails to compile), a failed check with the reason, while log-probs and gradients still agree."""
    from hilore_verl.gpucheck.context import Context, StageReport
    from hilore_verl.gpucheck.shared import shared_prompt_stage
    from hilore_verl.shared_prompt import attention

    ctx = Context("cpu", True, str(tmp_path))
    report = StageReport(str(tmp_path / "plain.json"))
    shared_prompt_stage(report, ctx)
    assert all(c["ok"] for c in report.data["checks"]), report.data["checks"]
    calls = report.data["figures"]["kernel_calls"]
    assert report.data["figures"]["kernel"] == "sdpa" and calls["sdpa"]["forward"] > 0 and calls["sdpa"]["backward"] > 0

    def broken(*args, **kwargs):
        raise RuntimeError("flex backward failed to compile")

    monkeypatch.setattr(attention, "_FLEX_FAILED", [])
    monkeypatch.setattr(attention, "kernel_on", lambda device: "sdpa" if attention._FLEX_FAILED else "flex")
    monkeypatch.setattr(attention, "flex_shared_attention", broken)
    report = StageReport(str(tmp_path / "fallback.json"))
    shared_prompt_stage(report, ctx)
    checks = {c["name"]: c for c in report.data["checks"]}
    assert not checks["flex served every forward and backward"]["ok"]
    assert "flex backward failed to compile" in checks["flex served every forward and backward"]["detail"]
    assert report.data["figures"]["kernel"] == "sdpa"
    assert "failed to compile" in report.data["figures"]["fallback_reason"]
    assert sum(c["ok"] for c in checks.values()) == 2  # log-probs and gradients: the fallback computes the same


def test_a_process_stopped_at_its_limit_takes_its_children_with_it(tmp_path):
    """A stage's row processes (and Inductor's compile workers) would hold the GPU through the next stage."""
    import subprocess
    import time

    from hilore_verl.gpucheck import process

    pid_file = tmp_path / "child.pid"
    code = (f"import subprocess, sys, time\n"
            f"child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
            f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
            f"time.sleep(60)\n")
    with pytest.raises(subprocess.TimeoutExpired):
        process.run([sys.executable, "-c", code], dict(os.environ), timeout=3)
    child = int(pid_file.read_text())
    time.sleep(0.2)
    with pytest.raises(ProcessLookupError):
        for _ in range(20):  # gone, or a zombie about to be reaped by init
            os.kill(child, 0)
            try:
                status = open(f"/proc/{child}/stat").read().split()[2]
            except FileNotFoundError:
                raise ProcessLookupError from None
            if status == "Z":
                raise ProcessLookupError
            time.sleep(0.1)
