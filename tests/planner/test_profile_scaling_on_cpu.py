"""Profiling figures that a GPU's launch overhead would skew: codec and host-copy bandwidth fitted as
t = t0 + bytes / bw at the sizes of real tensors, host copies made as the offload makes them (pinned,
on a side stream), and unit times split into a fixed per-call part and a per-token part."""

import time

import pytest
import torch

import hilore_verl
from hilore_verl.planner import CostTable, UnitProfile, profile
from hilore_verl.planner import bandwidth
from hilore_verl.planner import profiling as costs
from hilore_verl.planner.bandwidth import sample_bytes
from hilore_verl.planner.growth import fixed_share, quadratic_share
from hilore_verl.measure.timing import DeviceClock, fit_bandwidth
from hilore_verl.tiny.models import build_tiny_model
from hilore_verl.model.units import name_in_layer
from hilore_verl.tiny.workload import GRPOWorkload, make_grpo_batch
from hilore_verl.tiny.workload import response_log_probs

OVERHEAD = 50e-6  # a launch
BW = 1e12  # bytes per second at large sizes


def launch_bound(nbytes: int) -> float:
    return OVERHEAD + nbytes / BW


def test_sample_sizes_follow_the_largest_unit_within_free_memory(monkeypatch):
    assert sample_bytes(torch.device("cpu"), 10 * 2**30, 2) == 1024 * 1024 * 2  # the CPU stays cheap
    free = [80 * 2**30]
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free[0], 80 * 2**30))
    cuda, row = torch.device("cuda"), 4 * 1024 * 2
    assert sample_bytes(cuda, 2**20, 2) == bandwidth.SAMPLE_MIN_BYTES  # at least 64 MiB
    assert sample_bytes(cuda, 300 * 2**20 + 5, 2) == 300 * 2**20  # the largest unit's bytes, whole rows
    assert sample_bytes(cuda, 10 * 2**30, 2) == bandwidth.SAMPLE_MAX_BYTES
    free[0] = 2**30
    assert sample_bytes(cuda, 300 * 2**20, 2) == 2**30 // 8  # bounded by free memory
    free[0] = 1000
    assert sample_bytes(cuda, 300 * 2**20, 2) == row  # never empty
    assert all(sample_bytes(cuda, n, 4) % (4 * 1024 * 4) == 0 for n in (1e6, 7e7, 3e8))


def test_a_launch_bound_sample_reads_as_low_bandwidth_and_the_fit_recovers_it(monkeypatch):
    small = 1024 * 1024 * 2  # the former sample: 1M bf16 elements
    old = small / launch_bound(small)
    assert old == pytest.approx(BW / (1 + OVERHEAD * BW / small)) and old < BW / 20  # off by the overhead factor
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (80 * 2**30, 80 * 2**30))
    nbytes = sample_bytes(torch.device("cuda"), 200 * 2**20, 2)
    bw, t0 = fit_bandwidth(launch_bound, nbytes)
    assert bw == pytest.approx(BW, rel=1e-9) and t0 == pytest.approx(OVERHEAD, rel=1e-9)
    for sign in (1, -1):  # 1% timing noise, of opposite signs at the two sizes (the worst case)
        noisy = lambda n: launch_bound(n) * (1 + sign * (0.01 if n == nbytes else -0.01))  # noqa: E731
        assert fit_bandwidth(noisy, nbytes)[0] == pytest.approx(BW, rel=0.05)


class SizedClock:
    """Times a call at OVERHEAD + bytes / BW, the bytes being what the (patched) codec last took."""

    events, device = False, torch.device("cuda")

    def __init__(self):
        self.nbytes = 0

    def time(self, fn, repeats=1, stream=None):
        fn()
        return launch_bound(self.nbytes)


def test_codec_bandwidth_is_fitted_over_the_sample_and_its_quarter(monkeypatch):
    clock = SizedClock()
    sizes = []

    class Payload:
        def dequantize(self):
            return None

    def quantize(x, fmt, group_size):
        clock.nbytes = x.numel() * x.element_size()
        sizes.append(clock.nbytes)
        return Payload()

    monkeypatch.setattr(bandwidth, "quantize", quantize)
    sample = torch.empty(bandwidth.SAMPLE_MIN_BYTES // (1024 * 2), 1024, dtype=torch.bfloat16)
    codec = bandwidth.codec_bandwidth(clock, sample)
    assert sorted(set(sizes)) == [bandwidth.SAMPLE_MIN_BYTES // 4, bandwidth.SAMPLE_MIN_BYTES]
    assert codec == pytest.approx(2 * BW, rel=0.05)  # quantize + dequantize: 2 S / codec_bytes_per_s per unit


class FakeStreams:
    """A device module with streams and timing events, recording which stream each event was on."""

    def __init__(self):
        self.compute = object()
        self.current = self.compute
        self.waited = []
        self.events = []

    def current_stream(self):
        return self.current

    def Stream(self):
        module = self

        class Stream:
            def wait_stream(self, other):
                module.waited.append((self, other))

        return Stream()

    def stream(self, stream):
        module = self

        class Context:
            def __enter__(self):
                self.before, module.current = module.current, stream

            def __exit__(self, *exc):
                module.current = self.before

        return Context()

    def Event(self, enable_timing=False):
        module = self

        class Event:
            def record(self, stream=None):
                self.stream, self.at = stream or module.current, time.perf_counter()
                module.events.append(self)

            def synchronize(self):
                pass

            def elapsed_time(self, end):
                return (end.at - self.at) * 1e3

        return Event()

    def synchronize(self, device=None):
        pass


def test_host_copies_are_timed_pinned_on_a_side_stream(monkeypatch):
    fake = FakeStreams()
    clock = DeviceClock("cpu")
    clock.device, clock.module, clock.events = torch.device("cuda"), fake, True  # CUDA's path, simulated
    asked = []
    monkeypatch.setattr(bandwidth, "host_buffer", lambda like, pinned: asked.append(pinned) or torch.empty_like(like))
    sample = torch.randn(64, 1024)
    assert bandwidth.host_bandwidth(clock, sample) > 0
    assert asked == [True]  # a pinned host buffer, as the offload pool's
    side = {id(s) for s, other in fake.waited if other is fake.compute}
    assert len(side) == 1 and len(fake.waited) == 2  # one side stream, ordered after the compute stream per size
    assert len(fake.events) == 4 and all(id(e.stream) in side for e in fake.events)  # marks on the side stream
    assert fake.current is fake.compute


def test_host_copies_on_the_cpu_are_synchronous_and_real(monkeypatch):
    asked = []
    buffer = bandwidth.host_buffer
    monkeypatch.setattr(bandwidth, "host_buffer", lambda like, pinned: asked.append(pinned) or buffer(like, pinned))
    clock, times = DeviceClock("cpu"), []
    timed = clock.time
    clock.time = lambda fn, repeats=1, stream=None: times.append(stream) or timed(fn, repeats, stream)
    host = bandwidth.host_bandwidth(clock, torch.randn(256, 1024))
    assert asked == [False] and 1e6 < host < 1e13
    assert times == [None]  # on the current stream, at one size (the CPU's fixed time is small)


def test_a_fixed_per_call_time_is_not_scaled_with_tokens():
    fixed, per_token, t1, t2 = 40e-6, 3e-9, 1000, 2048
    t = lambda n: fixed + per_token * n  # noqa: E731
    a = fixed_share(t(t1), t(t2), t1 / t2)
    assert a == pytest.approx(fixed / t(t2)) and quadratic_share(t(t1), t(t2), t1 / t2) == 0.0
    unit = UnitProfile("u", 0.0, 0.0, t(t2), forward_fixed=a)
    table = CostTable([unit], tokens=t2, unmanaged_bytes=0.0)
    for n in (t1, t2, 16384, 65536):
        assert table.forward(unit, n) == pytest.approx(t(n), rel=1e-9)
    slope = (table.forward(unit, 32768) - table.forward(unit, 16384)) / 16384
    assert slope == pytest.approx(per_token, rel=1e-9)  # the per-token slope recovered
    linear = table.grow(unit.forward_s, 0.0, 16384)  # the probe's time per token, overhead included
    assert linear / t(16384) > 1.5
    recompute = next(o for o in table.options(unit, 16384) if o.plan == "recompute")
    assert recompute.time == pytest.approx(t(16384), rel=1e-9)


@pytest.mark.parametrize("ratio", [0.2, 0.3, 0.45, 0.5, 0.55, 0.8, 0.99, 1.0, 1.3])
def test_two_probes_give_one_physical_share_that_passes_through_both(ratio):
    r, large = 0.5, 1e-3
    a, q = fixed_share(ratio * large, large, r), quadratic_share(ratio * large, large, r)
    assert a >= 0 and q >= 0 and a * q == 0 and a + q <= 1  # non-negative terms, at most one of them
    unit = UnitProfile("u", 0.0, 0.0, large, forward_quadratic=q, forward_fixed=a)
    table = CostTable([unit], tokens=2000, unmanaged_bytes=0.0)
    if r * r <= ratio < 1:  # a fixed part, linear, or a quadratic part: the fit reproduces the small probe
        assert table.forward(unit, 1000) == pytest.approx(ratio * large, rel=1e-9)
    if ratio >= 1:  # no growth: a per-call cost, the same at any size
        assert a == 1.0 and q == 0.0
        assert table.forward(unit, 10**6) == pytest.approx(large, rel=1e-9)
    assert all(table.forward(unit, n) >= 0 for n in (1, 10, 1000, 10**6))
    assert fixed_share(ratio * large, large, 1.0) == 0.0 and fixed_share(1.0, 0.0, r) == 0.0  # equal probes, none
    if r < ratio:  # noise that spans linear growth: not measured
        assert fixed_share(ratio * large, large, r, noise=1 - r / ratio + 1e-9) == 0.0
        assert fixed_share(ratio * large, large, r, noise=(1 - r / ratio) / 2) == a


def _tiny_runs():
    model = build_tiny_model("qwen2", seed=0).train()
    rt = hilore_verl.attach(model)
    batch = make_grpo_batch(GRPOWorkload(num_groups=2, group_size=4, max_prompt_len=16, max_response_len=48), seed=0)

    def run():
        model.zero_grad(set_to_none=True)
        response_log_probs(model, batch).sum().backward()

    return rt, run, batch["attention_mask"].numel()


def _affine_profile(monkeypatch, noisy: bool = False):
    """The tiny model profiled with unit times affine in tokens, OVERHEAD + slope * tokens, the slope by
    unit kind (as the profile's figures are); `noisy`: the first of the probe's timed runs 30% slow."""
    rt, run, tokens = _tiny_runs()
    small_run, small_tokens = (lambda: run()), tokens // 2
    kinds = sorted({u.group or name_in_layer(u.name) for u in rt.units})
    slope = {u.name: (1 + kinds.index(u.group or name_in_layer(u.name))) * 1e-8 for u in rt.units}
    real, calls = costs._unit_times, []

    def affine(runtime, fn, clock):
        ran, seconds = real(runtime, fn, clock)
        n = small_tokens if fn is small_run else tokens
        calls.append(n)
        slow = 1.3 if noisy and calls.count(tokens) == 1 and n == tokens else 1.0
        return {name: slow * (OVERHEAD + slope[name] * n) for name in ran}, seconds

    monkeypatch.setattr(costs, "_unit_times", affine)
    table = profile(rt, run, tokens, element_size=4, small=(small_run, small_tokens))
    return table, tokens, lambda u, n: OVERHEAD + slope[u.name] * n


def test_profile_separates_a_fixed_part_of_unit_times_from_the_per_token_part(monkeypatch):
    """Unit times that are affine in tokens (a fixed launch overhead plus a per-token part): the profile's
    two probes recover both, and a unit's recompute time at 8x the probe's tokens is the affine time,
    where scaling the probe's time linearly would scale its overhead with it."""
    table, tokens, true = _affine_profile(monkeypatch)
    for u in table.units:
        assert u.forward_s == pytest.approx(true(u, tokens)) and u.forward_quadratic == 0.0
        assert table.forward(u, 8 * tokens) == pytest.approx(true(u, 8 * tokens), rel=1e-6)
        per_token = (table.forward(u, 16 * tokens) - table.forward(u, 8 * tokens)) / (8 * tokens)
        assert per_token == pytest.approx(true(u, 1) - OVERHEAD, rel=1e-6)  # the slope
        assert 8 * u.forward_s > 1.1 * true(u, 8 * tokens)  # the linear estimate: the overhead times 8
    assert table.codec_bytes_per_s > 0 and table.host_bytes_per_s > 0


def test_noise_that_cannot_be_told_from_no_growth_still_separates_a_fixed_part(monkeypatch):
    """A 30% slow run: the noise spans "no growth" but not linear growth. The fastest times are still
    the true ones, so the fixed part is the true one (pricing it linearly would scale the overhead
    8x at 8x the tokens)."""
    table, tokens, true = _affine_profile(monkeypatch, noisy=True)
    for u in table.units:
        assert u.forward_s == pytest.approx(true(u, tokens)) and u.forward_fixed > 0.5
        assert table.forward(u, 8 * tokens) == pytest.approx(true(u, 8 * tokens), rel=1e-6)


def test_noise_that_spans_linear_growth_is_priced_linearly():
    r, large = 0.5, 1e-3
    small = 0.6 * large  # grew 1.67x of a possible 2x, with a 30% spread: linear growth cannot be excluded
    assert fixed_share(small, large, r, noise=0.3) == 0.0
    assert fixed_share(small, large, r, noise=0.1) == pytest.approx(0.2)
