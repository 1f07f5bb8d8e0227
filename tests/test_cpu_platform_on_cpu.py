"""The CPU platform: a fallback that never displaces an accelerator platform, and explicit device answers."""

import pytest
import torch

import verl  # noqa: F401  (the plugin registers the platform)
from verl.plugin.platform import PlatformBase, PlatformRegistry

from hilore_verl.integration.cpu_platform import CPU_DEVICE_MODULE, PlatformCPU


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
    return platforms


def test_registered_and_chosen_only_when_nothing_else_is_available(registry):
    assert registry["cpu"] is PlatformCPU
    assert PlatformCPU().is_platform_available(use_smi_check=True)  # this host: no GPU, no NPU


def test_never_chosen_when_an_accelerator_platform_is_present(registry):
    # _AlwaysPresent subclasses PlatformCPU only to borrow its methods; make it look like a rival.
    rival = type("PlatformRival", (PlatformBase,), {
        name: getattr(_AlwaysPresent, name) for name in dir(_AlwaysPresent)
        if not name.startswith("__") and name not in ("device_name", "vendor_name", "device_module")
    } | {"device_name": property(lambda self: "rival"), "vendor_name": property(lambda self: "rival"),
         "device_module": property(lambda self: None)})
    registry["rival"] = rival
    assert not PlatformCPU().is_platform_available(use_smi_check=True)
    registry["rival"] = type("PlatformAbsent", (rival,), {"is_platform_available": _NotPresent.is_platform_available})
    assert PlatformCPU().is_platform_available(use_smi_check=True)


def test_platform_answers():
    p = PlatformCPU()
    assert (p.device_name, p.communication_backend_name(), p.current_device()) == ("cpu", "gloo", "cpu")
    assert p.ray_resource_options(1) == {} and not p.is_ipc_supported()
    assert torch.zeros(1).to(p.current_device()).device.type == "cpu"


def test_device_module_answers_what_verl_calls():
    dm = CPU_DEVICE_MODULE
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
