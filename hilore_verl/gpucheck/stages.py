"""The check's codecs and runtime stages (see gpucheck/__init__.py).

On the CPU (`--device cpu`, Triton's interpreter) the same code runs at tiny sizes; what only a GPU
can show (a compiled launch, bandwidth beyond L2, host synchronisations) is recorded as a figure there,
not passed as a check.
"""

from __future__ import annotations

import statistics
import time

import torch

from hilore_verl.gpucheck.context import Context, StageReport, cosine, tiny_policy
from hilore_verl.kernels import FORMATS, reference, triton_guard, triton_codec

MIB = 2**20


# ---------------------------------------------------------------------------------------------- codecs
def mix_one_seed() -> int:
    """A seed whose seed_mix is 1 (an integer argument equal to 1 is where Triton specialises)."""
    from hilore_verl.kernels.reference import _SEED_MUL

    return pow(_SEED_MUL, -1, 2**31)


def _codec_cases(tiny: bool):
    """(shape, group size, dtypes, stochastic variants): every kernel variant on small odd shapes (row
    counts off the block size, several groups per row, 3-d), then large shapes in bf16 (many programs)."""
    from hilore_verl.kernels import DTYPES

    small = [(1, 64), (37, 192), (2, 5, 128)] if tiny else [(1, 64), (3, 128), (37, 192), (2, 5, 320), (33, 64)]
    rounding = ((False, 0), (True, mix_one_seed())) if tiny else ((False, 0), (True, 7), (True, mix_one_seed()))
    for shape in small:
        for group in (32, 64, 128):
            if shape[-1] % group == 0 and (not tiny or group == 64 or shape == (37, 192)):
                yield shape, group, DTYPES, rounding
    if not tiny:
        for shape in ((4096, 1536), (1000, 3584), (7, 129 * 64)):
            yield shape, 64, (torch.bfloat16,), ((False, 0), (True, mix_one_seed()))


def codecs(report: StageReport, ctx: Context) -> None:
    """Triton against the reference computed on the CPU (the definition: torch on CUDA divides by a
    Python number as a product with its reciprocal, so its own results there may differ in the last bit)."""
    device = ctx.torch_device()
    gen = torch.Generator(device="cpu").manual_seed(0)
    failures, cases = [], 0
    for shape, group, dtypes, rounding in _codec_cases(ctx.tiny):
        report.figure("bitwise_progress", f"{cases} cases, {len(failures)} differ; now {tuple(shape)} g{group}")
        for dtype in dtypes:
            base = (torch.randn(shape, generator=gen) * 3).to(dtype)
            if base.numel() >= 2 * group:  # non-finite groups: inf in one, nan in another, -inf in a third
                flat = base.view(-1)
                flat[1], flat[group + 2] = float("inf"), float("nan")
                if flat.numel() >= 3 * group:
                    flat[2 * group] = float("-inf")
            x = base.to(device)
            for fmt in FORMATS:
                for stochastic, seed in rounding:
                    cases += 1
                    label = f"{fmt} {str(dtype)[6:]} {tuple(shape)} g{group}" + (f" sr seed {seed}" if stochastic else "")
                    try:
                        q = triton_codec.quantize(x, fmt, group, stochastic, seed)
                        r = reference.quantize(base, fmt, group, stochastic, seed)
                        ok, _ = triton_guard.compare(r, q, triton_codec.dequantize(r.to(device)), label)
                    except Exception as err:
                        ok, label = False, f"{label}: {type(err).__name__}: {str(err)[:120]}"
                    if not ok:
                        failures.append(label)
    report.figure("bitwise_cases", cases)
    report.check("Triton codecs bitwise the reference", not failures,
                 f"{cases - len(failures)}/{cases} cases equal" + (f"; first failures: {failures[:5]}" if failures else ""))
    _bandwidth(report, ctx, device)


def _timer(device: torch.device):
    """seconds of fn() on `device`: CUDA events on a GPU, perf_counter on the CPU (median of `n`)."""
    def time_it(fn, n: int) -> float:
        fn()  # warm-up
        times = []
        for _ in range(n):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
        return statistics.median(times)
    return time_it


ROUND_TRIP_VS_COPY = 0.8  # target on a GPU: a codec's round trip at least this share of a copy's bandwidth


def _bandwidth(report: StageReport, ctx: Context, device: torch.device) -> None:
    """Quantize, dequantize and round trip of bf16 and fp32 against a device-to-device copy of the same
    bytes: as GB/s of input and as the copy's time over the codec's (1.0: as fast as a copy). CUDA:
    64 MiB-1 GiB (beyond L2), the target a check; on the CPU the product's CPU codec path at small sizes."""
    from hilore_verl.kernels import dequantize, quantize

    sizes = (1, 4) if ctx.tiny else (64, 256, 1024)
    time_it, n = _timer(device), 3 if ctx.tiny else 10
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        for mib in sizes:
            x = torch.randn(mib * MIB // dtype.itemsize // 1536, 1536, device=device, dtype=dtype)
            dst = torch.empty_like(x)
            copy_s = time_it(lambda: dst.copy_(x), n)
            for fmt in FORMATS:
                q = quantize(x, fmt, 64)
                quant_s = time_it(lambda: quantize(x, fmt, 64), n)
                deq_s = time_it(lambda: dequantize(q), n)
                gb = x.numel() * x.element_size() / 1e9
                rows.append({"dtype": str(dtype)[6:], "mib": mib, "format": fmt, "copy_gbps": round(gb / copy_s, 2),
                             "quantize_gbps": round(gb / quant_s, 2), "dequantize_gbps": round(gb / deq_s, 2),
                             "round_trip_gbps": round(gb / (quant_s + deq_s), 2),
                             "round_trip_vs_copy": round(copy_s / (quant_s + deq_s), 3)})
                report.figure("bandwidth", rows)
                del q
            del x, dst
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if ctx.device == "cuda" and not ctx.tiny:
        slow = [f"{r['format']} {r['dtype']} {r['mib']} MiB: {r['round_trip_vs_copy']}" for r in rows
                if r["round_trip_vs_copy"] < ROUND_TRIP_VS_COPY]
        report.check(f"target: every round trip at least {ROUND_TRIP_VS_COPY:.0%} of a copy's bandwidth", not slow,
                     "; ".join(slow) or f"least {min(r['round_trip_vs_copy'] for r in rows)}")
    else:
        report.check("codec bandwidth measured", bool(rows), f"{len(rows)} sizes x formats x dtypes")


# ---------------------------------------------------------------------------------------------- runtime
def _grads(model, ids: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, use_cache=False).logits
    loss = torch.log_softmax(logits.float(), -1)[..., :16].mean()  # every position, several classes
    loss.backward()
    return [p.grad.detach().clone() for p in model.parameters()]


def _mixes(units) -> dict[str, dict[str, str]]:
    names = [u.name for u in units]
    layers = sorted({u.layer_index for u in units if u.layer_index is not None})
    return {"all keep": {},
            "all recompute": {n: "recompute" for n in names},
            "every 3rd unit recomputed": {n: "recompute" for i, n in enumerate(names) if i % 3 == 0},
            "even layers recomputed": {f"layers.{i}": "recompute" for i in layers if i % 2 == 0},
            "odd units recomputed": {n: "recompute" for i, n in enumerate(names) if i % 2 == 1}}


BOUNDS = {"int8": 0.999, "fp8": 0.995, "int4": 0.95}  # gradient cosine against the exact one


def runtime(report: StageReport, ctx: Context) -> None:
    import copy

    import hilore_verl
    from hilore_verl import Plan

    device = ctx.torch_device()
    if device.type == "cuda":
        torch.use_deterministic_algorithms(True, warn_only=True)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    plain, vocab = tiny_policy(ctx)
    model = copy.deepcopy(plain)
    rt = hilore_verl.attach(model)
    tokens = 96 if ctx.tiny else 1024
    ids = torch.randint(0, vocab, (2, tokens), device=device)
    with sdpa_kernel(SDPBackend.MATH):  # a deterministic attention backward: what is compared is the runtime
        exact = _grads(plain, ids)
        for label, plan in _mixes(rt.units).items():
            rt.set_plan(plan)
            grads = _grads(model, ids)
            report.check(f"bitwise: {label}", all(torch.equal(a, b) for a, b in zip(grads, exact)),
                         f"{len(plan)} plan entries")
    rt.set_plan({})
    same = all(torch.equal(a, b) for a, b in zip(_grads(model, ids), _grads(plain, ids)))
    report.figure("default_attention_backend_bitwise_keep", same)  # atomics in some backends: informational
    cosines = {}
    for fmt, bound in BOUNDS.items():
        rt.set_plan(Plan(default=fmt))
        cos, rel = cosine(_grads(model, ids), _grads(plain, ids))
        cosines[fmt] = {"cosine": round(cos, 6), "rel_error": round(rel, 5)}
        report.check(f"{fmt} everywhere: gradient cosine >= {bound}", cos >= bound, f"cosine {cos:.6f}, rel {rel:.4f}")
    report.figure("compressed_gradients", cosines)
    with sdpa_kernel(SDPBackend.MATH):  # bitwise comparison again: no atomics in attention's backward
        _offload_steps(report, ctx, rt, model, vocab, device)
    _host_syncs(report, ctx, rt, model, plain, ids)
    rt.detach()


def _offload_steps(report, ctx, rt, model, vocab, device) -> None:
    from hilore_verl import Mode, Plan, UnitPlan

    gen = torch.Generator(device="cpu").manual_seed(1)
    equal, steps = True, 6
    lengths = []
    for _ in range(steps):  # a new token count every step, as verl's dynamic batch sizes give
        n = int(torch.randint(16, 128 if ctx.tiny else 2048, (1,), generator=gen))
        lengths.append(n)
        ids = torch.randint(0, vocab, (1, n), generator=gen).to(device)
        rt.set_plan(Plan(default="int8"))
        in_place = _grads(model, ids)
        rt.set_plan(Plan(default=UnitPlan(Mode.COMPRESS, fmt="int8", offload=True)))
        offloaded = _grads(model, ids)
        equal &= all(torch.equal(a, b) for a, b in zip(in_place, offloaded))
    stats = rt.stats()
    pool = {k: getattr(stats, k) for k in dir(stats) if "pool" in k and not k.startswith("_")}
    report.figure("offload", {"token_counts": lengths, **{k: v for k, v in pool.items() if isinstance(v, (int, float))}})
    report.check(f"offload over {steps} steps of varying tokens equals in-place compression", equal,
                 f"token counts {lengths}")


# host synchronisations the runtime may add to a warmed step, per micro-batch and plan: none for exact
# plans; one for compressed ones (settling the inf / nan checks of its codes, when their copies have not
# landed by the end of the backward: `Runtime.host_waits`)
HOST_SYNC_BUDGET = {"runtime: keep": 0, "runtime: recompute": 0, "runtime: int8": 1, "runtime: int8 + offload": 1}
MICRO_BATCHES = 2  # per counted step (gradient accumulation)
WARM_STEPS = 2  # uncounted steps first: compiles, the allocator's growth, the offload pools


def host_sync_verdict(counts: dict[str, int], micro_batches: int = MICRO_BATCHES) -> tuple[bool, str]:
    """Whether each runtime plan's synchronisations over the plain model's stay within its budget."""
    base, over = counts["plain model"], []
    for label, budget in HOST_SYNC_BUDGET.items():
        if label in counts and counts[label] - base > budget * micro_batches:
            over.append(f"{label}: {counts[label] - base} over the plain model's {base} "
                        f"(budget {budget} x {micro_batches} micro-batches)")
    return not over, "; ".join(over) or f"within budget on a warmed step of {micro_batches} micro-batches: {counts}"


def _host_syncs(report, ctx, rt, model, plain, ids) -> None:
    """Device-to-host synchronisations in a warmed step of MICRO_BATCHES forward + backward passes: what
    torch's sync debug mode reports (stream / device synchronisations, blocking copies), plus the runtime's
    own waits on events, which that mode cannot see (`Runtime.host_waits`); against HOST_SYNC_BUDGET.
    CUDA only."""
    from hilore_verl import Mode, Plan, UnitPlan

    if ctx.device != "cuda":
        report.figure("host_syncs_per_step", "not measurable on the CPU (no asynchronous device)")
        return
    import warnings

    def step(module):
        for _ in range(MICRO_BATCHES):
            _grads(module, ids)

    counts = {}
    for label, module, plan in (("plain model", plain, None), ("runtime: keep", model, {}),
                                ("runtime: int8", model, Plan(default="int8")),
                                ("runtime: int8 + offload", model, Plan(default=UnitPlan(Mode.COMPRESS, fmt="int8",
                                                                                       offload=True))),
                                ("runtime: recompute", model, {u.name: "recompute" for u in rt.units})):
        if plan is not None:
            rt.set_plan(plan)
        for _ in range(WARM_STEPS):
            step(module)
        torch.cuda.synchronize()
        waits = rt.host_waits
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                step(module)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        counts[label] = sum("synchroniz" in str(w.message) for w in caught) + rt.host_waits - waits
    report.figure("host_syncs_per_step", counts)
    ok, detail = host_sync_verdict(counts)
    report.check("host synchronisations within the runtime's budget", ok, detail)
