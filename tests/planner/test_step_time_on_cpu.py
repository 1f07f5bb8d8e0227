"""The cost model's step time against the clock (planner/step_time.py): the scale is the median of the
timed mini-batches' measured / modelled seconds, and the controller's predicted step time carries it."""

import pytest

from hilore_verl.planner.step_time import StepTimeScale


def test_the_scale_is_the_median_ratio_of_the_last_timed_mini_batches():
    s = StepTimeScale(window=3)
    assert s.value == 1.0
    s.planned(1.0)
    s.planned(0.5)
    s.measured(None)  # not timed (the first, or a retried mini-batch): nothing learnt, a new mini-batch
    assert s.value == 1.0 and s.modelled_s == 0.0 and s.ratios == []
    for measured in (3.0, 4.5, 30.0, 3.3):  # modelled 1.5 s each: ratios 2, 3, 20, 2.2
        s.planned(1.0)
        s.planned(0.5)
        s.measured(measured)
    assert s.ratios == pytest.approx([3.0, 20.0, 2.2]) and s.value == pytest.approx(3.0)  # one slow one ignored
    s.measured(5.0)  # nothing planned since: no ratio
    assert s.value == pytest.approx(3.0)


def test_the_controller_predicts_with_the_measured_scale(tmp_path):
    from tests.planner.test_planner_on_cpu import ROOMY, _tiny_probe

    from hilore_verl.planner import Controller

    _, rt, _, tokens, costs = _tiny_probe()
    ctl = Controller(rt, costs, None, ROOMY)
    ctl.begin_mini_batch([1.0, 1.0], [tokens, tokens])
    plans = [ctl.plan_micro_batch(0), ctl.plan_micro_batch(1)]
    modelled = [ctl.predicted_step_seconds(p, tokens, measured=False) for p in plans]
    assert ctl.predicted_step_seconds(plans[0], tokens) == modelled[0]  # nothing timed yet
    assert ctl.step_time.modelled_s == pytest.approx(sum(modelled))
    ctl.begin_mini_batch([1.0], [tokens], seconds=1.25 * sum(modelled))
    assert ctl.step_time.value == pytest.approx(1.25)
    assert ctl.predicted_step_seconds(plans[0], tokens) == pytest.approx(1.25 * modelled[0])
    assert ctl.metrics()["hilore/plan/step_time_scale"] == pytest.approx(1.25)
