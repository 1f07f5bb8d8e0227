"""Host synchronisations on the hot path, counted on the CPU.

On a GPU every read of device data by the host (`.item()`, `float(t)`, `if t.any():`, `.tolist()`,
a boolean-mask index, whose size is the mask's count) waits for the device to finish all queued
work. Two places must not add any:

  - a training micro-batch's `forward_step` (its forward, then its backward): HiLoRe's engine and
    session make exactly the reads stock verl's makes on the same micro-batch (verl reads its loss
    metrics); the exact exposure is handed on unread and read with the mini-batch's metrics;
  - the optimizer-step snapshot: its copies are queued on a side stream when the mini-batch starts
    (parameters and optimizer state change only inside the optimizer step), the step waits for them
    on the device, and the host waits only when a fault restores them.

Reads are counted by patching torch.Tensor's conversions; the side stream through a stand-in for
the device module (`staged_copy.device_module`), so both run without a GPU.

The engines here run verl's ordinary layout (`shared_prompt: False`): the shared layout reads each
micro-batch's token ids and response lengths on the host by design (one copy per forward, docs/design.md).
"""

from __future__ import annotations

import contextlib
import sys
import threading

import pytest
import torch

from hilore_verl.tiny.models import save_tiny_model
from hilore_verl.tiny.workload import make_grpo_batch, shard
from tests.harness.distributed import run_on_ranks
from tests.harness.profiles import gpu_like_profile
from tests.integration.test_hilore_engine_on_cpu import WORKLOAD

READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "nonzero", "cpu", "numpy",
         "masked_select")
RUNTIME = ("/hilore_verl/runtime/", "/hilore_verl/kernels/")  # the codecs', inside the model's forward


def _caller_is_runtime() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if any(part in frame.f_code.co_filename for part in RUNTIME):
            return True
        frame = frame.f_back
    return False


@contextlib.contextmanager
def counted_reads(log: list):
    """Every host read of tensor data while inside, appended to `log` as (name, from the runtime)."""
    real = {name: getattr(torch.Tensor, name) for name in READS}
    real_getitem, real_nonzero = torch.Tensor.__getitem__, torch.nonzero

    def counting(name):
        def read(self, *args, **kwargs):
            log.append((name, _caller_is_runtime()))
            return real[name](self, *args, **kwargs)
        return read

    def getitem(self, index):
        parts = index if isinstance(index, tuple) else (index,)
        if any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts):
            log.append(("boolean_index", _caller_is_runtime()))
        return real_getitem(self, index)

    def nonzero(*args, **kwargs):
        log.append(("nonzero", _caller_is_runtime()))
        return real_nonzero(*args, **kwargs)

    for name in READS:
        setattr(torch.Tensor, name, counting(name))
    torch.Tensor.__getitem__, torch.nonzero = getitem, nonzero
    try:
        yield log
    finally:
        for name, fn in real.items():
            setattr(torch.Tensor, name, fn)
        torch.Tensor.__getitem__, torch.nonzero = real_getitem, real_nonzero


def _count_forward_steps(engine) -> list[list]:
    """The reads of each training forward_step verl's loop calls on `engine` (one list per micro-batch)."""
    counts, real = [], engine.forward_step

    def forward_step(micro_batch, loss_function, forward_only):
        if forward_only or not torch.is_grad_enabled():
            return real(micro_batch, loss_function, forward_only)
        log = []
        with counted_reads(log):
            out = real(micro_batch, loss_function, forward_only)
        counts.append(log)
        return out

    engine.forward_step = forward_step
    return counts


def _forward_reads(rank, world_size, model_dir, batch, hilore):
    import hilore_verl.training.calibration as calibration
    from hilore_verl.integration.tools.verl_engine import actor_config, build_fsdp_engine, ppo_loss_fn, to_engine_batch
    from hilore_verl.integration.actor.engine import HiLoReFSDPEngine

    calibration.profile = gpu_like_profile(calibration.profile)
    config = actor_config()
    td = to_engine_batch(shard(batch, rank, world_size), global_batch_size=batch["input_ids"].shape[0])
    stock = build_fsdp_engine(model_dir, lr=1e-2, gradient_checkpointing=True)
    managed = build_fsdp_engine(model_dir, lr=1e-2, gradient_checkpointing=True, engine_cls=HiLoReFSDPEngine,
                                actor_config=config, hilore={"enable": True, "shared_prompt": False, "min_bytes": 1024,
                                                             "skip_zero_exposure": False, **hilore})
    result = {}  # per forward step: the skip (one read per mini-batch, in train_batch) would change the count
    for name, engine in (("stock", stock), ("hilore", managed)):
        counts, metrics = _count_forward_steps(engine), []
        for _ in range(2):  # the first HiLoRe step also profiles and calibrates (its own passes, not counted)
            with engine.train_mode():
                out = engine.train_batch(td.clone(), loss_function=ppo_loss_fn(config))
            metrics.append({k: v for k, v in out["metrics"].items() if k.startswith("hilore/")})
        result[name], result[f"{name}_metrics"] = counts, metrics
    result["modes"] = sorted({m for r in managed.controller.history for m in r.plan.values()})
    return result


@pytest.mark.parametrize("hilore", [{"risk_budget": 0.0}, {"risk_budget": 0.5, "audit_every": 1}],
                         ids=["keep_recompute", "compressed_audited"])
def test_a_training_forward_step_reads_nothing_more_than_stock_verl(tmp_path, hilore):
    model_dir = save_tiny_model(tmp_path / "tiny-qwen2", "qwen2", seed=0)
    (r,) = run_on_ranks(_forward_reads, 1, args=(model_dir, make_grpo_batch(WORKLOAD, seed=3), hilore))
    assert len(r["stock"]) == len(r["hilore"]) >= 4, r  # 2 steps x 2 or more micro-batches
    assert r["stock"][0], "stock verl reads its loss metrics: the count is measured, not assumed zero"
    for stock, managed in zip(r["stock"], r["hilore"]):
        assert not any(runtime for _, runtime in stock)
        # the engine, the session, the controller and the exposure add no read
        assert sorted(n for n, runtime in managed if not runtime) == sorted(n for n, _ in stock), (managed, stock)
        if not hilore["risk_budget"]:  # keep / recompute plans: the runtime reads nothing either
            assert not any(runtime for _, runtime in managed), managed
    if hilore["risk_budget"]:
        assert set(r["modes"]) - {"keep", "recompute"}, r["modes"]  # compressed units ran
        assert all("hilore/plan/risk_spent" in m for m in r["hilore_metrics"]), r["hilore_metrics"]


def test_the_controller_reads_a_mini_batch_of_exact_exposures_at_once_as_floats_would_record_them():
    """Floats are recorded at once; tensors and functions wait for metrics(), which reads every tensor
    in one transfer and records the same risk a float of the same value does."""
    from hilore_verl.planner import BudgetConfig, Controller, CostTable, UnitProfile
    from hilore_verl.planner.controller import PlanRecord
    from hilore_verl.loss.risk import RiskModel
    from hilore_verl.runtime import KEEP, UnitPlan

    units = [UnitProfile(f"layers.0.u{i}", 1e6, 1e5, 1e-3) for i in range(3)]
    risk = RiskModel(sensitivity={u.name: 0.5 + i for i, u in enumerate(units)}, grad_scale=1.0)
    ctl = Controller(None, CostTable(units, tokens=256, unmanaged_bytes=0.0), risk, BudgetConfig("gc_ratio", 2.0))
    plan = {"layers.0.u0": UnitPlan.parse("int8"), "layers.0.u1": UnitPlan.parse("int4"), "layers.0.u2": KEEP}
    values = [0.25, torch.tensor(1.5), lambda: torch.tensor(3.0, dtype=torch.float64), torch.tensor(0.1)]
    ctl.begin_mini_batch([1.0], [256])
    for value in values:
        ctl.history.append(PlanRecord(dict(plan), 0.0, 0.0, 0.0, 0.0))
        ctl.after_forward(len(ctl.history) - 1, value)
    assert ctl.history[0].spent_risk is not None and all(r.spent_risk is None for r in ctl.history[1:])
    log = []
    with counted_reads(log):
        metrics = ctl.metrics()
    assert [name for name, _ in log] == ["tolist"], log  # one read for the three unread values
    expected = [risk.predict(ctl.runtime_plan(plan), v) for v in (0.25, 1.5, 3.0, float(torch.tensor(0.1)))]
    assert [r.spent_risk for r in ctl.history] == expected
    assert metrics["hilore/plan/risk_spent"] == expected[-1]


# ---------------------------------------------------------------------- the optimizer-step snapshot
class _FakeStream:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def wait_stream(self, other):
        self.log.append(("device_wait_stream", self.name, other.name))

    def wait_event(self, event):
        self.log.append(("device_wait_event", self.name))

    def synchronize(self):
        self.log.append(("host_wait", "stream", threading.current_thread().name))


class _FakeEvent:
    def __init__(self, log):
        self.log = log

    def record(self, stream):
        self.log.append(("record", stream.name))

    def wait(self, stream):
        self.log.append(("device_wait_event", stream.name))

    def synchronize(self):
        self.log.append(("host_wait", "event", threading.current_thread().name))


class FakeDevice:
    """A stand-in for torch.cuda: a compute stream, side streams and events that log what is asked of
    them; the copies themselves run inline on the CPU."""

    def __init__(self, log):
        self.log, self.compute = log, _FakeStream(log, "compute")

    def Stream(self, device=None):  # noqa: N802 (torch.cuda's name)
        return _FakeStream(self.log, "side")

    def current_stream(self, device=None):
        return self.compute

    @contextlib.contextmanager
    def stream(self, stream):
        self.log.append(("copy_on", stream.name))
        yield

    def Event(self):  # noqa: N802
        return _FakeEvent(self.log)

    def synchronize(self, device=None):
        self.log.append(("host_wait", "device", threading.current_thread().name))


@pytest.fixture
def fake_device(monkeypatch):
    import hilore_verl.training.staged_copy as staged_copy

    log = []
    device = FakeDevice(log)
    monkeypatch.setattr(staged_copy, "device_module", lambda d: device)
    monkeypatch.setattr(torch.cuda, "synchronize", device.synchronize)
    return log


def test_the_snapshot_waits_on_the_device_only_and_restores_exactly(fake_device):
    from hilore_verl.training.snapshots import StepSnapshot

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def grads():
        model.zero_grad()
        model(torch.randn(5, 8)).square().sum().backward()

    grads()
    optimizer.step()  # Adam's state exists
    snapshot = StepSnapshot(model, optimizer)
    for _ in range(2):  # a step that succeeds, then one that fails after updating everything
        fake_device.clear()
        snapshot.take()
        before = ({n: p.detach().clone() for n, p in model.named_parameters()},
                  {id(p): {k: v.clone() for k, v in s.items()} for p, s in optimizer.state.items()})
        grads()  # the mini-batch's passes
        snapshot.before_step()
        copies = sum(1 for entry in fake_device if entry[0] == "copy_on")
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
        optimizer.step()
        assert copies == 4 + 4 * 3 and fake_device.count(("copy_on", "side")) == copies  # 4 tensors; step, 2 moments
        # the side stream waits for the work that wrote them: an event recorded on the compute stream at take()
        assert fake_device.index(("record", "compute")) < fake_device.index(("device_wait_event", "side"))
        assert ("device_wait_event", "compute") in fake_device  # the step waits for the copies, on the device
        assert not _main_thread_waits(fake_device), fake_device  # the success path: the worker's waits only
    snapshot.restore()  # joins the worker, which waited for its copies on the host
    assert not _main_thread_waits(fake_device), fake_device
    assert all(torch.equal(p, before[0][n]) for n, p in model.named_parameters())
    state = {id(p): s for p, s in optimizer.state.items()}
    assert all(torch.equal(state[i][k], v) for i, s in before[1].items() for k, v in s.items())


def _main_thread_waits(log) -> list:
    """Host waits on the device asked by the training thread (the staged copy's worker waits for its own)."""
    return [e for e in log if e[0] == "host_wait" and e[2] == threading.main_thread().name]


def _snapshot_timeline(rank, world_size, model_dir, batch):
    import hilore_verl.training.staged_copy as staged_copy
    from hilore_verl.integration.tools.verl_engine import actor_config, build_fsdp_engine, ppo_loss_fn, to_engine_batch
    from hilore_verl.integration.actor.engine import HiLoReFSDPEngine

    log = []
    device = FakeDevice(log)
    staged_copy.device_module = lambda d: device
    torch.cuda.synchronize = device.synchronize
    real_start = staged_copy.StagedCopy.start
    staged_copy.StagedCopy.start = lambda self, pairs: log.append(("copy",)) or real_start(self, pairs)
    config = actor_config()
    td = to_engine_batch(shard(batch, rank, world_size), global_batch_size=batch["input_ids"].shape[0])

    def engine():
        e = build_fsdp_engine(model_dir, lr=1e-2, clip_grad=0.5, engine_cls=HiLoReFSDPEngine, actor_config=config,
                              hilore={"enable": True, "shared_prompt": False, "risk_budget": 0.0, "min_bytes": 1024, "oom_retries": 1})
        real_step = e.optimizer_step

        def optimizer_step():
            log.append(("step_in",))
            try:
                return real_step()
            finally:
                log.append(("step_out",))

        e.optimizer_step = optimizer_step
        return e

    def step(e):
        with e.train_mode():
            return e.train_batch(td.clone(), loss_function=ppo_loss_fn(config))

    reference, faulty = engine(), engine()
    for e in (reference, faulty):
        step(e)  # Adam's state exists from here on
    real, fired = faulty.optimizer.step, []

    def fails_once(*args, **kwargs):
        out = real(*args, **kwargs)  # every parameter and moment updated, then the fault
        if not fired:
            fired.append(1)
            raise torch.OutOfMemoryError("injected after the update")
        return out

    faulty.optimizer.step = fails_once
    timelines = {}
    for name, e in (("reference", reference), ("retried", faulty)):
        log.clear()
        out = step(e)
        # the training thread's (the staged copy's worker waits on the host for its own copies)
        timelines[name] = [("host_wait:" + entry[1] if entry[0] == "host_wait" else
                            "step_wait" if entry == ("device_wait_event", "compute") else entry[0])
                           for entry in log if entry[0] != "host_wait" or entry[2] == threading.main_thread().name]
        timelines[f"{name}_metrics"] = (out["metrics"]["hilore/oom_retries"], out["metrics"]["grad_norm"])
    same = all(torch.equal(a.to_local(), b.to_local())
               for a, b in zip(reference.module.parameters(), faulty.module.parameters()))
    return timelines, same


def test_the_snapshot_is_taken_before_the_step_and_a_retried_step_is_exact(tmp_path):
    model_dir = save_tiny_model(tmp_path / "tiny-qwen2", "qwen2", seed=0)
    (result,) = run_on_ranks(_snapshot_timeline, 1, args=(model_dir, make_grpo_batch(WORKLOAD, seed=3)))
    timelines, same = result
    for name in ("reference", "retried"):
        line = timelines[name]
        first_step = line.index("step_in")
        assert "copy" in line[:first_step] and "copy" not in line[first_step:], line  # outside the step's window
        steps = line.count("step_in")
        assert steps == (1 if name == "reference" else 2) and line.count("step_wait") == steps, line
        assert not [e for e in line if e.startswith("host_wait")], line  # the retry's restore joins the worker
    retries, grad_norm = timelines["retried_metrics"]
    assert retries == [1.0] and grad_norm == timelines["reference_metrics"][1]  # the same grad norm
    assert same  # bitwise the uninterrupted step
