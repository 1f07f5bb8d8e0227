"""The verl plugin: loaded by `import verl` in a fresh process, and what it makes verl do on a CPU host."""

import json

from tests.harness.subprocess import run_python

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
    proc = run_python(code, env=env)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_import_verl_loads_the_plugin_and_selects_the_cpu_platform():
    report = _report()
    assert report == {"loaded": True, "error": None,
                      "registered": ["platform:cpu", "cpu:process-group", "cpu:fsdp-engines",
                                     "cpu:offload-without-pinning", "cpu:ray-resources", "cpu:rollout-hf",
                                     "config:one-line-errors"],
                      "device": "cpu", "platform": "PlatformCPU", "backend": "gloo"}


def test_without_the_plugin_verl_falls_back_to_cuda_here():
    # What the plugin fixes: with plugins off, verl picks "nvidia" on a host with no GPU.
    code = "import verl\nfrom verl.plugin.platform import get_platform\nprint(get_platform().device_name)"
    proc = run_python(code, env={"VERL_USE_EXTERNAL_PLUGINS": "none"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "cuda"


def test_importing_the_integration_before_verl_also_works():
    report = _report("import hilore_verl.integration.engine\n" + REPORT)
    assert report["loaded"] and report["device"] == "cpu"


def test_verl_workers_import_after_verl_sees_the_cpu_device():
    code = "import verl\nfrom verl.utils.device import get_device_name, get_torch_device\n" \
           "import verl.workers.engine_workers\nprint(get_device_name(), get_torch_device().device_count())"
    proc = run_python(code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "cpu 1"


def test_plugin_failure_is_loud_not_silent():
    # An unsupported verl makes the plugin refuse to register; verl would swallow an exception,
    # so the plugin must warn on stderr and record the reason.
    code = ("import hilore_verl.versions as v\n"
            "v.installed_version = lambda p: '0.8.2' if p == 'verl' else v.metadata.version(p)\n" + REPORT)
    proc = run_python(code)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not report["loaded"] and "verl>=0.9.1,<0.10" in report["error"]
    assert "hilore-verl: the verl plugin did not load" in proc.stderr
