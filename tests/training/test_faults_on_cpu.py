"""Fault injection into HiLoReFSDPEngine's training step, on 2 gloo ranks, deferred gradient sync on and off.

One engine trains step after step; a reference engine trains the same steps without faults. At each
step one fault is injected on both ranks at one point (a micro-batch's forward or backward, the
gradient reduce-scatter, gradient clipping, the optimizer step), first with no retry allowed, then
with one: the first must raise with the parameters and optimizer state as before the step, the
second must end bitwise equal to the uninterrupted step. Two settings: "exact" (risk budget 0: keep /
recompute plans) and "lossy" (risk budget 0.5: compressed units with stochastic rounding, and
dropout in the model: the retry must draw the same masks and the same rounding).

`python -m tests.training.test_faults_on_cpu` prints the outcome table that docs/design.md shows.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hilore_verl.tiny.models import save_tiny_model
from hilore_verl.tiny.workload import GRPOWorkload, make_grpo_batch, shard
from tests.harness.distributed import run_on_ranks

WORKLOAD = GRPOWorkload(num_groups=2, group_size=4, max_prompt_len=12, max_response_len=24)  # 2 micro-batches/rank
POINTS = ["forward:0", "forward:1", "backward:0", "backward:1", "grad_sync", "clip", "optimizer_step",
          "value_error:0"]  # value_error:i: a ValueError (not out of memory) in micro-batch i's forward
OOM = torch.OutOfMemoryError


class Injected(ValueError):
    """A fault that is not out of memory."""


def _inject(engine, point: str):
    """Arm one fault at `point` for the next train_batch; returns a function that disarms it."""
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as param_group
    import verl.workers.engine.fsdp.transformer_impl as impl

    fired = []

    def fire(kind=OOM):
        if not fired:
            fired.append(1)
            raise kind(f"injected at {point}")

    undo = []
    kind, _, index = point.partition(":")
    if kind in ("forward", "backward", "value_error"):
        calls = []

        def hook(module, args, output):
            if not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1:
                return output  # no-grad passes, and recomputes inside backward, are not micro-batch forwards
            calls.append(1)
            if len(calls) - 1 != int(index or 0):
                return output
            if kind == "backward":
                output.register_hook(lambda grad: fire() or grad)
                return output
            fire(Injected if kind == "value_error" else OOM)

        handle = engine.module.model.layers[1].mlp.register_forward_hook(hook)
        undo.append(handle.remove)
    elif kind == "grad_sync":
        real = param_group.foreach_reduce

        def reduce(*args, **kwargs):
            fire()
            return real(*args, **kwargs)

        param_group.foreach_reduce = reduce
        undo.append(lambda: setattr(param_group, "foreach_reduce", real))
    elif kind == "clip":
        real = impl.fsdp2_clip_grad_norm_

        def clip(*args, **kwargs):
            norm = real(*args, **kwargs)  # gradients are scaled in place by now
            fire()
            return norm

        impl.fsdp2_clip_grad_norm_ = clip
        undo.append(lambda: setattr(impl, "fsdp2_clip_grad_norm_", real))
    elif kind == "optimizer_step":
        real = engine.optimizer.step

        def step(*args, **kwargs):
            out = real(*args, **kwargs)  # every parameter and moment updated, counters advanced
            fire()
            return out

        engine.optimizer.step = step
        undo.append(lambda: engine.optimizer.__dict__.pop("step", None))
    else:
        raise ValueError(point)
    return lambda: [u() for u in undo]


def _state(engine):
    params = {n: p.full_tensor().clone() for n, p in engine.module.named_parameters()}
    steps = sorted({float(s["step"]) for s in engine.optimizer.state.values()})
    return params, steps


def _same(a, b) -> bool:
    return a[1] == b[1] and all(torch.equal(a[0][n], t) for n, t in b[0].items())


SETTINGS = {"exact": {"risk_budget": 0.0},
            # a budget that stays above GC's peak after each retry's 10% tightening, so plans keep compressing
            # and the cost model alone choosing them, so that the reference engine's plans are the faulty one's
            "lossy": {"risk_budget": 0.5, "stochastic_rounding": True, "formats": ["int8", "int4"],
                      "budget": {"mode": "gc_ratio", "value": 2.0}, "measure_baseline": False}}


def _suite(rank, world_size, model_dir, batch, defer, points, setting="exact"):
    import hilore_verl.training.calibration as calibration
    from hilore_verl.integration.tools.verl_engine import actor_config, build_fsdp_engine, ppo_loss_fn, to_engine_batch
    from hilore_verl.integration.actor.engine import HiLoReFSDPEngine
    from tests.harness.profiles import gpu_like_profile

    calibration.profile = gpu_like_profile(calibration.profile)  # plans that do not depend on timing
    config = actor_config()
    loss_fn = ppo_loss_fn(config)
    td = to_engine_batch(shard(batch, rank, world_size), global_batch_size=batch["input_ids"].shape[0])

    def engine():
        return build_fsdp_engine(model_dir, lr=1e-2, clip_grad=0.5, defer_gradient_sync=defer,
                                 engine_cls=HiLoReFSDPEngine, actor_config=config,
                                 hilore={"enable": True, "min_bytes": 1024, "audit_every": 0, **SETTINGS[setting]})

    def step(e):
        torch.manual_seed(1000 + e.session.step)  # dropout: the same draws in both engines at the same step
        with e.train_mode():
            return e.train_batch(td.clone(), loss_function=loss_fn)

    reference, states = engine(), []
    for _ in range(len(points) + 1):
        step(reference)
        states.append(_state(reference))
    del reference
    faulty = engine()
    step(faulty)
    rows = []
    for k, point in enumerate(points, start=1):
        row = {"point": point, "defer_sync": defer, "setting": setting}
        for retries in (0, 1):
            faulty.session.config = dataclasses.replace(faulty.session.config, oom_retries=retries)
            planned = len(faulty.controller.history)
            disarm = _inject(faulty, point)
            try:
                out = step(faulty)
                outcome, metric = "completed", out["metrics"]["hilore/oom_retries"]
            except (OOM, Injected) as err:
                outcome, metric = type(err).__name__, None
            finally:
                disarm()
            if retries == 0:  # did the step that failed compress anything?
                lossy = any(m not in ("keep", "recompute")
                            for record in faulty.controller.history[planned:] for m in record.plan.values())
            state = _state(faulty)
            grads_left = any(p.grad is not None for p in faulty.module.parameters())
            row["lossy_plan"] = lossy
            row[retries] = {"outcome": outcome, "retries_metric": metric, "grads_left": grads_left,
                            "as_before": _same(state, states[k - 1]), "as_uninterrupted": _same(state, states[k])}
        rows.append(row)
    return rows


def _check(rows):
    for row in rows:
        failed, retried = row[0], row[1]
        assert failed["outcome"] != "completed" and failed["as_before"] and not failed["grads_left"], row
        if row["point"].startswith("value_error"):  # not out of memory: never retried, state as before
            assert retried["outcome"] == "Injected" and retried["as_before"], row
        else:
            assert retried["outcome"] == "completed" and retried["retries_metric"] == [1.0], row
            assert retried["as_uninterrupted"], row


def _model(tmp_path, setting):
    dropout = {"attention_dropout": 0.2} if setting == "lossy" else {}
    return save_tiny_model(tmp_path / f"tiny-qwen2-{setting}", "qwen2", seed=0, **dropout)


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("defer", [True, False], ids=["deferred_sync", "sync_each_micro_batch"])
def test_every_fault_point_retries_exactly_or_fails_with_the_state_restored(tmp_path, defer, setting):
    args = (_model(tmp_path, setting), make_grpo_batch(WORKLOAD, seed=3), defer, POINTS, setting)
    ranks = run_on_ranks(_suite, 2, args=args)
    assert ranks[0] == ranks[1]
    _check(ranks[0])
    if setting == "lossy":  # faults hit steps that compress: the later points, once the retries' 10% tightening
        # leaves no exact plan the fastest (the earlier ones run exact plans, retried exactly all the same)
        lossy = [r["point"] for r in ranks[0] if r["lossy_plan"]]
        assert len(lossy) >= 3, [(r["point"], r["lossy_plan"]) for r in ranks[0]]


def _no_snapshot(rank, world_size, model_dir, batch):
    from hilore_verl.integration.tools.verl_engine import actor_config, build_fsdp_engine, ppo_loss_fn, to_engine_batch
    from hilore_verl.integration.actor.engine import HiLoReFSDPEngine
    from hilore_verl.training.snapshots import StepFailed

    config = actor_config()
    td = to_engine_batch(shard(batch, rank, world_size), global_batch_size=batch["input_ids"].shape[0])
    engine = build_fsdp_engine(model_dir, lr=1e-2, engine_cls=HiLoReFSDPEngine, actor_config=config,
                               hilore={"enable": True, "risk_budget": 0.0, "step_snapshot": False})
    disarm = _inject(engine, "optimizer_step")
    try:
        with engine.train_mode():
            engine.train_batch(td, loss_function=ppo_loss_fn(config))
    except StepFailed as err:
        return str(err)
    finally:
        disarm()
    return "no error"


def test_without_a_snapshot_a_fault_in_the_optimizer_step_stops_training(tmp_path):
    model_dir = save_tiny_model(tmp_path / "tiny-qwen2", "qwen2", seed=0)
    for message in run_on_ranks(_no_snapshot, 2, args=(model_dir, make_grpo_batch(WORKLOAD, seed=3))):
        assert "cannot be undone" in message and "checkpoint" in message, message


def _profile_audit_and_auto_budget(rank, world_size, model_dir, batch):
    """Faults in the first step's profiling and in an audit; a budget measured from free memory."""
    import hilore_verl.training.calibration as calibration
    from hilore_verl.integration.tools.verl_engine import actor_config, build_fsdp_engine, ppo_loss_fn, to_engine_batch
    from hilore_verl.integration.actor.engine import HiLoReFSDPEngine
    from tests.harness.profiles import gpu_like_profile

    calibration.profile = gpu_like_profile(calibration.profile)
    config = actor_config()
    td = to_engine_batch(shard(batch, rank, world_size), global_batch_size=batch["input_ids"].shape[0])
    engine = build_fsdp_engine(model_dir, lr=1e-2, engine_cls=HiLoReFSDPEngine, actor_config=config,
                               hilore={"enable": True, "risk_budget": 0.5, "min_bytes": 1024, "audit_every": 1,
                                       "budget": {"mode": "auto", "value": 0}})

    def step():
        with engine.train_mode():
            return engine.train_batch(td.clone(), loss_function=ppo_loss_fn(config))

    before = _state(engine)
    disarm = _inject(engine, "forward:0")  # the first grad-enabled forward is the profiling probe
    try:
        step()
        profile_fault = "no error"
    except OOM:
        profile_fault = "raised"
    finally:
        disarm()
    result = {"profile_fault": profile_fault, "controller_after_fault": engine.controller is not None,
              "step_after_fault": engine.session.step, "unchanged": _same(_state(engine), before),
              "grads_left": any(p.grad is not None for p in engine.module.parameters())}
    out = step()
    result["first_audit"] = "hilore/audit/cosine" in out["metrics"]
    passes = engine.session.passes
    real, calls = passes.surrogate_gradient, []

    def surrogate_fails_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise OOM("injected in the audit")
        return real(*args, **kwargs)

    passes.surrogate_gradient = surrogate_fails_once
    out = step()
    result.update(second_audit="hilore/audit/cosine" in out["metrics"], retries=out["metrics"]["hilore/oom_retries"],
                  step=engine.session.step, budget_gib=engine.controller.memory_budget / 2**30,
                  gc_peak_gib=engine.controller.gc_peak / 2**30)
    return result


def test_faults_in_profiling_and_audit_and_an_auto_budget(tmp_path):
    model_dir = save_tiny_model(tmp_path / "tiny-qwen2", "qwen2", seed=0)
    ranks = run_on_ranks(_profile_audit_and_auto_budget, 2, args=(model_dir, make_grpo_batch(WORKLOAD, seed=3)))
    assert ranks[0] == ranks[1]  # one budget, one plan, one outcome everywhere
    r = ranks[0]
    assert r["profile_fault"] == "raised" and not r["controller_after_fault"] and r["step_after_fault"] == 0
    assert r["unchanged"] and not r["grads_left"]
    assert r["first_audit"] and not r["second_audit"] and r["retries"] == [0.0] and r["step"] == 2
    assert r["budget_gib"] > r["gc_peak_gib"] > 0  # host memory available here dwarfs a tiny model's peak


@pytest.mark.parametrize("staged", [False, True], ids=["inline", "staged"])
@pytest.mark.parametrize("steps_before", [0, 2])
def test_step_snapshot_restores_parameters_and_adam_state(steps_before, staged):
    """Plain module, no ranks: whatever a step changed in parameters and optimizer state (first-step
    state included) is put back bitwise; gradients are not copied (a retry computes them again). Staged:
    the accelerator's path (a worker thread, a ring of two 40-byte slots that every tensor cycles through)."""
    from hilore_verl.training.snapshots import StepSnapshot
    from hilore_verl.training.staged_copy import StagedCopy

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def grads():
        model.zero_grad()
        model(torch.randn(5, 8)).square().sum().backward()

    for _ in range(steps_before):
        grads()
        optimizer.step()
    snapshot = StepSnapshot(model, optimizer, staged=staged, staging=StagedCopy(slot_bytes=40, slots=2))
    for _ in range(2):  # buffers are reused from one step to the next
        snapshot.take()  # when the mini-batch starts, before its passes
        before = ({n: p.detach().clone() for n, p in model.named_parameters()},
                  {id(p): {k: v.clone() for k, v in s.items()} for p, s in optimizer.state.items()})
        nbytes = snapshot.nbytes
        grads()
        snapshot.before_step()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
        optimizer.step()
        clipped = {n: p.grad.clone() for n, p in model.named_parameters()}
        snapshot.restore()
        assert all(torch.equal(p, before[0][n]) for n, p in model.named_parameters())
        assert all(torch.equal(p.grad, clipped[n]) for n, p in model.named_parameters())  # left as they are
        state = {id(p): s for p, s in optimizer.state.items()}
        assert state.keys() == before[1].keys()
        assert all(torch.equal(state[i][k], v) for i, s in before[1].items() for k, v in s.items())
    assert snapshot.nbytes == nbytes
    assert snapshot.staging_bytes == (80 if staged else 0)


@pytest.mark.parametrize("width", [64, 512])
def test_the_step_snapshots_host_bytes_follow_its_formula_and_its_ring_does_not_grow(width):
    """Pageable host bytes: exactly 12 per parameter with fp32 AdamW (parameter, two moments) and 4 per
    parameter tensor (its step counter); the staging ring (pinned on an accelerator) stays SLOTS x SLOT_BYTES
    whatever the model's size."""
    from hilore_verl.training.snapshots import StepSnapshot
    from hilore_verl.training.staged_copy import SLOT_BYTES, SLOTS

    model = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, width)).sum().backward()
    optimizer.step()
    snapshot = StepSnapshot(model, optimizer, staged=True).take()
    snapshot.before_step()
    n = sum(p.numel() for p in model.parameters())
    assert snapshot.nbytes == 12 * n + 4 * len(list(model.parameters()))
    assert snapshot.staging_bytes == SLOTS * SLOT_BYTES <= 2**30
    snapshot.restore()


def _ranks_fail(rank, world_size, model_dir, batch, points):
    """Step 1 trains; at step 2 a fault at `points[rank]` (None: no fault on this rank). Returns how this
    rank's step 2 ended and whether its parameters and optimizer state are as before it."""
    import time

    from hilore_verl.integration.tools.verl_engine import actor_config, build_fsdp_engine, ppo_loss_fn, to_engine_batch
    from hilore_verl.integration.actor.engine import HiLoReFSDPEngine
    from hilore_verl.training.snapshots import StepFailed

    config = actor_config()
    td = to_engine_batch(shard(batch, rank, world_size), global_batch_size=batch["input_ids"].shape[0])
    engine = build_fsdp_engine(model_dir, lr=1e-2, engine_cls=HiLoReFSDPEngine, actor_config=config,
                               hilore={"enable": True, "risk_budget": 0.0, "fault_timeout_s": 3})

    def step():
        with engine.train_mode():
            engine.train_batch(td.clone(), loss_function=ppo_loss_fn(config))

    step()
    local = lambda: [p.to_local().clone() for p in engine.module.parameters()]  # noqa: E731
    moments = lambda: [s["exp_avg"].to_local().clone() for s in engine.optimizer.state.values()]  # noqa: E731
    before, moments_before = local(), moments()
    disarm = _inject(engine, points[rank]) if points[rank] is not None else (lambda: None)
    start = time.monotonic()
    try:
        step()
        outcome = "completed"
    except StepFailed as err:
        outcome = f"StepFailed: {err}"
    except Exception as err:  # noqa: BLE001 (reported, and the test fails on it)
        outcome = f"{type(err).__name__}: {err}"
    finally:
        disarm()
    restored = (all(torch.equal(a, b) for a, b in zip(local(), before))
                and all(torch.equal(a, b) for a, b in zip(moments(), moments_before)))
    return {"outcome": outcome, "restored": restored, "seconds": time.monotonic() - start}


@pytest.mark.parametrize("points", [("forward:1", None), ("optimizer_step", None), (None, "backward:0"),
                                    ("forward:1", "backward:0"), ("backward:1", "forward:0")],
                         ids=["forward_on_rank_0_only", "optimizer_step_on_rank_0_only", "backward_on_rank_1_only",
                              "forward_on_0_backward_on_1", "backward_on_0_forward_on_1"])
def test_ranks_that_fail_apart_all_stop_with_their_state_put_back(tmp_path, points):
    """A fault on one rank, or on both at different points (forward on one, backward on the other): a retry
    would pair its collectives with the peers' unrelated ones. Every rank stops with StepFailed and its state
    as before the step (the rank that did not fail too: its collectives are aborted), none hangs."""
    model_dir = save_tiny_model(tmp_path / "tiny-qwen2", "qwen2", seed=0)
    ranks = run_on_ranks(_ranks_fail, 2, args=(model_dir, make_grpo_batch(WORKLOAD, seed=3), points), timeout_s=240)
    for rank, r in enumerate(ranks):
        assert r["outcome"].startswith("StepFailed") and r["restored"], (rank, r)
        assert r["seconds"] < 60, (rank, r)  # the fault timeout (3 s) and the monitor, not a hang


def _table(rows) -> str:
    def cell(r):
        if r["outcome"] == "completed":
            return "retried; bitwise = uninterrupted step" if r["as_uninterrupted"] else "retried; DIFFERS"
        return f"raised {r['outcome']}; " + ("state as before the step" if r["as_before"] else "STATE CHANGED")

    lines = ["| fault point | plans | gradient sync | oom_retries 0 | oom_retries 1 |", "|---|---|---|---|---|"]
    for row in rows:
        sync = "deferred" if row["defer_sync"] else "every micro-batch"
        lines.append(f"| {row['point']} | {row['setting']} | {sync} | {cell(row[0])} | {cell(row[1])} |")
    return "\n".join(lines)


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        import pathlib

        rows = []
        for setting in SETTINGS:
            directory = _model(pathlib.Path(tmp), setting)
            for defer in (True, False):
                args = (directory, make_grpo_batch(WORKLOAD, seed=3), defer, POINTS, setting)
                rows += run_on_ranks(_suite, 2, args=args)[0]
        print(_table(rows))
