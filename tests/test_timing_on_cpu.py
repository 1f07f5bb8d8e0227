"""The device clock that profiling goes through: it synchronizes the device it times."""

import time

import torch

from hilore_verl.planner import costs
from hilore_verl.timing import DeviceClock
from tests.test_planner_on_cpu import _tiny_probe


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
        def mark(self):
            marks.append(self.device)
            return super().mark()

    monkeypatch.setattr(costs, "DeviceClock", CountingClock)
    _, rt, _, _, table = _tiny_probe()  # profiles with the clock patched in
    calls = sum(1 for _ in rt.unit_modules)  # at least one start and one end mark per unit module
    assert len(marks) >= 2 * calls and all(d == torch.device("cpu") for d in marks)
    assert all(u.forward_s >= 0 for u in table.units) and sum(u.forward_s for u in table.units) > 0
    assert table.codec_bytes_per_s > 0 and table.host_bytes_per_s > 0
