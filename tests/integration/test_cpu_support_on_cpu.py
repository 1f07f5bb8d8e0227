"""What verl's workers need without an accelerator, applied by the plugin when verl imports them:
a valid process group, verl's FSDP engines for the CPU, offload without pinned memory.

Each process runs on the CPU platform (VERL_PLATFORM=cpu), so a GPU host runs the same checks."""

import textwrap
from pathlib import Path

from tests.harness.subprocess import run_python


def _run(code: str, **env) -> str:
    proc = run_python(textwrap.dedent(code), env={"VERL_PLATFORM": "cpu", **{k: str(v) for k, v in env.items()}})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


def test_the_process_group_verl_builds_under_ray_is_gloo_alone():
    """verl's `initialize_global_process_group_ray` (what its TrainingWorker calls under Ray) joins
    "cpu:gloo" and "<device>:<backend>"; on the CPU platform that reads "cpu:gloo,cpu:gloo", which
    torch refuses. With the plugin it gives a working group."""
    out = _run("""
        import torch.distributed as dist
        import verl
        from verl.utils.device import get_device_name
        from verl.utils.distributed import initialize_global_process_group_ray
        assert get_device_name() == "cpu"
        initialize_global_process_group_ray(timeout_second=60)
        t = __import__("torch").ones(3)
        dist.all_reduce(t)
        print("backend", dist.get_backend(), t.tolist())
        dist.destroy_process_group()
    """, RANK=0, WORLD_SIZE=1, MASTER_ADDR="127.0.0.1", MASTER_PORT=29731)
    assert "backend cpu:gloo [1.0, 1.0, 1.0]" in out, out


def test_the_engine_workers_module_binds_the_adapted_function():
    out = _run("""
        import verl
        import verl.workers.engine_workers as w
        import verl.utils.distributed as d
        print(w.initialize_global_process_group_ray is d.initialize_global_process_group_ray,
              hasattr(d.initialize_global_process_group_ray, "__wrapped__"))
    """)
    assert out.split() == ["True", "True"], out


def test_verls_fsdp_engines_are_found_for_the_cpu_without_patching_verl():
    import verl

    source = Path(verl.__file__).parent / "workers/engine/fsdp/transformer_impl.py"
    assert 'device=["cuda", "npu", "cpu"]' not in source.read_text()  # the optional patch is not applied here
    out = _run("""
        import verl
        from verl.workers.engine import EngineRegistry
        from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead, FSDPEngineWithValueHead
        for backend in ("fsdp", "fsdp2"):
            assert EngineRegistry.get_engine_cls("language_model", backend) is FSDPEngineWithLMHead
            assert EngineRegistry.get_engine_cls("value_model", backend) is FSDPEngineWithValueHead
        print("ok")
    """)
    assert out.strip() == "ok", out


def test_offload_policies_ask_for_no_pinned_memory_without_an_accelerator():
    out = _run("""
        import torch, verl
        import verl.workers.engine.fsdp.transformer_impl as impl
        here = torch.accelerator.is_available()
        policy = impl.CPUOffloadPolicy(pin_memory=True)  # what verl's FSDP2 engine builds for the ref worker
        torch.accelerator.is_available = lambda: False  # a host without an accelerator, on any host
        without = impl.CPUOffloadPolicy(pin_memory=True)
        print(type(without).__name__, without.pin_memory, policy.pin_memory == here)
    """)
    assert out.split() == ["CPUOffloadPolicy", "False", "True"], out  # pinned where an accelerator exists


def test_a_gpu_host_keeps_verls_code():
    """Off the CPU platform nothing changes: the adapted process-group call passes verl's own backend."""
    out = _run("""
        import verl
        import verl.utils.distributed as d
        import hilore_verl.integration.cpu_host.workers as cs
        cs._on_cpu = lambda: False
        seen = {}
        import torch.distributed as dist
        dist.init_process_group = lambda **kw: seen.update(kw)
        d.initialize_global_process_group_ray(timeout_second=5)
        print(seen["backend"])
    """)
    assert out.strip() == "cpu:gloo,cpu:gloo", out  # verl's string, untouched (its device name is cpu)
