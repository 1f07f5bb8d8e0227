"""A CPU platform for verl, which ships only accelerator platforms and otherwise falls back to CUDA.

Registered through verl's `PlatformRegistry` by the plugin. verl's auto-detection picks it only
when every other registered platform says no and nothing else shows an accelerator: torch sees none
and the host has no GPU driver's device nodes (verl's CUDA check answers no on a GPU host without
`nvidia-smi`, so its word alone is not enough). `VERL_PLATFORM=cpu` selects it explicitly. Memory
counters read 0: the CPU has no caching allocator, so peak memory on CPU is measured as process RSS
elsewhere.
"""

from __future__ import annotations

import os
import platform as _host
from contextlib import contextmanager
from typing import Any, Optional

import psutil
import torch
from verl.plugin.platform import PlatformBase, PlatformRegistry

PLATFORM_NAME = "cpu"


def _host_memory() -> tuple[int, int]:
    """(available, total) host memory in bytes."""
    try:
        memory = psutil.virtual_memory()
        return memory.available, memory.total
    except (OSError, psutil.Error):
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page


class CpuStream(torch.cpu.Stream):
    """A CPU "stream" with CUDA's call signatures. CPU work is synchronous, so ordering calls are no-ops."""

    def record_event(self, event: torch.cpu.Event | None = None) -> torch.cpu.Event:
        return event if event is not None else torch.cpu.Event()

    def synchronize(self) -> None:
        pass


_DEFAULT_STREAM = CpuStream()


class CpuDeviceModule:
    """What verl calls on `get_torch_device()`, answered for the CPU. Anything else is an AttributeError."""

    Stream = CpuStream
    Event = torch.cpu.Event
    stream = staticmethod(torch.cpu.stream)
    synchronize = staticmethod(torch.cpu.synchronize)

    @staticmethod
    def current_stream(device: Any = None) -> CpuStream:
        return _DEFAULT_STREAM

    set_device = staticmethod(torch.cpu.set_device)

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def current_device() -> str:
        # verl moves tensors with `.to(get_device_id())`: an int would mean cuda:<n>.
        return "cpu"

    @staticmethod
    def get_device_name(device: Any = None) -> str:
        return _host.processor() or _host.machine() or "cpu"

    # RNG: the CPU generator.
    @staticmethod
    def get_rng_state(device: Any = None) -> torch.Tensor:
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state: torch.Tensor, device: Any = None) -> None:
        torch.set_rng_state(state)

    @staticmethod
    def manual_seed(seed: int) -> None:
        torch.manual_seed(seed)

    manual_seed_all = manual_seed

    # Memory: host figures where they exist; allocator counters are 0 (no caching allocator).
    @staticmethod
    def mem_get_info(device: Any = None) -> tuple[int, int]:
        return _host_memory()

    @staticmethod
    def memory_allocated(device: Any = None) -> int:
        return 0

    memory_reserved = max_memory_allocated = max_memory_reserved = memory_allocated

    @staticmethod
    def empty_cache() -> None:
        pass

    @staticmethod
    def ipc_collect() -> None:
        pass

    @staticmethod
    def reset_peak_memory_stats(device: Any = None) -> None:
        pass

    @staticmethod
    def set_per_process_memory_fraction(fraction: float, device: Any = None) -> None:
        pass

    def __getattr__(self, name: str):
        raise AttributeError(
            f"the CPU platform has no device function {name!r}; "
            "this verl code path needs an accelerator (or a CPU answer added to CpuDeviceModule)"
        )


CPU_DEVICE_MODULE = CpuDeviceModule()


# Device nodes a GPU driver creates on its host, visible even to a process that is shown no device (a
# CPU-only Ray actor, CUDA_VISIBLE_DEVICES=""): NVIDIA, AMD ROCm, Huawei Ascend.
DRIVER_NODES = ("/dev/nvidiactl", "/proc/driver/nvidia/version", "/dev/kfd", "/dev/davinci_manager")


def accelerator_evidence() -> Optional[str]:
    """What shows an accelerator in this process or on this host, or None. verl's own checks are not
    enough: its CUDA platform with `use_smi_check` answers no wherever `nvidia-smi` is missing (a
    container with the GPUs but not the tool), even while torch sees the GPUs."""
    if torch.cuda.is_available():  # also ROCm, whose torch.cuda is HIP
        return f"torch.cuda sees {torch.cuda.device_count()} device(s)"
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if accelerator is not None:
        return f"torch sees a {accelerator.type} accelerator"
    for node in DRIVER_NODES:
        if os.path.exists(node):
            return f"{node} exists (a GPU driver is installed)"
    return None


class PlatformCPU(PlatformBase):
    """verl platform for hosts without an accelerator: device "cpu", collectives over gloo."""

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> CpuDeviceModule:
        return CPU_DEVICE_MODULE

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        """True only when no other registered platform is available and `accelerator_evidence()` finds
        nothing: a fallback, never a rival. `VERL_PLATFORM=cpu` asks for it whatever the host has."""
        if os.environ.get("VERL_PLATFORM", "").strip().lower() == PLATFORM_NAME:
            return True
        if accelerator_evidence() is not None:
            return False
        for name in PlatformRegistry.registered_names():
            cls = PlatformRegistry.get(name)
            if cls is None or issubclass(cls, PlatformCPU):
                continue
            try:
                if cls().is_platform_available(use_smi_check=use_smi_check):
                    return False
            except Exception:  # a broken probe of another platform does not make it present
                continue
        return True

    def current_device(self) -> str:
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index) -> None:
        pass

    def synchronize(self, device_index: Optional[int] = None) -> None:
        pass

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def get_device_capability(self, device_index: int = 0) -> tuple[Optional[int], Optional[int]]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    @contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        pass

    def profiler_stop(self) -> None:
        pass

    def ray_resource_name(self) -> str:
        """What each rank's placement bundle asks Ray for: a CPU, or one `cpu_rank` where the cluster's
        nodes declare that resource (`ray start --resources '{"cpu_rank": N}'`: N ranks per node)."""
        import ray

        if ray.is_initialized() and ray.cluster_resources().get(RANK_RESOURCE, 0) > 0:
            return RANK_RESOURCE
        return "CPU"

    def ray_resource_options(self, num_gpus: float) -> dict[str, Any]:
        return {}  # no accelerator resource to ask Ray for

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None


RANK_RESOURCE = "cpu_rank"


def register_cpu_platform() -> None:
    """Add the CPU platform to verl's registry (idempotent). verl's auto-detection does the rest."""
    if PlatformRegistry.get(PLATFORM_NAME) is not PlatformCPU:
        PlatformRegistry.register(platform=PLATFORM_NAME)(PlatformCPU)


if globals().pop("REGISTER_ON_IMPORT", False):  # this module imported verl first (registration.register_all)
    register_cpu_platform()
