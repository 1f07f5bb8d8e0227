"""Physical peak memory of one actor update of one method, in this fresh process:

    python -m hilore_verl.bench.peak METHOD CONFIG_JSON [STATE | --first-step]

Linux: large allocations are kept out of malloc's arenas (MALLOC_MMAP_THRESHOLD_, set by the parent)
so freed memory leaves the process, and the CPU kernels' per-shape caches are off
(run.NO_KERNEL_CACHES); after a warm-up step the kernel's high-water mark is reset
(`/proc/self/clear_refs` <- 5, once a 32 MiB mapping written page by page has shown that the mark
follows what the process writes: else the row's peak is an error, not a low figure) and the next step's
VmHWM is read; then, on the CPU, a third step's
tensor bytes at their most (measure/allocations.py over the state the step starts with: what the
memory model predicts, which the resident size, with the libraries' own memory, cannot check to 5%;
on CUDA the peak is the allocator's already). The resident peak is reported over the process's
resident size before the model was built (Python, torch, the libraries and the codec's compiled
code, loaded first in every method's process), so ratios compare what the methods themselves
take. Planners load the parent's cost table and risk model (no second profiling run); with `--first-step` a
planner is built from scratch instead and the peak and time of its first step (profiling, calibration and
one update) are measured: its time is the planner's build and first step less the time GC's row takes to
build the same model and optimizer (`model_build_s`, which any method pays), against a GC step after one
warm-up step. A planner's state carries
the arm its measured trial runs in the parent (planner/arms.py), held here, so that the step measured
is the plan the parent timed (a fresh trial would run the hands-off baseline on the second step).
"""

from __future__ import annotations

import contextlib
import json
import sys
import time

from hilore_verl.measure.host_memory import status_kib

FIRST_STEP = "--first-step"


_status_kib = status_kib


def measure(method: str, config_json: str, state_path: str | None) -> dict:
    import torch

    from hilore_verl import kernels
    from hilore_verl.bench import methods as M
    from hilore_verl.bench.timer import spelled
    from hilore_verl.bench.actor_update import BenchConfig, make_batch

    config = BenchConfig(**{k: v for k, v in json.loads(config_json).items()
                            if k not in ("intermediate_size", "num_heads", "num_kv_heads")})
    batch = make_batch(config)
    cuda = torch.cuda.is_available()  # CUDA: the allocator's own peak (max_memory_allocated), not RSS
    code = _status_kib("VmRSS")
    kernels.warm_up("cuda" if cuda else "cpu")  # the codec's compiled code: part of every method's base
    code = _status_kib("VmRSS") - code
    base = torch.cuda.memory_allocated() // 1024 if cuda else _status_kib("VmRSS")
    if state_path == FIRST_STEP:  # a planner's first step: profiling and calibration, then one step
        return {"base_kib": base, "codec_code_kib": code, **_first_step(method, config, batch, cuda)}
    if method in M.PLANNERS:
        state = torch.load(state_path, weights_only=False)
        built = M.build_from_state(method, config, batch, state)
    else:
        built = M.build(method, config, batch)
    built.step(batch)  # warm-up (and the allocator's first touch)
    # what a training plan holds is counted in these steps (runtime_held_bytes below)
    with built.runtime.measured() if built.runtime is not None else contextlib.nullcontext():
        before, peak, tensors = _peak_steps(built, batch, cuda)
    held = None
    if built.runtime is not None and not built.runtime.hands_off:  # a hands-off forward measures nothing
        stats = built.runtime.stats()
        held = stats.stored_bytes + stats.unmanaged_bytes + stats.index_bytes
    c = built.controller
    arm = c.arms.label if c is not None else None  # the timed row's arm, held
    plan = spelled(c.history[-1].plan) if c is not None and c.history else None  # the plan measured here
    return {"base_kib": base, "codec_code_kib": code, "rest_kib": before, "peak_kib": peak, "runtime_held_bytes": held,
            "arm": arm, "plan": plan, "tensor_peak_kib": tensors}


def _peak_steps(built, batch, cuda: bool) -> tuple[int, int, int | None]:
    """(KiB before, KiB at the peak of one step, the bytes tensors held at most in one more step on the
    CPU, in KiB): CUDA's allocator peak, or the kernel's high-water mark after resetting it."""
    import torch

    if cuda:
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated() // 1024
        built.step(batch)
        peak = torch.cuda.max_memory_allocated() // 1024
    else:
        _reset_checked_mark()
        before = _status_kib("VmRSS")
        built.step(batch)
        peak = _status_kib("VmHWM")
    tensors = None
    if not cuda:  # one more step with the allocator's events followed: the bytes tensors held at most
        from hilore_verl.measure.allocations import allocations

        alive = state_bytes(built.model, built.optimizer)
        tensors = (alive + allocations(lambda: built.step(batch)).peak) // 1024
    return before, peak, tensors


def _first_step(method: str, config, batch, cuda: bool) -> dict:
    """A planner built from scratch and its first step, then GC's model built and a GC step timed."""
    import torch

    from hilore_verl.bench import methods as M
    from hilore_verl.planner import BudgetConfig

    if not cuda:
        _reset_checked_mark()
    start = time.perf_counter()
    built = M.build(method, config, batch, BudgetConfig("gc_ratio", 1.10))
    built.step(batch)
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() // 1024 if cuda else _status_kib("VmHWM")
    del built
    start = time.perf_counter()  # the model and optimizer a GC row builds: not the planner's own work
    gc = M.build("gc", config, batch)
    built_s = time.perf_counter() - start
    gc.step(batch)  # a GC step timed in the same process and environment, after one warm-up
    return {"peak_kib": peak, "first_step_s": seconds - built_s, "model_build_s": built_s, "gc_step_s": gc.step(batch)}


def _reset_checked_mark() -> None:
    """Reset the kernel's resident high-water mark, once it is shown to follow the pages this process writes
    (measure/peak_memory.py); where it does not, the peak would read low: RuntimeError, the row's peak_error."""
    from hilore_verl.measure.peak_memory import PeakMeter

    why_not = PeakMeter.check_host_peak()
    if why_not is not None:
        raise RuntimeError(f"no physical peak in this process: {why_not}")
    PeakMeter.reset_host_peak()


def state_bytes(model, optimizer) -> int:
    """Bytes of the tensors a step starts with: parameters, their gradients and the optimizer's state."""
    import torch

    storages = {}
    tensors = [t for p in model.parameters() for t in (p, p.grad) if t is not None]
    tensors += list(getattr(optimizer, "master", []))  # MasterAdamW's fp32 copies
    tensors += [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    for t in tensors:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


if __name__ == "__main__":
    print(json.dumps(measure(sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else None)))
