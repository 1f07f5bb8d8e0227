"""The bench's intervals: Student's t over paired rounds, against values worked out by hand."""

import math
import statistics

import pytest

from hilore_verl.bench.rounds import rotated
from hilore_verl.measure.intervals import mean_ci, paired_ratio_ci, t975


def test_the_interval_of_a_mean_is_t_times_the_standard_error():
    values = [1.0, 2.0, 3.0, 4.0]  # mean 2.5, sd 1.29099, t(0.975, 3) = 3.182
    mean, low, high = mean_ci(values)
    half = 3.182 * statistics.stdev(values) / 2
    assert mean == 2.5 and low == pytest.approx(2.5 - half) and high == pytest.approx(2.5 + half)
    assert high - low == pytest.approx(4.1080, abs=1e-3)


def test_one_value_has_no_interval_and_t_falls_to_the_normal():
    mean, low, high = mean_ci([3.0])
    assert mean == 3.0 and math.isnan(low) and math.isnan(high)
    assert t975(1) == 12.706 and t975(30) == 2.042 and t975(31) == 1.96
    with pytest.raises(ValueError):
        t975(0)


def test_paired_ratios_cancel_a_drift_shared_by_both_sides():
    drift = [1.0, 1.3, 0.8, 1.1, 0.9]  # the machine slows and speeds up between rounds
    gc = [2.0 * d for d in drift]
    fast = [1.0 * d for d in drift]
    mean, low, high = paired_ratio_ci(gc, fast)  # throughput over GC's: exactly 2 in every round
    assert mean == pytest.approx(2.0) and high - low == pytest.approx(0.0, abs=1e-12)
    unpaired = mean_ci([g / statistics.fmean(fast) for g in gc])
    assert unpaired[2] - unpaired[1] > 0.5  # the same data unpaired cannot resolve it
    with pytest.raises(ValueError):
        paired_ratio_ci([1.0], [1.0, 2.0])


def test_each_key_starts_a_round_in_turn():
    keys = ["a", "b", "c"]
    assert [rotated(keys, r)[0] for r in range(4)] == ["a", "b", "c", "a"]
    assert sorted(rotated(keys, 2)) == keys and rotated([], 5) == []
