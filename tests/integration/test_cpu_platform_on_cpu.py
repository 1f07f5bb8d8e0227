"""The CPU platform: a fallback that never displaces an accelerator platform, and explicit device answers.

Host-independent: detection is tested against stand-in platforms and a simulated accelerator (or
none), so the same assertions hold on a CPU host and on a GPU host."""

import os
import shutil

import pytest
import torch

import verl  # noqa: F401  (the plugin registers the platform)
from verl.plugin.platform import PlatformBase, PlatformRegistry
from verl.plugin.platform.platform_cuda import PlatformCUDA
from verl.plugin.platform.platform_manager import _detect_platform_name

import hilore_verl.integration.cpu_host.platform as cpu_platform
from hilore_verl.integration.cpu_host.platform import CPU_DEVICE_MODULE, PlatformCPU


class _AlwaysPresent(PlatformCPU):
    """Stands in for an accelerator platform that detects its hardware (subclasses PlatformBase's interface)."""

    def is_platform_available(self, use_smi_check=False):
        return True


class _NotPresent(_AlwaysPresent):
    def is_platform_available(self, use_smi_check=False):
        return False


@pytest.fixture
def registry(monkeypatch):
    platforms = dict(PlatformRegistry._platforms)
    monkeypatch.setattr(PlatformRegistry, "_platforms", platforms)
    monkeypatch.delenv("VERL_PLATFORM", raising=False)
    return platforms


@pytest.fixture
def cpu_host(registry, monkeypatch):
    """A host without an accelerator, on any host: verl's platforms say no, nothing shows a device."""
    for name in registry:
        if name != "cpu":
            registry[name] = type(f"Absent_{name}", (_NotPresent,), {})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)
    monkeypatch.setattr(cpu_platform, "DRIVER_NODES", ())
    return registry


@pytest.fixture
def gpu_host_without_smi(registry, monkeypatch):
    """torch sees a CUDA device, but `nvidia-smi` is nowhere (a container with the GPU and not the tool);
    the driver's device nodes are hidden too, so torch's answer alone must refuse the CPU platform."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    which, isfile = shutil.which, os.path.isfile
    monkeypatch.setattr(shutil, "which", lambda cmd, *a, **k: None if "smi" in cmd else which(cmd, *a, **k))
    monkeypatch.setattr(os.path, "isfile", lambda p: False if str(p).endswith("-smi") else isfile(p))
    monkeypatch.setattr(cpu_platform, "DRIVER_NODES", ())
    return registry


def test_registered_and_chosen_only_when_nothing_else_is_available(cpu_host):
    assert cpu_host["cpu"] is PlatformCPU
    assert PlatformCPU().is_platform_available(use_smi_check=True)
    assert _detect_platform_name() == "cpu"


@pytest.mark.skipif(cpu_platform.accelerator_evidence() is not None,
                    reason="this host has an accelerator: the CPU platform is rightly not chosen here")
def test_chosen_on_this_cpu_host(registry):
    assert PlatformCPU().is_platform_available(use_smi_check=True)


def test_never_chosen_when_an_accelerator_platform_is_present(cpu_host):
    # _AlwaysPresent subclasses PlatformCPU only to borrow its methods; make it look like a rival.
    rival = type("PlatformRival", (PlatformBase,), {
        name: getattr(_AlwaysPresent, name) for name in dir(_AlwaysPresent)
        if not name.startswith("__") and name not in ("device_name", "vendor_name", "device_module")
    } | {"device_name": property(lambda self: "rival"), "vendor_name": property(lambda self: "rival"),
         "device_module": property(lambda self: None)})
    cpu_host["rival"] = rival
    assert not PlatformCPU().is_platform_available(use_smi_check=True)
    cpu_host["rival"] = type("PlatformAbsent", (rival,), {"is_platform_available": _NotPresent.is_platform_available})
    assert PlatformCPU().is_platform_available(use_smi_check=True)


def test_a_gpu_host_without_nvidia_smi_resolves_to_cuda_not_cpu(gpu_host_without_smi):
    assert not PlatformCUDA().is_platform_available(use_smi_check=True)  # verl's check: no nvidia-smi, no GPU
    assert cpu_platform.accelerator_evidence() == "torch.cuda sees 1 device(s)"
    assert not PlatformCPU().is_platform_available(use_smi_check=True)
    assert _detect_platform_name() == "nvidia"  # verl's fallback, what it picks without the plugin


def test_verl_platform_cpu_forces_it_on_a_gpu_host(gpu_host_without_smi, monkeypatch):
    monkeypatch.setenv("VERL_PLATFORM", "cpu")
    assert PlatformCPU().is_platform_available(use_smi_check=True)
    assert _detect_platform_name() == "cpu"


def test_other_evidence_of_an_accelerator_refuses_it(cpu_host, monkeypatch, tmp_path):
    monkeypatch.setattr(cpu_platform, "DRIVER_NODES", (str(tmp_path / "nvidiactl"),))
    assert cpu_platform.accelerator_evidence() is None and PlatformCPU().is_platform_available()
    (tmp_path / "nvidiactl").touch()  # a CPU-only Ray actor on a GPU host: no device shown, the driver is there
    assert cpu_platform.accelerator_evidence() == f"{tmp_path / 'nvidiactl'} exists (a GPU driver is installed)"
    assert not PlatformCPU().is_platform_available()
    (tmp_path / "nvidiactl").unlink()
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: torch.device("xpu"))
    assert cpu_platform.accelerator_evidence() == "torch sees a xpu accelerator"
    assert not PlatformCPU().is_platform_available()


def test_platform_answers():
    p = PlatformCPU()
    assert (p.device_name, p.communication_backend_name(), p.current_device()) == ("cpu", "gloo", "cpu")
    assert p.ray_resource_options(1) == {} and not p.is_ipc_supported()
    assert torch.zeros(1).to(p.current_device()).device.type == "cpu"


def test_device_module_answers_what_verl_calls():
    dm = CPU_DEVICE_MODULE  # the CPU platform's own answers, whatever devices the host has
    available, total = dm.mem_get_info()
    assert 0 < available <= total
    assert dm.memory_allocated() == dm.max_memory_allocated() == dm.memory_reserved() == 0
    assert dm.device_count() == 1 and dm.is_available() and dm.current_device() == "cpu"
    dm.empty_cache(), dm.synchronize(), dm.ipc_collect(), dm.reset_peak_memory_stats()
    state = dm.get_rng_state()
    a = torch.rand(3)
    dm.set_rng_state(state)
    assert torch.equal(a, torch.rand(3))
    side = dm.Stream()  # the stream calls verl's activation offload and fused kernels make
    with dm.stream(side):
        side.wait_stream(dm.current_stream())
    event = dm.Event()
    dm.current_stream().record_event(event)
    dm.current_stream().wait_event(event)
    event.synchronize()


def test_device_module_refuses_unknown_calls_clearly():
    with pytest.raises(AttributeError, match="CPU platform has no device function 'get_allocator_backend'"):
        CPU_DEVICE_MODULE.get_allocator_backend()
