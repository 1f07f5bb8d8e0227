"""`hilore-verl doctor` tells the truth here: no GPU (or the GPUs and their Triton kernels), the
platform, a working FSDP2 engine."""

import io
import shutil
import subprocess
import sys

import torch

import hilore_verl.doctor as doctor

GPU = torch.cuda.is_available()


def test_doctor_command_on_this_machine():
    exe = shutil.which("hilore-verl") or [sys.executable, "-m", "hilore_verl.cli"]
    cmd = [exe, "doctor"] if isinstance(exe, str) else exe + ["doctor"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "[ok] versions: python" in out and "verl 0.9" in out
    assert "[ok] verl plugin: loaded by `import verl`; registered platform:cpu" in out
    if GPU:
        assert f"[ok] device: {torch.cuda.device_count()} CUDA device(s): " in out
        assert "[ok] Triton kernels: quantize / dequantize launched on cuda:" in out
        assert "[ok] verl platform: " in out and "[ok] verl platform: cpu" not in out
        assert "[ok] FSDP2 engine: FSDPQwen2ForCausalLM on cuda: one train step, grad norm" in out
    else:
        assert "[ok] device: no GPU found; CPU only" in out
        assert "[ok] Triton kernels: not applicable: no CUDA device" in out
        assert "[ok] attention: not applicable: no CUDA device" in out
        assert "[ok] verl platform: cpu (hilore-verl's CPU platform" in out
        assert "[ok] FSDP2 engine: FSDPQwen2ForCausalLM on cpu: one train step, grad norm" in out
    assert out.rstrip().endswith("verdict: usable here.")


def test_doctor_names_the_fix_for_an_unsupported_verl(monkeypatch):
    real = doctor.installed_version
    monkeypatch.setattr("hilore_verl.validation.versions.installed_version",
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


def test_doctor_checks_the_triton_kernels_only_where_there_is_a_cuda_device(monkeypatch):
    import torch

    from hilore_verl.kernels import triton_guard

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert doctor.check_triton() == doctor.Check(True, "not applicable: no CUDA device (CPU tensors use the CPU codec)")
    # a CUDA host, simulated: the launch check and the bitwise comparison decide
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(triton_guard, "triton_status", lambda device: (True, ""))
    monkeypatch.setattr(triton_guard, "bitwise_check", lambda device: (True, ""))
    check = doctor.check_triton()
    assert check.ok and check.detail.startswith("quantize / dequantize launched on cuda:0: bit for bit the torch ref")
    monkeypatch.setattr(triton_guard, "bitwise_check", lambda device: (False, "the Triton kernels' codes differ"))
    monkeypatch.setattr(triton_guard, "missing_pieces", lambda: [])
    check = doctor.check_triton()
    assert not check.ok and check.detail.startswith("the Triton kernels' codes differ") and "run tests/" in check.fix
    reason = "Triton cannot launch its kernels on cuda:0 (RuntimeError: no C compiler); missing: a C compiler"
    monkeypatch.setattr(triton_guard, "triton_status", lambda device: (False, reason))
    monkeypatch.setattr(triton_guard, "missing_pieces", lambda: [("a C compiler", "install gcc or clang, or set CC"),
                                                                 ("Python.h", "install python3-dev")])
    check = doctor.check_triton()
    assert not check.ok and check.detail.startswith(reason) and "use the torch reference codec" in check.detail
    assert check.fix == "install gcc or clang, or set CC; install python3-dev"



def test_doctor_checks_the_recipes_attention_on_a_cuda_device(monkeypatch):
    """The recipes' actor attention is verl's default, FlashAttention-2, which verl[vllm] does not bring:
    on a CUDA host without flash-attn doctor fails with the install line and the sdpa override."""
    import torch
    import transformers.utils

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert doctor.check_attention().ok
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(transformers.utils, "is_flash_attn_2_available", lambda: False)
    check = doctor.check_attention()
    assert not check.ok and "flash_attention_2" in check.detail
    assert "pip install flash-attn --no-build-isolation" in check.fix and "attn_implementation=sdpa" in check.fix
    monkeypatch.setattr(transformers.utils, "is_flash_attn_2_available", lambda: True)
    assert doctor.check_attention().ok
