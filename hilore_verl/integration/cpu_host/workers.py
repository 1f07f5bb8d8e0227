"""What verl's workers need on a host without an accelerator, applied when verl imports them.

verl 0.9.1 assumes an accelerator in these places that `main_ppo` reaches through Ray:

- the process group: `initialize_global_process_group_ray` joins "cpu:gloo" with
  "<device>:<backend>", which on the CPU platform reads "cpu:gloo,cpu:gloo" and torch refuses it
  ("Duplicate device type cpu"); on the CPU the group is "cpu:gloo" alone;
- the engines: verl registers its FSDP engines for cuda and npu only; they are registered for
  "cpu" too (what `patches/verl-0.9.1-fsdp-engine-cpu-device.patch` does to verl's file, which stays
  optional);
- pinned memory: the FSDP2 engine's CPU offload policy (the ref worker's, forward only) asks for
  pinned host memory, which needs an accelerator; without one it is not pinned;
- resources: the trainer checks that Ray has as many GPUs (or NPUs) as ranks; on the CPU each rank's
  placement bundle is a Ray CPU or a `cpu_rank` (the CPU platform's resource name), so that is what
  is counted;
- generation: verl's rollouts (vLLM, SGLang, TensorRT-LLM) need an accelerator; the `hf` rollout
  (`hf_rollout.py`, Hugging Face generate) is registered in verl's two rollout registries.

Each applies only when verl's device is the CPU (or, for pinning, no accelerator exists): a GPU or
NPU host runs verl's code unchanged. Installed by `registration.register_all`.
"""

from __future__ import annotations

import functools
import os
from datetime import timedelta

import torch

from hilore_verl.integration.cpu_host.after_import import when_imported

FSDP_ENGINES = {"FSDPEngineWithLMHead": "language_model", "FSDPEngineWithValueHead": "value_model"}


def _on_cpu() -> bool:
    from verl.utils.device import get_device_name

    return get_device_name() == "cpu"


def _gloo_on_cpu(module) -> None:
    ray_init = module.initialize_global_process_group_ray

    @functools.wraps(ray_init)
    def initialize_global_process_group_ray(timeout_second=None, backend=None):
        if backend is None and _on_cpu():
            backend = "cpu:gloo"
        return ray_init(timeout_second=timeout_second, backend=backend)

    init = module.initialize_global_process_group

    @functools.wraps(init)
    def initialize_global_process_group(timeout_second=36000):
        if not _on_cpu():
            return init(timeout_second=timeout_second)
        torch.distributed.init_process_group(backend="cpu:gloo", timeout=timedelta(seconds=timeout_second),
                                             init_method=os.environ.get("DIST_INIT_METHOD", None))
        return int(os.environ["LOCAL_RANK"]), int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])

    module.initialize_global_process_group_ray = initialize_global_process_group_ray
    module.initialize_global_process_group = initialize_global_process_group


def _fsdp_on_cpu(module) -> None:
    from verl.workers.engine.base import EngineRegistry

    for name, model_type in FSDP_ENGINES.items():
        for backend in ("fsdp", "fsdp2"):
            try:
                EngineRegistry.register(model_type=model_type, backend=backend, device="cpu")(getattr(module, name))
            except AssertionError:  # registered for "cpu" already (the optional patch does it in verl's file)
                pass
    policy = module.CPUOffloadPolicy

    @functools.wraps(policy, updated=())
    def cpu_offload_policy(*args, pin_memory: bool = True, **kwargs):
        return policy(*args, pin_memory=pin_memory and torch.accelerator.is_available(), **kwargs)

    module.CPUOffloadPolicy = cpu_offload_policy


def _count_cpus(module) -> None:
    manager = module.ResourcePoolManager
    check = manager._check_resource_available

    @functools.wraps(check)
    def _check_resource_available(self):
        if not _on_cpu():
            return check(self)
        import ray

        from verl.utils.device import get_resource_name

        resource = get_resource_name()  # "CPU", or "cpu_rank" where the nodes declare it (cpu_platform.py)
        nodes = ray._private.state.available_resources_per_node().values()
        available = sum(node.get(resource, 0) for node in nodes)
        wanted = sum(n for per_node in self.resource_pool_spec.values() for n in per_node)
        if available < wanted:
            raise ValueError(f"Ray has {available:g} {resource} available, fewer than the {wanted} ranks asked "
                             "for (ray_kwargs.ray_init.num_cpus sets how many CPUs Ray counts on one node)")

    manager._check_resource_available = _check_resource_available


HF_ROLLOUT = "hilore_verl.integration.cpu_host.hf_rollout"
HF_ROLLOUT_NAME = "hf"  # actor_rollout_ref.rollout.name


def _hf_adapter(module) -> None:
    if _on_cpu():
        module._ROLLOUT_REGISTRY.setdefault((HF_ROLLOUT_NAME, "async"), f"{HF_ROLLOUT}.HFGenerateAdapter")


def _hf_replica(module) -> None:
    import importlib

    if _on_cpu():
        replica = lambda: importlib.import_module(HF_ROLLOUT).HFGenerateReplica  # noqa: E731 (imported when used)
        module.RolloutReplicaRegistry.register(HF_ROLLOUT_NAME, replica)


def install() -> list[str]:
    when_imported("verl.utils.distributed", _gloo_on_cpu)
    when_imported("verl.workers.engine.fsdp.transformer_impl", _fsdp_on_cpu)
    when_imported("verl.single_controller.ray.base", _count_cpus)
    when_imported("verl.workers.rollout.base", _hf_adapter)
    when_imported("verl.workers.rollout.replica", _hf_replica)
    return ["cpu:process-group", "cpu:fsdp-engines", "cpu:offload-without-pinning", "cpu:ray-resources",
            "cpu:rollout-hf"]
