"""`hilore-verl doctor` tells the truth here: no GPU, the CPU platform, a working FSDP2 engine."""

import io
import shutil
import subprocess
import sys

import hilore_verl.doctor as doctor


def test_doctor_command_on_this_machine():
    exe = shutil.which("hilore-verl") or [sys.executable, "-m", "hilore_verl.cli"]
    cmd = [exe, "doctor"] if isinstance(exe, str) else exe + ["doctor"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "[ok] versions: python" in out and "verl 0.9" in out
    assert "[ok] device: no GPU found; CPU only" in out
    assert "[ok] verl plugin: loaded by `import verl`; registered platform:cpu" in out
    assert "[ok] verl platform: cpu (hilore-verl's CPU platform" in out
    assert "[ok] FSDP2 engine: FSDPQwen2ForCausalLM on cpu: one train step, grad norm" in out
    assert out.rstrip().endswith("verdict: usable here.")


def test_doctor_names_the_fix_for_an_unsupported_verl(monkeypatch):
    real = doctor.installed_version
    monkeypatch.setattr("hilore_verl.versions.installed_version",
                        lambda p: "0.8.0" if p == "verl" else real(p))
    monkeypatch.setattr(doctor, "installed_version", lambda p: "0.8.0" if p == "verl" else real(p))
    out = io.StringIO()
    assert doctor.run(out) == 1
    text = out.getvalue()
    assert "[FAIL] versions:" in text and "verl 0.8.0" in text
    assert "[FAIL] verl plugin: skipped: needs versions" in text
    assert "verdict: NOT usable here. To fix:" in text
    assert "verl: 0.8.0 is installed; hilore-verl supports verl>=0.9.1,<0.10" in text


def test_doctor_reports_plugins_switched_off(monkeypatch):
    monkeypatch.setenv("VERL_USE_EXTERNAL_PLUGINS", "none")
    check = doctor.check_plugin()
    assert not check.ok and "unset VERL_USE_EXTERNAL_PLUGINS" in check.fix
