"""The bench's stopping rule on synthetic timings: paired rounds stop at the target, at the time cap (and
say so), never before the minimum, and every sweep budget stops on its own."""

import functools
import gc
import math
import random

import pytest

from hilore_verl.bench import rounds as Rd
from hilore_verl.bench.rounds import StopRule, run_rounds, sweep_cap, widest


class Clock:
    """Time that moves only by the synthetic steps' seconds."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def synthetic(spread: dict, clock: Clock, seed: int = 0):
    """step(key): GC 1 s, the others 0.8 s, each times (1 + a uniform draw in +-spread[key]); the clock advances."""
    rng = random.Random(seed)

    def step(key):
        base = 1.0 if key == "gc" else 0.8
        seconds = base * (1 + rng.uniform(-spread[key], spread[key]))
        clock.now += seconds
        return seconds

    return step


def _run(spread, rule, cap, seed=0):
    clock, lines = Clock(), []
    result = run_rounds("methods", list(spread), synthetic(spread, clock, seed), rule, cap, log=lines.append,
                        clock=clock)
    return result, lines


def test_rounds_stop_at_the_first_round_that_reaches_the_target():
    rule = StopRule(target=0.02, min_rounds=3, time_cap_s=1e6)
    result, lines = _run({"gc": 0.03, "hilore": 0.03, "fp8": 0.05}, rule, cap=1e6)
    assert result.stopped_by == "target" and result.reached and result.half_width <= 0.02
    assert result.rounds > 3  # the noise needs more than the minimum
    before = {k: v[:-1] for k, v in result.times.items()}
    assert widest(before)[0] > 0.02  # one round fewer had not reached it
    assert all(len(v) == result.rounds for v in result.times.values())
    assert "target +-2% reached after" in lines[-1]


def test_the_cap_stops_the_rounds_and_the_run_says_so():
    rule = StopRule(target=0.02, min_rounds=3, time_cap_s=20.0)
    result, lines = _run({"gc": 0.3, "hilore": 0.3}, rule, cap=20.0)
    assert result.stopped_by == "time cap" and not result.reached and result.half_width > 0.02
    assert result.elapsed_s <= 20.0 and result.cap_s == 20.0  # another round would have ended past the cap
    assert lines[-1].startswith("methods: time cap 20 s hit after") and "interval reached +-" in lines[-1]
    d = result.to_dict()
    assert d["reached"] is False and d["half_width"] == result.half_width and d["widest"] == "hilore"


def test_the_minimum_rounds_run_even_when_resolved_or_out_of_time():
    exact = {"gc": 0.0, "hilore": 0.0}  # the same ratio every round: resolved after two
    result, _ = _run(exact, StopRule(min_rounds=5), cap=1e6)
    assert result.rounds == 5 and result.stopped_by == "target" and result.half_width == 0.0
    result, _ = _run({"gc": 0.3, "hilore": 0.3}, StopRule(min_rounds=4), cap=0.5)
    assert result.rounds == 4 and result.stopped_by == "time cap"


def test_warm_up_rounds_run_every_key_and_are_not_timed():
    calls = []

    def step(key):  # each key's first step slow, as the first round after other work is on the CPU
        calls.append(key)
        return 10.0 if calls.count(key) == 1 else 1.0 + 0.01 * len(calls)

    result = run_rounds("methods", ["gc", "hilore"], step, StopRule(fixed=3), 1e6, log=lambda line: None)
    assert calls[:2] == ["gc", "hilore"] and len(calls) == 8  # one untimed round, then three timed
    assert all(len(v) == 3 and max(v) < 10 for v in result.times.values()), result.times
    result = run_rounds("methods", ["gc"], step, StopRule(fixed=2, warmup=0), 1e6, log=lambda line: None)
    assert result.times["gc"] == [1.0 + 0.01 * 9, 1.0 + 0.01 * 10]
    with pytest.raises(ValueError):
        StopRule(warmup=-1)


def test_a_fixed_count_has_no_target_and_no_cap():
    result, _ = _run({"gc": 0.0, "hilore": 0.0}, StopRule(fixed=7), cap=0.5)
    assert result.rounds == 7 and result.stopped_by == "fixed" and result.reached and result.cap_s is None
    result, _ = _run({"gc": 0.3, "hilore": 0.3}, StopRule(fixed=1), cap=1e6)
    assert result.rounds == 1 and math.isnan(result.half_width) and not result.reached


def test_without_gc_each_throughput_interval_is_weighed_and_the_cap_is_shared():
    result, _ = _run({"hilore": 0.01, "keep_recompute": 0.01}, StopRule(), cap=1e6)
    assert result.stopped_by == "target" and set(Rd.half_widths(result.times)) == {"hilore", "keep_recompute"}
    rule = StopRule(time_cap_s=900, sweep_time_cap_s=300)
    assert sweep_cap(rule, 900, 0, 5) == 60 and sweep_cap(rule, 950, 0, 5) == 60  # the methods took their cap
    assert sweep_cap(rule, 400, 0, 5) == 160  # what the methods left goes to the sweep
    assert sweep_cap(rule, 400, 55, 4) == pytest.approx(745 / 4)  # a set that stopped early leaves its rest
    assert sweep_cap(rule, 900, 400, 1) == 0 and sweep_cap(rule, 900, 0, 0) == 0
    with pytest.raises(ValueError):
        StopRule(target=math.nan)
    with pytest.raises(ValueError):
        StopRule(sweep_time_cap_s=0)


def test_every_sweep_budget_stops_on_its_own(monkeypatch):
    """A real bench run whose timed steps after each key's first are synthetic: the planner is noisy at the
    1.5 budget only, so that budget's rounds hit their cap while the others stop at the target."""
    from hilore_verl.bench import BenchConfig, run_bench
    from hilore_verl.bench import run as R
    from hilore_verl.bench import timer as T

    clock, rng, real_step, frozen = Clock(), random.Random(1), T.Timer.step, []

    def step(self, key):
        frozen.append(gc.get_freeze_count())
        if key not in self.seen:  # one real step per key: its controller plans once
            self.seen.add(key)
            real_step(self, key)
        elif isinstance(key, tuple) or key in self.trained:
            self.predicted[key].append(self.predicted[key][-1])
            self.session_s[key].append(0.0)
        noisy = isinstance(key, tuple) and key[1] == 1.5
        seconds = (1.0 if key == "gc" else 0.8) * (1 + rng.uniform(-0.3, 0.3) if noisy else 1 + rng.uniform(-0.002, 0.002))
        clock.now += seconds
        return seconds

    monkeypatch.setattr(T.Timer, "seen", set(), raising=False)
    monkeypatch.setattr(T.Timer, "step", step)
    monkeypatch.setattr(R, "run_rounds", functools.partial(run_rounds, clock=clock))
    tiny = BenchConfig(hidden_size=128, num_layers=2, vocab_size=512, num_groups=4, group_size=4,
                       max_response_len=32, zero_advantage_share=0.0, min_rounds=3, target_ci=0.02, time_cap_s=100.0,
                       sweep_time_cap_s=100.0)
    report = run_bench(tiny, methods=("gc", "hilore"), sweep=True, peaks=False)
    # what was built is frozen for the rounds only: not for the runner-ups' first step, nor after
    assert frozen[0] == 0 and frozen[-1] > 1000 and gc.get_freeze_count() == 0
    sets = {s["label"]: s for s in report["rounds"]}
    assert list(sets) == ["methods", "budget 1.0", "budget 1.1", "budget 1.25", "budget 1.5", "budget no_gc"]
    for label, s in sets.items():
        if label == "budget 1.5":
            # its share: the sweep's 100 s and what the methods left, less the earlier budgets', over two sets
            left = 100.0 + 100.0 - sets["methods"]["elapsed_s"] - sum(sets[f"budget {r}"]["elapsed_s"] for r in (1.0, 1.1, 1.25))
            assert s["stopped_by"] == "time cap" and not s["reached"] and s["rounds"] >= 3
            assert s["cap_s"] == pytest.approx(left / 2) and s["cap_s"] > 50.0
        else:
            assert s["stopped_by"] == "target" and s["reached"] and s["rounds"] == 3, s
    assert report["ci_reached"] is False and report["ci_half_width"] == sets["budget 1.5"]["half_width"]
    for row in report["sweep"]:
        assert row["ci_reached"] == (row["budget"] != 1.5) and len(row["step_times_s"]) == row["rounds"]
        assert row["x_gc"][1] <= row["x_gc"][0] <= row["x_gc"][2] and row["predicted_step_s"] > 0


def test_keys_not_settled_step_untimed_until_they_are_or_the_cap():
    """A planner whose measured trial alternates arms (planner/arms.py) is stepped, untimed, until it has
    chosen: the timed rounds see the plans a run keeps."""
    calls = []
    arms = {"gc": ["steady"], "hilore": ["plan"] * 3 + ["baseline"] * 3 + ["chosen"], "stuck": ["plan"] * 100}

    def arm(key):
        return arms[key][min(calls.count(key), len(arms[key]) - 1)]

    def step(key):
        calls.append(key)
        return 2.0 if arm(key) in ("plan", "baseline") else 1.0  # what the last step ran

    def settled(key):
        return arm(key) in ("steady", "chosen")

    rule = StopRule(fixed=3, warmup=1, settle_max=8)
    result = run_rounds("methods", ["gc", "hilore", "stuck"], step, rule, 1e6, log=lambda line: None, settled=settled)
    assert result.settle_steps == {"hilore": 5, "stuck": 8}  # after the warm-up round; the cap for "stuck"
    assert result.times["hilore"] == [1.0] * 3 and result.times["gc"] == [1.0] * 3
    assert result.to_dict()["settle_steps"] == {"hilore": 5, "stuck": 8}
    with pytest.raises(ValueError):
        StopRule(settle_max=-1)


def test_a_capped_set_says_how_many_rounds_the_target_would_take():
    rule = StopRule(target=0.02, min_rounds=3, time_cap_s=40.0)
    spread = {"gc": 0.15, "hilore": 0.15}
    result, lines = _run(spread, rule, cap=40.0)
    assert result.stopped_by == "time cap" and result.rounds_needed > result.rounds
    ratios = [g / h for g, h in zip(result.times["gc"], result.times["hilore"])]
    cv = Rd.statistics.stdev(ratios) / Rd.statistics.fmean(ratios)
    assert result.round_cv == pytest.approx(cv)
    n = result.rounds_needed  # the least round count whose interval is within the target at that spread
    assert Rd.t975(n - 1) * cv / math.sqrt(n) <= 0.02 < Rd.t975(n - 2) * cv / math.sqrt(n - 1)
    assert result.seconds_needed == pytest.approx(n * result.elapsed_s / result.rounds)
    assert f"would take {n} rounds" in lines[-1]
    # the estimate against the rounds the same noise takes without a cap (another draw of it)
    free, _ = _run(spread, StopRule(target=0.02, min_rounds=3, time_cap_s=1e6), cap=1e6, seed=1)
    assert free.stopped_by == "target" and 0.5 * n <= free.rounds <= 2 * n
    assert free.rounds_needed is None and not math.isnan(free.round_cv)  # reached: nothing needed


def test_rounds_needed_has_no_answer_without_a_spread():
    assert Rd.rounds_needed(math.nan, 0.02) is None
    assert Rd.rounds_needed(0.0, 0.02) == 2
    assert Rd.rounds_needed(1.0, 1e-4, limit=1000) is None
