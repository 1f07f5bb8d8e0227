"""The device clock that profiling goes through: it synchronizes the device it times, runs and marks
work on a side stream when asked, and fits a bandwidth apart from a call's fixed time."""

import time

import pytest
import torch

from hilore_verl.planner import profiling as costs
from hilore_verl.measure.timing import DeviceClock
from tests.planner.test_planner_on_cpu import _tiny_probe


def test_each_mark_synchronizes_the_device_it_times(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cpu, "synchronize", lambda *a: calls.append(a))
    clock = DeviceClock("cpu")
    start = clock.mark()
    time.sleep(0.02)
    end = clock.mark()
    assert len(calls) == 2
    assert 0.02 <= clock.seconds(start, end) < 1.0
    seconds = clock.time(lambda: time.sleep(0.01), repeats=2)
    assert len(calls) == 4 and 0.01 <= seconds < 0.5  # the warm-up call is not counted


def test_profiling_times_units_through_the_clock(monkeypatch):
    marks = []

    class CountingClock(DeviceClock):
        def mark(self, stream=None):
            marks.append(self.device)
            return super().mark(stream)

    monkeypatch.setattr(costs, "DeviceClock", CountingClock)
    _, rt, _, _, table = _tiny_probe()  # profiles with the clock patched in
    calls = sum(1 for _ in rt.unit_modules)  # at least one start and one end mark per unit module
    assert len(marks) >= 2 * calls and all(d == torch.device("cpu") for d in marks)
    assert all(u.forward_s >= 0 for u in table.units) and sum(u.forward_s for u in table.units) > 0
    assert table.codec_bytes_per_s > 0 and table.host_bytes_per_s > 0


def test_a_side_stream_is_ordered_after_the_current_one_and_marked_on_itself():
    from tests.planner.test_profile_scaling_on_cpu import FakeStreams

    fake = FakeStreams()
    clock = DeviceClock("cpu")
    clock.module, clock.events = fake, True  # CUDA's path, simulated
    side, ran = fake.Stream(), []
    seconds = clock.time(lambda: ran.append(fake.current), repeats=2, stream=side)
    assert seconds >= 0 and ran == [side] * 3  # the warm-up and both calls on the side stream
    assert fake.waited == [(side, fake.compute)] and [e.stream for e in fake.events] == [side, side]
    assert fake.current is fake.compute
    clock.time(lambda: ran.append(fake.current))  # no stream: the current one, no wait
    assert ran[-1] is fake.compute and len(fake.waited) == 1


def test_on_the_cpu_a_side_stream_runs_synchronously():
    clock = DeviceClock("cpu")
    seconds = clock.time(lambda: time.sleep(0.01), repeats=2, stream=torch.cpu.Stream())
    assert 0.01 <= seconds < 0.5


def test_a_fit_that_is_not_physical_falls_back_to_the_larger_calls_throughput():
    from hilore_verl.measure.timing import fit_bandwidth

    assert fit_bandwidth(lambda n: 1e-3, 4096) == (4096 / 1e-3, 0.0)  # no slower at 4x the bytes: noise
    assert fit_bandwidth(lambda n: n * n * 1e-12, 4096) == (4096 / (4096 ** 2 * 1e-12), 0.0)  # t0 < 0
    assert fit_bandwidth(lambda n: 1e-3, 2) == (2 / 1e-3, 0.0)  # no smaller size to fit against
    bw, t0 = fit_bandwidth(lambda n: 2e-6 + n / 5e9, 2**20)
    assert bw == pytest.approx(5e9) and t0 == pytest.approx(2e-6)
