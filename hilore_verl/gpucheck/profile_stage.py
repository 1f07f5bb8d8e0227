"""The check's profile stage: one HiLoRe update (after its first) under torch's profiler and cProfile.

Two views of the same kind of step: the top operators and kernels by self time on the device (CUDA
time on a GPU, CPU time on the CPU), from torch.profiler; and the share of the step's host time
spent in hilore-verl's own Python code (saved-tensor hooks, module hooks, planning), from cProfile's
per-function self time of functions defined under the hilore_verl package. On a GPU the host share
is what could leave the device waiting.
"""

from __future__ import annotations

import cProfile
import os
import pstats
import time

from hilore_verl.gpucheck.context import Context, StageReport

TOP = 12
HOST_SHARE = 0.02  # the most of a GPU step's host time hilore-verl's own Python may take


def _workload(ctx: Context) -> dict:
    if ctx.tiny:
        return dict(hidden_size=128, num_layers=2, vocab_size=512, num_groups=2, group_size=4, max_prompt_len=24,
                    max_response_len=48, profile_tokens=256)
    return dict(model="qwen2.5-1.5b", model_layers=4, num_groups=4, group_size=8, max_prompt_len=128,
                max_response_len=256, master_fp32=True)


def _own_share(stats: pstats.Stats, wall_s: float) -> tuple[float, list]:
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    own = []
    for (filename, line, name), (_, _, tottime, _, _) in stats.stats.items():
        if os.path.abspath(filename).startswith(package + os.sep):
            own.append((tottime, f"{os.path.relpath(filename, os.path.dirname(package))}:{line} {name}"))
    own.sort(reverse=True)
    return sum(t for t, _ in own) / wall_s if wall_s > 0 else 0.0, own[:TOP]


def profile_stage(report: StageReport, ctx: Context) -> None:
    from torch.profiler import ProfilerActivity, profile

    from hilore_verl.bench.session_passes import SessionMethod
    from hilore_verl.bench.actor_update import BenchConfig, make_batch
    from hilore_verl.training.config import HiLoReConfig

    bench = BenchConfig(**_workload(ctx))
    batch = make_batch(bench)
    method = SessionMethod("hilore", bench, HiLoReConfig(enable=True, profile_tokens=bench.profile_tokens))
    method.step(batch)  # the first step: probing, profiling, calibration
    method.step(batch)
    report.figure("plan", method.predicted(int(batch["tokens"]))["plan_counts"])
    cuda = ctx.device == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        step_s = method.step(batch)
    key = "self_device_time_total" if cuda else "self_cpu_time_total"  # FunctionEventAvg's fields
    events = sorted(prof.key_averages(), key=lambda e: getattr(e, key), reverse=True)
    total = sum(getattr(e, key) for e in events) or 1.0
    top = [{"name": e.key[:80], "calls": e.count, "self_ms": round(getattr(e, key) / 1e3, 3),
            "share": round(getattr(e, key) / total, 4)} for e in events[:TOP]]
    report.figure("top_by_self_device_time" if cuda else "top_by_self_cpu_time", top)
    report.figure("profiled_step_s", round(step_s, 4))
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    method.step(batch)
    profiler.disable()
    wall = time.perf_counter() - start
    share, functions = _own_share(pstats.Stats(profiler), wall)
    report.figure("hilore_host_share", round(share, 4))
    report.figure("hilore_top_functions", [{"self_s": round(t, 5), "function": f} for t, f in functions])
    report.check("a HiLoRe step profiled", bool(top) and top[0]["self_ms"] > 0,
                 f"step {wall:.3f} s under cProfile; hilore-verl's own code {100 * share:.1f}% of its host time")
    if cuda and not ctx.tiny:  # on the CPU the device's work is host time too: the share means nothing there
        report.check(f"target: hilore-verl's own host time at most {HOST_SHARE:.0%} of the step", share <= HOST_SHARE,
                     f"{100 * share:.2f}%")
