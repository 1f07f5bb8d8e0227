"""The verl plugin: loaded by `import verl` in a fresh process, and what it makes verl do on a CPU host.

Tests of the CPU platform's answers set VERL_PLATFORM=cpu (what a GPU host runs them with too); the
auto-detection test runs only where the host has no accelerator, and a GPU host is simulated."""

import json

import pytest

from tests.harness.subprocess import run_python

CPU = {"VERL_PLATFORM": "cpu"}

# A GPU host whose container lacks nvidia-smi: torch sees a CUDA device, verl's CUDA check says no.
GPU_WITHOUT_SMI = """
import os, shutil, torch
torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: 1
which, isfile = shutil.which, os.path.isfile
shutil.which = lambda cmd, *a, **k: None if "smi" in cmd else which(cmd, *a, **k)
os.path.isfile = lambda p: False if str(p).endswith("-smi") else isfile(p)
import hilore_verl.integration.cpu_host.platform as cpu_platform  # imports verl first: the plugin loads here
cpu_platform.DRIVER_NODES = ()  # torch's answer alone must refuse the CPU platform
"""

REPORT = """
import json, verl
from hilore_verl.plugin import STATUS
from verl.plugin.platform import get_platform
p = get_platform()
print(json.dumps({"loaded": STATUS.loaded, "registered": STATUS.registered, "error": STATUS.error,
                  "device": p.device_name, "platform": type(p).__name__,
                  "backend": p.communication_backend_name()}))
"""


def _report(code=REPORT, env=None):
    proc = run_python(code, env={"VERL_PLATFORM": "", **(env or {})})  # "": verl's auto-detection
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


ON_CPU = {"loaded": True, "error": None,
          "registered": ["platform:cpu", "attention:hilore_packed_sdpa", "cpu:process-group", "cpu:fsdp-engines", "cpu:offload-without-pinning",
                         "cpu:ray-resources", "cpu:rollout-hf", "config:one-line-errors", "trainer:prefix-groups"],
          "device": "cpu", "platform": "PlatformCPU", "backend": "gloo"}


def test_import_verl_loads_the_plugin_and_selects_the_cpu_platform():
    from hilore_verl.integration.cpu_host.platform import accelerator_evidence

    accelerator = accelerator_evidence()
    if accelerator is not None:
        pytest.skip(f"auto-detection picks the accelerator on this host ({accelerator})")
    assert _report() == ON_CPU


def test_verl_platform_cpu_selects_it_on_any_host():
    assert _report(env=CPU) == ON_CPU


def test_a_gpu_host_without_nvidia_smi_stays_on_cuda():
    report = _report(GPU_WITHOUT_SMI + REPORT)
    assert report["loaded"] and (report["platform"], report["device"]) == ("PlatformCUDA", "cuda")
    assert _report(GPU_WITHOUT_SMI + REPORT, env=CPU)["platform"] == "PlatformCPU"  # asked for, it is chosen


def test_importing_the_cpu_platform_before_verl_registers_it():
    # its verl import loads the plugin while the module is half-defined; it registers as its import ends
    report = _report("import hilore_verl.integration.cpu_host.platform\n" + REPORT, env=CPU)
    assert report == ON_CPU


def test_without_the_plugin_verl_falls_back_to_cuda_here():
    # What the plugin fixes: with plugins off, verl picks "nvidia" on a host with no GPU (and on a GPU host).
    code = "import verl\nfrom verl.plugin.platform import get_platform\nprint(get_platform().device_name)"
    proc = run_python(code, env={"VERL_USE_EXTERNAL_PLUGINS": "none", "VERL_PLATFORM": ""})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "cuda"


def test_importing_the_integration_before_verl_also_works():
    report = _report("import hilore_verl.integration.tools.verl_engine\n" + REPORT, env=CPU)
    assert report["loaded"] and report["device"] == "cpu"


def test_verl_workers_import_after_verl_sees_the_cpu_device():
    code = "import verl\nfrom verl.utils.device import get_device_name, get_torch_device\n" \
           "import verl.workers.engine_workers\nprint(get_device_name(), get_torch_device().device_count())"
    proc = run_python(code, env=CPU)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "cpu 1"


def test_plugin_failure_is_loud_not_silent():
    # An unsupported verl makes the plugin refuse to register; verl would swallow an exception,
    # so the plugin must warn on stderr and record the reason.
    code = ("import hilore_verl.validation.versions as v\n"
            "v.installed_version = lambda p: '0.8.2' if p == 'verl' else v.metadata.version(p)\n" + REPORT)
    proc = run_python(code, env={"VERL_PLATFORM": ""})  # no CPU platform registered: verl's own choice
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not report["loaded"] and "verl>=0.9.1,<0.10" in report["error"]
    assert "hilore-verl: the verl plugin did not load" in proc.stderr
