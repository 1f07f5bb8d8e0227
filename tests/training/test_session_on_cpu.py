"""The session (session.py) without verl: a plain PyTorch model, its own passes and optimizer.

What verl's engine delegates to the session is checked here on its own: probing once, exact
keep / recompute updates, out-of-memory retries that give the uninterrupted update, a failure
that leaves the session and the model as before, a restored state that plans without probing,
and measured numbers averaged over two gloo ranks field by field.
"""

import dataclasses
import mmap

import pytest
import torch

import hilore_verl
import hilore_verl.training.calibration as calibration
from hilore_verl.training.config import HiLoReConfig
from hilore_verl.planner.costs import measured_values
from hilore_verl.training.snapshots import StepSnapshot, reset_after_failure
from hilore_verl.training.session import Session
from hilore_verl.tiny.models import build_tiny_model
from hilore_verl.tiny.workload import GRPOWorkload, make_grpo_batch, response_log_probs
from tests.harness.distributed import run_on_ranks
from tests.harness.profiles import gpu_like_profile

WORKLOAD = GRPOWorkload(num_groups=2, group_size=4, max_prompt_len=16, max_response_len=40)


def _micro_batches(seed: int) -> list[dict]:
    """Two micro-batches of four sequences, with loss coefficients c = advantage / response tokens."""
    batch = make_grpo_batch(WORKLOAD, seed=seed)
    mask = batch["response_mask"].float()
    batch["c"] = batch["advantages"] * mask / mask.sum()
    per_sequence = {k: v for k, v in batch.items() if v.shape[0] == mask.shape[0]}  # not the per-group flags
    return [{k: v[i:i + 4] for k, v in per_sequence.items()} for i in (0, 4)]


class PlainPasses:
    """host.Passes for a plain model: the loss is -sum_t c_t log p_t."""

    element_size = 4
    has_coefficients = True
    row_attention = False  # padded rows

    def __init__(self, model, runtime, optimizer):
        self.model, self.runtime, self.optimizer = model, runtime, optimizer

    def lengths(self, batch):
        return batch["attention_mask"].sum(-1).tolist()

    def layer_tokens(self, batch):
        return int(sum(self.lengths(batch)))

    def head_rows(self, batch):
        return None

    def select(self, batch, index):
        return {k: v[index] for k, v in batch.items()}

    def train_pass(self, batch):
        self.model.zero_grad(set_to_none=True)
        (-(response_log_probs(self.model, batch) * batch["c"]).sum()).backward()

    def surrogate_gradient(self, plan, batch, c):
        self.runtime.set_plan(plan)
        self.model.zero_grad(set_to_none=True)
        (response_log_probs(self.model, batch) * c).sum().backward()
        return [p.grad for p in self.model.parameters()]

    def coefficients(self, batch):
        return batch["c"]

    def exposure_l2(self, batch, log_prob=None):
        return float(batch["c"].norm())

    def zero_grad(self):
        self.model.zero_grad(set_to_none=True)

    def recover(self):
        reset_after_failure(self.model, self.optimizer)

    def empty_cache(self):
        pass

    def static_bytes(self):
        return float(sum(p.numel() * 16 for p in self.model.parameters()))

    def gradient_bytes(self):
        return float(sum(p.numel() * 4 for p in self.model.parameters()))

    def free_bytes(self):
        raise AssertionError("only a budget of mode auto asks for free memory")


def _trainer(managed: bool, **config):
    """A model, its optimizer and a `train(micro_batches)` that runs one mini-batch (through a
    session when `managed`) and returns its metrics."""
    model = build_tiny_model("qwen2", seed=0).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    session = None
    min_bytes = config.pop("min_bytes", 1024)
    if managed:
        runtime = hilore_verl.attach(model, hilore_verl.RuntimeConfig(min_bytes=min_bytes))
        session = Session(HiLoReConfig(enable=True, min_bytes=min_bytes, **config), runtime,
                          PlainPasses(model, runtime, optimizer))
    snapshot = StepSnapshot(model, optimizer)

    def step(micro_batches):
        optimizer.zero_grad(set_to_none=True)
        for mb in micro_batches:
            index = session.before_forward() if session else None
            loss = -(response_log_probs(model, mb) * mb["c"]).sum()
            if session and session.records_risk():
                session.after_forward(index, mb["c"].norm())  # unread: the controller reads it with the metrics
            loss.backward()
        if session:
            return session.optimizer_step(optimizer.step, snapshot.take())
        optimizer.step()

    def train(micro_batches):
        if session is None:
            step(micro_batches)
            return {}
        _, metrics = session.train(micro_batches, lambda: step(micro_batches),
                                   [int(mb["attention_mask"].sum()) for mb in micro_batches])
        return metrics

    return model, optimizer, session, train


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


def _oom_once_in(model, forward_index: int):
    """Raise an out-of-memory error in the `forward_index`-th training forward of layer 1's MLP."""
    calls = []

    def hook(module, args, output):
        if not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1:
            return output  # recomputes inside backward are not training forwards
        calls.append(1)
        if len(calls) - 1 == forward_index:
            raise torch.OutOfMemoryError("injected")
        return output

    return model.model.layers[1].mlp.register_forward_hook(hook)


@pytest.fixture
def counted_profiles(monkeypatch):
    calls = []
    real = calibration.profile
    monkeypatch.setattr(calibration, "profile", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def test_keep_and_recompute_plans_update_bitwise_as_plain_pytorch(counted_profiles):
    model, _, session, train = _trainer(True, risk_budget=0.0)  # no risk model: keep / recompute only
    plain, _, _, plain_train = _trainer(False)
    for step in range(3):
        metrics = train(_micro_batches(step))
        plain_train(_micro_batches(step))
        assert metrics["hilore/oom_retries"] == 0.0 and "hilore/plan/predicted_peak_gib" in metrics
    assert counted_profiles == [1] and session.step == 3
    # steps 2 and 3 were timed (not the first, which profiled): the second's time reached the step-time scale
    # at the third's start, as measured / modelled for the plans it ran (planner/step_time.py)
    assert len(session.controller.step_time.ratios) == 1 and session.controller.step_time.ratios[0] > 0
    assert metrics["hilore/plan/step_time_scale"] == session.controller.step_time.ratios[0]
    modes = {m for record in session.controller.history for m in record.plan.values()}
    assert modes == {"keep", "recompute"}, modes  # a mix: neither GC's plan nor no GC's
    assert all(torch.equal(a, b) for a, b in zip(_params(model), _params(plain)))


def test_an_out_of_memory_error_retries_to_the_uninterrupted_update():
    model, _, session, train = _trainer(True, risk_budget=0.0)
    reference, _, _, reference_train = _trainer(True, risk_budget=0.0)
    for trainer in (train, reference_train):
        trainer(_micro_batches(0))
    handle = _oom_once_in(model, 1)  # the second micro-batch's forward
    try:
        metrics = train(_micro_batches(1))
    finally:
        handle.remove()
    reference_train(_micro_batches(1))
    assert metrics["hilore/oom_retries"] == 1.0 and session.step == 2
    assert session.controller.memory_factor == pytest.approx(0.9)  # later plans are 10% tighter
    assert all(torch.equal(a, b) for a, b in zip(_params(model), _params(reference)))


def test_a_failed_step_leaves_the_session_and_the_model_as_before():
    model, optimizer, session, train = _trainer(True, risk_budget=0.0, oom_retries=0)
    train(_micro_batches(0))
    before, moments = _params(model), {id(p): s["exp_avg"].clone() for p, s in optimizer.state.items()}
    handle = _oom_once_in(model, 0)
    with pytest.raises(torch.OutOfMemoryError):
        train(_micro_batches(1))
    handle.remove()
    assert session.step == 1 and session.retry_mode is None
    assert all(torch.equal(a, b) for a, b in zip(_params(model), before))
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(s["exp_avg"], moments[id(p)]) for p, s in optimizer.state.items())
    assert train(_micro_batches(1))["hilore/oom_retries"] == 0.0  # and it trains on


def test_a_fault_in_the_optimizer_step_is_undone_from_the_snapshot():
    model, optimizer, session, train = _trainer(True, risk_budget=0.0)
    train(_micro_batches(0))
    before = _params(model)
    real = optimizer.step

    def fails(*args, **kwargs):
        real(*args, **kwargs)  # parameters and moments updated, then the fault
        raise ValueError("injected after the update")

    optimizer.step = fails
    with pytest.raises(ValueError, match="injected"):
        train(_micro_batches(1))
    del optimizer.step
    assert session.step == 1 and all(torch.equal(a, b) for a, b in zip(_params(model), before))


def test_an_out_of_memory_error_in_the_optimizer_step_runs_the_mini_batch_again():
    model, optimizer, session, train = _trainer(True, risk_budget=0.0)
    reference, _, _, reference_train = _trainer(True, risk_budget=0.0)
    for trainer in (train, reference_train):
        trainer(_micro_batches(0))
    real, calls = optimizer.step, []

    def fails_once(*args, **kwargs):
        real(*args, **kwargs)  # parameters and moments updated, then the fault
        calls.append(1)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("injected after the update")

    optimizer.step = fails_once
    metrics = train(_micro_batches(1))
    del optimizer.step
    reference_train(_micro_batches(1))
    assert calls == [1, 1] and metrics["hilore/oom_retries"] == 1.0 and session.step == 2
    assert all(torch.equal(a, b) for a, b in zip(_params(model), _params(reference)))


def test_a_restored_state_plans_without_probing(counted_profiles):
    _, _, first, train = _trainer(True, risk_budget=0.5, audit_every=1)
    metrics = train(_micro_batches(0))
    assert "hilore/audit/cosine" in metrics  # calibrated and audited
    state = first.state_dict()
    _, _, resumed, resumed_train = _trainer(True, risk_budget=0.5, audit_every=1000)  # no audit rescales it
    resumed.restore(state)
    resumed_train(_micro_batches(1))
    assert counted_profiles == [1]
    assert resumed.controller.state_dict()["costs"] == state["costs"]
    assert resumed.controller.risk.sensitivity == pytest.approx(state["risk"]["sensitivity"])


def _averaged(rank, world_size):
    from hilore_verl.integration.actor.collectives import DataParallel

    model = build_tiny_model("qwen2", seed=0).train()
    runtime = hilore_verl.attach(model, hilore_verl.RuntimeConfig(min_bytes=1024))
    batch = _micro_batches(0)[0]
    costs = calibration.profile(runtime, lambda: PlainPasses(model, runtime, None).train_pass(batch), 100)
    # each rank measured different numbers: rank r's are (r + 1) times a common table
    values = [v * (rank + 1) for v in measured_values(costs)]
    calibration.set_measured_values(costs, values)
    costs.tokens = 100 * (rank + 1)
    calibration.average_over_ranks(DataParallel(None, 30), costs, None)
    return values, measured_values(costs), costs.tokens, [f.name for f in dataclasses.fields(costs.units[0])]


def test_ranks_average_every_measured_field():
    (ones, avg0, tokens0, fields), (twos, avg1, tokens1, _) = run_on_ranks(_averaged, 2)
    assert avg0 == avg1 and tokens0 == tokens1 == 150
    assert avg0 == pytest.approx([(a + b) / 2 for a, b in zip(ones, twos)])
    assert {"saved_bytes", "held_bytes", "forward_s", "saved_quadratic"} <= set(fields)


class _MeasuredAt:
    """A peak meter reading `ratio` x the largest peak the controller predicted for the mini-batch (a memory
    model that under-predicts by 20% at ratio 1.2). Ratio None: fixed at the first read, so that the peak
    is over the budget whatever slack the plan's discrete choices left under it."""

    available, noise_bytes = True, 0.0

    def __init__(self, ratio: float):
        self.ratio, self.session, self.first = ratio, None, 0

    def start(self):
        self.first = len(self.session.controller.history)  # plans made from here on are this mini-batch's

    def read(self, static_bytes):
        predicted = max(r.predicted_peak for r in self.session.controller.history[self.first:])
        if self.ratio is None:  # the first read: 5% over the budget, and at least 25% over the prediction
            ctl = self.session.controller
            budget = ctl.memory_budget_at(max(row for _, _, row in ctl._micro))
            self.ratio = max(1.25, 1.05 * budget / predicted)
        return self.ratio * predicted


def test_a_memory_model_that_under_predicts_past_the_budget_is_corrected_by_the_measured_peak():
    """The measured peak over the budget (by 5%, and at least 1.25x the prediction): later plans are made so
    that that ratio times their prediction fits the budget; once measured peaks stay under the prediction
    (three mini-batches in a row), the factor returns to 1. (At 1.5x GC's predicted peak, so that GC's plan,
    at the same ratio over its prediction, still fits, while the plan chosen at 1.5x does not.)"""
    from hilore_verl.planner import BudgetConfig

    _, _, session, train = _trainer(True, risk_budget=0.0, budget=BudgetConfig("gc_ratio", 1.5))
    meter = session.peak_meter = _MeasuredAt(None)
    meter.session = session
    train(_micro_batches(0))  # the first mini-batch profiles: not fed back
    ctl = session.controller
    assert ctl.peaks.factor == 1.0 and ctl.peaks.measured is None
    train(_micro_batches(1))
    ratio = meter.ratio
    assert 1.25 <= ratio < 1.45  # the setup: GC's plan, `ratio` over its prediction, fits 1.5x
    measured, predicted = ctl.peaks.measured
    budget = ctl.memory_budget_at(max(row for _, _, row in ctl._micro))
    assert measured == pytest.approx(ratio * predicted) and measured > budget  # over the budget
    assert ctl.peaks.factor == pytest.approx(1 / ratio)
    for seed in (2, 3):
        metrics = train(_micro_batches(seed))
        measured, _ = ctl.peaks.measured
        assert measured <= ctl.memory_budget_at(max(row for _, _, row in ctl._micro)) * (1 + 1e-9)
        assert metrics["hilore/memory/peak_factor"] == pytest.approx(1 / ratio)  # held while the error holds
    meter.ratio = 1.0  # the model predicts the peak: from the third fit in a row on, halfway back each time
    factors = []
    for seed in range(4, 17):
        train(_micro_batches(seed))
        factors.append(ctl.peaks.factor)
    assert factors[:2] == [pytest.approx(1 / ratio)] * 2
    assert factors[2] == pytest.approx(1 - 0.5 * (1 - 1 / ratio)) and all(b >= a for a, b in zip(factors, factors[1:]))
    assert factors[-1] == 1.0


def test_a_retried_mini_batch_feeds_no_measured_peak_back():
    model, _, session, train = _trainer(True, risk_budget=0.0)
    meter = session.peak_meter = _MeasuredAt(3.0)
    meter.session = session
    train(_micro_batches(0))
    handle = _oom_once_in(model, 0)
    try:
        train(_micro_batches(1))
    finally:
        handle.remove()
    assert session.controller.peaks.factor == 1.0 and session.controller.peaks.measured is None
    assert session.controller.memory_factor == pytest.approx(0.9)


def test_the_cpu_peak_meter_sees_an_allocation_made_after_its_start():
    from hilore_verl.measure.peak_memory import PeakMeter

    meter = PeakMeter(cuda=False)
    assert meter.available, meter.why_not
    meter.start()
    block = mmap.mmap(-1, 64 * 2**20)  # 64 MiB, every page written, no malloc in between
    block[::mmap.PAGESIZE] = b"\x01" * (64 * 2**20 // mmap.PAGESIZE)
    block.close()
    peak = meter.read(static_bytes=1000.0)
    assert 1000.0 + 60 * 2**20 <= peak <= 1000.0 + 512 * 2**20


def test_a_cpu_peak_meter_whose_mark_does_not_rise_says_why_and_is_not_used(monkeypatch):
    """A kernel that accepts the reset but keeps no exact high-water mark: the meter is unavailable (the
    session then plans without the feedback and logs the reason) rather than reading every peak low."""
    from hilore_verl.measure import host_memory
    from hilore_verl.measure.peak_memory import PeakMeter

    mark = []  # set to the resident size by the reset, and never raised
    monkeypatch.setattr(PeakMeter, "reset_host_peak", staticmethod(lambda: mark.append(host_memory.resident_bytes())))
    monkeypatch.setattr(host_memory, "peak_resident_bytes", lambda: mark[-1])
    meter = PeakMeter(cuda=False)
    assert not meter.available and "high-water mark rose by" in meter.why_not
    meter.start()
    assert meter.read(static_bytes=1000.0) is None


def test_an_overshoot_within_the_meters_noise_is_not_acted_on():
    from hilore_verl.planner import BudgetConfig

    _, _, session, train = _trainer(True, risk_budget=0.0, budget=BudgetConfig("gc_ratio", 1.5))
    meter = session.peak_meter = _MeasuredAt(1.2)
    meter.session, meter.noise_bytes = session, 1e12  # far more than the model's 20% on this model
    for seed in range(3):
        train(_micro_batches(seed))
    measured, _ = session.controller.peaks.measured
    assert measured > session.controller.memory_budget_at(max(row for _, _, row in session.controller._micro))
    assert session.controller.peaks.factor == 1.0


def _without_loss_term(micro_batches: list[dict]) -> list[dict]:
    """The micro-batches with every coefficient zero (groups whose responses all share one reward)."""
    return [{**mb, "c": torch.zeros_like(mb["c"])} for mb in micro_batches]


def test_a_first_mini_batch_without_exposure_plans_exactly_then_calibrates_at_the_first_with_one(caplog, monkeypatch):
    """What a GRPO run meets in its first steps: no loss term anywhere. No lossy unit can be priced, so the
    plans are exact (bitwise plain PyTorch) and no audit runs; the first mini-batch with a loss term
    calibrates (said in the log), and plans may compress from then on."""
    monkeypatch.setattr(calibration, "profile", gpu_like_profile(calibration.profile))  # compressing pays
    model, _, session, train = _trainer(True, risk_budget=0.5, audit_every=1)
    plain, _, _, plain_train = _trainer(False)
    for seed in (0, 1):  # two mini-batches without exposure
        metrics = train(_without_loss_term(_micro_batches(seed)))
        plain_train(_without_loss_term(_micro_batches(seed)))
        assert metrics["hilore/risk_calibrated"] == 0.0 and "hilore/audit/cosine" not in metrics
        assert all(p.exact for record in session.controller.history for p in record.plan.values())
    assert all(torch.equal(a, b) for a, b in zip(_params(model), _params(plain)))
    assert "the risk model is not calibrated" in caplog.text
    metrics = train(_micro_batches(2))
    assert "risk model calibrated at step 3" in caplog.text
    assert metrics["hilore/risk_calibrated"] == 1.0 and "hilore/audit/cosine" in metrics
    risk = session.controller.risk
    assert risk.calibrated and set(risk.sensitivity) == {u.name for u in session.runtime.units}
    assert session.controller.audit.risk is risk  # the audit re-scales the model the plans use
    lossy = {p.fmt for r in session.controller.history[-2:] for p in r.plan.values() if not p.exact}
    assert lossy, "a calibrated model with risk budget 0.5 compresses on this model"


def test_probes_that_compress_nothing_leave_plans_exact_and_are_not_rerun_at_every_step(caplog, monkeypatch):
    """Probes whose saved tensors are all below `min_bytes` compress nothing and measure no deviation: the
    risk model stays uncalibrated, the log says why, the plans stay exact, and the calibration passes run
    again only at a mini-batch whose probes may hold twice the tokens (not at every step)."""
    tries = []
    measure = calibration._calibrate
    monkeypatch.setattr(calibration, "_calibrate", lambda *a: tries.append(a[-1]) or measure(*a))
    _, _, session, train = _trainer(True, risk_budget=0.5, min_bytes=2**40)
    for seed in range(3):
        assert train(_micro_batches(seed))["hilore/risk_calibrated"] == 0.0
    assert len(tries) == 1 and "measured no gradient deviation" in caplog.text
    assert session._calibration_floor == 2 * tries[0]  # one rank: the ranks' bound is this rank's
    assert all(p.exact for record in session.controller.history for p in record.plan.values())
    session._calibration_floor = tries[0]  # as if this mini-batch's probes could hold twice the last ones
    train(_micro_batches(3))
    assert len(tries) == 2 and not session.controller.risk.calibrated


def test_an_uncalibrated_state_from_a_checkpoint_calibrates_after_resuming(caplog):
    _, _, first, train = _trainer(True, risk_budget=0.5)
    train(_without_loss_term(_micro_batches(0)))
    state = first.state_dict()
    assert state["risk"]["sensitivity"] == {}
    _, _, resumed, resumed_train = _trainer(True, risk_budget=0.5)
    resumed.restore(state)
    assert resumed_train(_micro_batches(1))["hilore/risk_calibrated"] == 1.0
    assert "resumed from the checkpoint" in caplog.text and "risk model calibrated at step 1" in caplog.text


def _exposure_on_one_rank(rank, world_size):
    """Step 1: no exposure on any rank; step 2: exposure on rank 1 only (rank 0's micro-batches all
    zero-advantage, as the skip's filler micro-batches are); step 3: both."""
    from hilore_verl.integration.actor.collectives import DataParallel

    model = build_tiny_model("qwen2", seed=0).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    runtime = hilore_verl.attach(model, hilore_verl.RuntimeConfig(min_bytes=1024))
    passes = PlainPasses(model, runtime, optimizer)
    session = Session(HiLoReConfig(enable=True, min_bytes=1024, risk_budget=0.5, audit_every=0), runtime, passes,
                      DataParallel(None, 30))

    def step(micro_batches):
        optimizer.zero_grad(set_to_none=True)
        for mb in micro_batches:
            session.before_forward()
            (-(response_log_probs(model, mb) * mb["c"]).sum()).backward()
        return session.optimizer_step(optimizer.step, None)

    calibrated = []
    for seed, zero in ((0, True), (1, rank == 0), (2, False)):
        mbs = _micro_batches(10 * seed + rank)
        mbs = _without_loss_term(mbs) if zero else mbs
        _, metrics = session.train(mbs, lambda: step(mbs), [int(mb["attention_mask"].sum()) for mb in mbs])
        calibrated.append(metrics["hilore/risk_calibrated"])
    risk = session.controller.risk
    return calibrated, dict(risk.sensitivity), risk.grad_scale, [dict(r.plan) for r in session.controller.history]


def test_ranks_calibrate_alike_when_only_one_has_exposure():
    (cal0, sens0, scale0, plans0), (cal1, sens1, scale1, plans1) = run_on_ranks(_exposure_on_one_rank, 2)
    assert cal0 == cal1 == [0.0, 1.0, 1.0]
    assert sens0 == sens1 and scale0 == scale1 and scale0 > 0  # rank 1's figures on both ranks
    assert plans0 == plans1


def test_the_device_peak_meter_reads_the_allocators_reserved_peak(monkeypatch):
    """On CUDA the measured peak is the caching allocator's reserved high-water mark (what a budget of device
    memory is), not the allocated one: fragmentation is part of what runs a job out of memory."""
    from hilore_verl.measure import peak_memory

    calls = []
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a: calls.append("reset"))
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda *a: 7 * 2**30)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: 5 * 2**30)
    meter = peak_memory.PeakMeter(cuda=True)
    meter.start()
    assert calls == ["reset"] and meter.read(static_bytes=1.0) == 7 * 2**30
    assert meter.noise_bytes == peak_memory.DEVICE_NOISE_BYTES
