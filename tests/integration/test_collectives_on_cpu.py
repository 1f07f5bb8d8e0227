"""HiLoRe's reductions when verl's data-parallel group has no CPU backend (NCCL's, as on GPUs).

2 gloo ranks; verl's group is made NCCL-like: a CPU tensor on it raises, as NCCL refuses one. Every
HiLoRe reduction (the session's, the audit's in-place sums, the fault agreement, the `auto` budget)
must still run, on HiLoRe's own gloo group over the same ranks, and give the right values. The
budget's compute device is simulated CUDA where a test says so.
"""

import pytest
import torch

from tests.harness.distributed import run_on_ranks

GIB = 2**30


def _refuse_cpu_tensors_on(groups):
    """dist's tensor collectives raise for a CPU tensor on one of `groups`, as NCCL does (its object
    collectives run on the current device, so they stay)."""
    import torch.distributed as dist

    def refusing(real):
        def collective(*args, group=None, **kwargs):
            tensor = args[0][0] if isinstance(args[0], list) else args[0]
            if any(group is g for g in groups) and tensor.device.type == "cpu":
                raise RuntimeError("No backend type associated with device type cpu")
            return real(*args, group=group, **kwargs)
        return collective

    for name in ("all_reduce", "all_gather", "broadcast", "reduce_scatter"):
        setattr(dist, name, refusing(getattr(dist, name)))


def _simulate_cuda(rank):
    """verl's device is CUDA: rank r has (r + 1) * 10 GiB free and (r + 1) GiB in its allocator's cache."""
    import verl.utils.device

    verl.utils.device.get_device_name = lambda: "cuda"
    torch.cuda.current_device = lambda: 0
    torch.cuda.mem_get_info = lambda device=None: ((rank + 1) * 10 * GIB, 80 * GIB)
    torch.cuda.memory_reserved = lambda device=None: (rank + 1) * GIB


def _reductions(rank, world_size):
    import torch.distributed as dist

    import hilore_verl.integration.actor.device_memory as device_memory
    from hilore_verl.integration.actor.collectives import DataParallel, collectives_for

    out = {}
    world = dist.group.WORLD  # what verl's FSDP engine hands in (no Ulysses)
    _refuse_cpu_tensors_on([world, None])
    try:
        dist.all_reduce(torch.ones(1), group=world)
        out["simulated"] = False
    except RuntimeError:
        out["simulated"] = True
    dp = collectives_for(world, fault_timeout_s=30)
    out["type"], out["world_size"] = type(dp).__name__, dp.world_size
    out["sum"] = dp.reduce([rank + 1.0, 10.0 * rank], "sum")
    out["max"], out["min"] = dp.reduce([rank + 1.0], "max"), dp.reduce([rank + 1.0], "min")
    out["empty"] = dp.reduce([])
    sums = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64) * (rank + 1)
    dp.sum_(sums)  # the audit's float64 sums, in place
    out["sum_"] = sums.tolist()
    strided = torch.arange(8, dtype=torch.float64).reshape(4, 2)[:, 0] * (rank + 1)  # not contiguous: a copy
    dp.sum_(strided)
    out["sum_strided"] = strided.tolist()
    out["agreed"] = dp.agree_on_failure()  # every rank "failed" here, collectives paired

    # the `auto` budget on the host: MemAvailable shared by this host's 2 ranks, + resident memory
    device_memory._host_available_bytes = lambda: (rank + 1) * 8e9
    device_memory._resident_bytes = lambda: 1e9
    out["host_budget"] = device_memory.available_bytes(torch.device("cpu"), world)
    # on (simulated) CUDA, also when handed an offloaded parameter's device (the host)
    _simulate_cuda(rank)
    out["cuda_budget"] = device_memory.available_bytes(device_memory.compute_device(), world)
    out["offloaded_budget"] = device_memory.available_bytes(torch.device("cpu"), world)

    # disjoint data-parallel groups ({0}, {1}): every rank creates every gloo twin, in one order
    own, _ = dist.new_subgroups(group_size=1)
    _refuse_cpu_tensors_on([world, None, own])
    single = DataParallel(own, fault_timeout_s=30)
    out["own_group"] = single.reduce([rank + 1.0], "sum"), single.world_size, single.agree_on_failure()
    return out


def test_every_reduction_runs_beside_a_group_without_a_cpu_backend():
    ranks = run_on_ranks(_reductions, 2)
    for rank, out in enumerate(ranks):
        assert out["simulated"], "the stand-in for NCCL must refuse a CPU tensor on verl's group"
        assert (out["type"], out["world_size"]) == ("DataParallel", 2)
        assert out["sum"] == [3.0, 10.0] and out["max"] == [2.0] and out["min"] == [1.0] and out["empty"] == []
        assert out["sum_"] == [3.0, 6.0, 9.0, 12.0]
        assert out["sum_strided"] == [0.0, 6.0, 12.0, 18.0]
        assert out["agreed"] is None
        assert out["host_budget"] == pytest.approx(8e9 / 2 + 1e9)  # the minimum: rank 0's
        assert out["cuda_budget"] == out["offloaded_budget"] == 11 * GIB  # rank 0's 10 GiB free + 1 GiB cached
        assert out["own_group"] == ([rank + 1.0], 1, None)


def test_compute_device_is_verls_device_not_a_parameters(monkeypatch):
    import verl.utils.device

    from hilore_verl.integration.actor.device_memory import available_bytes, compute_device

    monkeypatch.setattr(verl.utils.device, "get_device_name", lambda: "cpu")
    assert compute_device() == torch.device("cpu")
    assert available_bytes() > 0  # the host's figures, one process
    monkeypatch.setattr(verl.utils.device, "get_device_name", lambda: "cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (5 * GIB, 80 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 2 * GIB)
    assert compute_device() == torch.device("cuda", 3)
    # the engine's call today hands in its first parameter's device: the host under FSDP2 parameter offload
    assert available_bytes(torch.device("cpu")) == available_bytes() == 7 * GIB
    assert available_bytes(torch.device("cuda", 3)) == 7 * GIB


def test_a_retry_needs_every_group_paired():
    """`unpaired`: ranks that share a group must have issued as many collectives on it (a group only some
    ranks are in is compared among those)."""
    from hilore_verl.integration.actor.collectives import unpaired

    assert unpaired([(0, {"0": 12, "1": 3}), (1, {"0": 12, "2": 5})]) is None
    why = unpaired([(0, {"0": 12, "1": 3}), (1, {"0": 11, "1": 3})])
    assert why is not None and "group 0" in why and "rank 0 issued 12" in why and "rank 1 11" in why


def test_compile_workers_are_the_ranks_share_of_the_cpus(monkeypatch):
    import os

    import torch._inductor.config as inductor

    from hilore_verl.integration.actor.compile_workers import ENV, limit_compile_workers

    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    saved = inductor.compile_threads  # restored by hand: Inductor's config is not a plain module attribute
    try:
        inductor.compile_threads = 32
        assert limit_compile_workers() == 8 and inductor.compile_threads == 8  # 64 CPUs / 8 ranks
        inductor.compile_threads = 32
        assert limit_compile_workers(ranks=128) == 1  # at least one
        inductor.compile_threads = 32
        monkeypatch.setenv(ENV, "4")  # the user's setting stands
        assert limit_compile_workers() is None and inductor.compile_threads == 32
    finally:
        inductor.compile_threads = saved


def _watch_then_exit(rank, world_size):
    import hilore_verl.integration.actor.collectives as collectives

    collectives.WATCH_EVERY_S = 0.0  # the monitor reads the store back to back: always inside a read at exit
    dp = collectives.collectives_for(None, fault_timeout_s=30)
    dp.watch()
    return dp.stopped_by_peer()


def test_ranks_with_a_stop_monitor_exit_cleanly():
    """A rank that trained to the end exits with status 0: its stop monitor ends before the interpreter
    does (a daemon thread inside a store read at finalisation aborts the process with SIGABRT; without
    `close` at exit this failed on every one of 10 two-rank runs)."""
    assert run_on_ranks(_watch_then_exit, 2) == [None, None]
