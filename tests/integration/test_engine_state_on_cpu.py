"""HiLoReFSDPEngine's state and bookkeeping: the audit's micro-batch and metrics, exposure under an
entropy bonus, stochastic rounding in the plans, and the controller state in checkpoints (JSON,
validated).

The engines here run verl's ordinary layout (`shared_prompt: False`, compared bitwise with stock verl).
"""

import json
import logging
import os
import pathlib
import types

import pytest
import torch

from hilore_verl.tiny.models import save_tiny_model, tiny_config
from hilore_verl.tiny.workload import GRPOWorkload, make_grpo_batch, shard
from tests.harness.distributed import run_on_ranks
from tests.harness.profiles import gpu_like_profile
from tests.integration.test_hilore_engine_on_cpu import WORKLOAD


def _bare_engine(**attributes):
    """The engine's own methods on an object verl never initialised (no model, no ranks)."""
    from hilore_verl.integration.actor.engine import HiLoReFSDPEngine

    engine = HiLoReFSDPEngine.__new__(HiLoReFSDPEngine)
    engine.__dict__.update(attributes)
    return engine


# ---------------------------------------------------------------------- exposure under an entropy bonus
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum"])
def test_the_engine_plans_zero_advantages_as_exposed_under_an_entropy_bonus(agg):
    from hilore_verl.integration.actor.batch import LossTerms, vocab_size
    from hilore_verl.integration.tools.verl_engine import actor_config, to_engine_batch

    batch = make_grpo_batch(GRPOWorkload(num_groups=1, group_size=4, max_prompt_len=8, max_response_len=12), seed=0)
    batch["advantages"] = torch.zeros_like(batch["advantages"])
    micro_batch = to_engine_batch(batch)  # verl's no-padding layout, as the engine's micro-batches
    model_config = types.SimpleNamespace(hf_config=tiny_config("qwen2"))
    figures = {}
    for coeff in (0.0, 0.02):  # the engine's reader of verl's batch, its vocabulary from verl's model config
        terms = LossTerms(lambda: vocab_size(model_config, None), actor_config(entropy_coeff=coeff, loss_agg_mode=agg))
        assert float(terms.coefficients(micro_batch).abs().sum()) == 0  # c leaves the entropy term out
        figures[coeff] = float(terms.exposure_l2(micro_batch))  # a 0-d tensor, read here
    assert figures[0.0] == 0.0 and figures[0.02] > 0, figures
    # the bound as stated: |entropy_coeff| * w_t * 2 ln V per response token, w_t from verl's agg_loss
    from hilore_verl.integration.actor.loss import aggregation_weights

    mask = batch["response_mask"].float()
    expected = 0.02 * aggregation_weights(mask, agg) * 2 * torch.log(torch.tensor(512.0)) * mask
    assert figures[0.02] == pytest.approx(float(expected.pow(2).sum().sqrt()), rel=1e-6)


# ---------------------------------------------------------------------- reading a checkpoint's state
def _unit_names():
    import hilore_verl
    from hilore_verl.tiny.models import build_tiny_model

    runtime = hilore_verl.attach(build_tiny_model("qwen2", seed=0))
    names = [u.name for u in runtime.units]
    runtime.detach()
    return names


def _valid_state_text(names):
    from hilore_verl.planner import BudgetConfig, Controller, CostTable, UnitProfile
    from hilore_verl.planner.state import dump_state

    costs = CostTable([UnitProfile(n, 1000.0 + i, 10.0, 1e-3 / (i + 1)) for i, n in enumerate(names)], tokens=96,
                      unmanaged_bytes=123.0)
    return dump_state(Controller(None, costs, None, BudgetConfig()).state_dict())


def _write_case(directory, case, good_text):
    """Put a checkpoint directory's controller state into one of the states a run must refuse."""
    json_path = os.path.join(directory, "hilore_controller.json")
    if os.path.exists(json_path):
        os.remove(json_path)
    if case == "good":
        pathlib.Path(json_path).write_text(good_text)
    elif case == "garbage":
        pathlib.Path(json_path).write_bytes(b"\x80\x04garbage{]" + os.urandom(64))
    elif case == "units":  # saved for a model with other units (here: one layer fewer)
        doc = json.loads(good_text)
        doc["state"]["costs"]["units"] = [u for u in doc["state"]["costs"]["units"]
                                          if not u["name"].startswith("layers.1.")]
        pathlib.Path(json_path).write_text(json.dumps(doc))
    return json_path


class _Messages(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.mark.parametrize("case", ["garbage", "units"])
def test_a_bad_controller_state_is_refused_with_one_message(tmp_path, case):
    names = _unit_names()
    path = _write_case(str(tmp_path), case, _valid_state_text(names))
    engine = _bare_engine(runtime=types.SimpleNamespace(units=[types.SimpleNamespace(name=n) for n in names]))
    handler = _Messages()
    logging.getLogger("hilore_verl").addHandler(handler)
    try:
        assert engine._read_state(str(tmp_path)) is None
    finally:
        logging.getLogger("hilore_verl").removeHandler(handler)
    assert len(handler.messages) == 1 and path in handler.messages[0], handler.messages
    assert "profiles and calibrates again" in handler.messages[0]
    reason = {"garbage": "not JSON", "units": "not this model's"}[case]
    assert reason in handler.messages[0], handler.messages[0]
    _write_case(str(tmp_path), "good", _valid_state_text(names))
    assert engine._read_state(str(tmp_path))["costs"]["tokens"] == 96


# ---------------------------------------------------------------------- on 2 ranks, through verl's engine
def _train_step(engine, batch, rank, world_size, loss_fn):
    from hilore_verl.integration.tools.verl_engine import to_engine_batch

    td = to_engine_batch(shard(batch, rank, world_size), global_batch_size=batch["input_ids"].shape[0])
    with engine.train_mode():
        out = engine.train_batch(td, loss_function=loss_fn)
    return {k: v for k, v in out["metrics"].items() if k.startswith("hilore/")}


def _audits(rank, world_size, model_dir, batch):
    import hilore_verl.training.calibration as calibration
    from hilore_verl.integration.tools.verl_engine import actor_config, build_fsdp_engine, ppo_loss_fn
    from hilore_verl.integration.actor.engine import HiLoReFSDPEngine
    from hilore_verl.planner.controller import Controller
    from hilore_verl.runtime import Mode, UnitPlan

    calibration.profile = gpu_like_profile(calibration.profile)
    picked = []  # the micro-batch each audit chose
    choose = getattr(Controller, "audit_micro_batch", None)
    if choose is not None:
        Controller.audit_micro_batch = lambda self, *a, **k: picked.append(choose(self, *a, **k)) or picked[-1]
    loss_fn = ppo_loss_fn(actor_config())
    engine = build_fsdp_engine(model_dir, gradient_checkpointing=True, lr=0.0, clip_grad=1e9,
                               engine_cls=HiLoReFSDPEngine,
                               hilore={"enable": True, "shared_prompt": False, "risk_budget": 0.5, "min_bytes": 1024, "audit_every": 1,
                                       "stochastic_rounding": True, "seed": 7,
                                       "skip_zero_exposure": False})  # micro-batch 0 stays, without exposure
    compressed = []  # every compressed unit's plan the controller hands the runtime
    set_plan = engine.runtime.set_plan

    def spy(plan, **kwargs):
        if engine.controller is not None:  # after profiling and calibration: the controller's plans
            compressed.extend(p for p in map(UnitPlan.parse, plan.values()) if p.mode == Mode.COMPRESS)
        return set_plan(plan, **kwargs)

    engine.runtime.set_plan = spy

    def audit_keys(metrics):
        return {k: v for k, v in metrics.items() if k.startswith("hilore/audit")}

    steps = [audit_keys(_train_step(engine, batch, rank, world_size, loss_fn))]  # micro-batch 0 has no exposure
    budget, audits = engine.controller.risk_budget, len(engine.controller.audit.history)
    no_exposure = dict(batch, advantages=torch.zeros_like(batch["advantages"]))
    steps.append(audit_keys(_train_step(engine, no_exposure, rank, world_size, loss_fn)))  # due, nothing to audit
    skipped = {"budget": engine.controller.risk_budget == budget,
               "history": len(engine.controller.audit.history) == audits}
    engine.controller.audit.every = 1000  # not due
    steps.append(audit_keys(_train_step(engine, batch, rank, world_size, loss_fn)))
    return {"picked": picked, "steps": steps, "skipped": skipped,
            "stochastic": getattr(engine.controller, "stochastic", False),
            "compressed": len(compressed), "all_stochastic": all(p.stochastic for p in compressed)}


def test_audits_sample_an_exposed_micro_batch_and_report_only_when_run(tmp_path):
    model_dir = save_tiny_model(tmp_path / "tiny-qwen2", "qwen2", seed=0)
    batch = make_grpo_batch(WORKLOAD, seed=3)  # its second group (rank 1's sequences) has zero advantages
    batch["advantages"][:2] = 0  # so micro-batch 0 has no exposure on either rank, micro-batch 1 has some
    ranks = run_on_ranks(_audits, 2, args=(model_dir, batch))
    first, no_exposure, not_due = ranks[0]["steps"]
    assert first == ranks[1]["steps"][0]  # one result on every rank
    assert first["hilore/audit/cosine"][0] >= 0.99 and first["hilore/audit/rel_error"][0] <= 0.5, first
    assert ranks[0]["picked"] == ranks[1]["picked"] == [1, None]  # the same micro-batch everywhere
    assert no_exposure == {} and not_due == {}  # no audit, no audit metrics (not the last audit's again)
    for r in ranks:
        assert r["skipped"] == {"budget": True, "history": True}
        assert r["stochastic"] and r["compressed"] > 0 and r["all_stochastic"], r  # hilore.stochastic_rounding


def _resume_from_bad_states(rank, world_size, model_dir, batch, ckpt_dir):
    import torch.distributed as dist

    import hilore_verl.training.calibration as calibration
    import hilore_verl.integration.actor.controller_file as controller_file
    from hilore_verl.integration.tools.verl_engine import actor_config, build_fsdp_engine, ppo_loss_fn
    from hilore_verl.integration.actor.engine import HiLoReFSDPEngine

    profiles = []
    real = gpu_like_profile(calibration.profile)
    calibration.profile = lambda *a, **k: profiles.append(1) or real(*a, **k)
    handler = _Messages()
    logging.getLogger("hilore_verl").addHandler(handler)
    config = actor_config()
    loss_fn = ppo_loss_fn(config)

    def build():  # a risk model too: its calibration is part of the state a resume must keep
        return build_fsdp_engine(model_dir, gradient_checkpointing=True, lr=0.0, clip_grad=1e9,
                                 engine_cls=HiLoReFSDPEngine, actor_config=config,
                                 hilore={"enable": True, "shared_prompt": False, "risk_budget": 0.5, "min_bytes": 1024, "audit_every": 0})

    engine = build()
    _train_step(engine, batch, rank, world_size, loss_fn)
    engine.save_checkpoint(ckpt_dir, global_step=1)
    saved = engine.controller.state_dict()
    dist.barrier()
    files = sorted(f for f in os.listdir(ckpt_dir) if f.startswith("hilore"))
    good = pathlib.Path(ckpt_dir, "hilore_controller.json").read_text()
    plan = dict(engine.controller.history[-1].plan)
    results = {}
    for case in ("garbage", "units", "one rank", "good"):
        dist.barrier()
        if rank == 0:
            path = _write_case(ckpt_dir, "good" if case == "one rank" else case, good)
        dist.barrier()
        path = os.path.join(ckpt_dir, "hilore_controller.json")
        load_state = controller_file.load_state
        if case == "one rank" and rank == 1:  # this rank alone cannot use the file: nobody may
            controller_file.load_state = lambda *a, **k: (_ for _ in ()).throw(ValueError("simulated"))
        handler.messages.clear()
        before = len(profiles)
        if case == "good":  # a fresh engine, as a resumed job builds it
            engine = build()
        try:
            engine.load_checkpoint(ckpt_dir, del_local_after_load=False)
        finally:
            controller_file.load_state = load_state
        _train_step(engine, batch, rank, world_size, loss_fn)
        messages = [m for m in handler.messages if "controller state" in m]
        results[case] = {"profiled": len(profiles) - before, "messages": messages,
                         "names_file": all(path in m for m in messages),
                         "same_plan": dict(engine.controller.history[-1].plan) == plan}
    state = engine.controller.state_dict()
    results["good"].update(same_risk=engine.controller.risk.sensitivity == saved["risk"]["sensitivity"],
                           same_costs=state["costs"] == saved["costs"])
    return {"files": files, "cases": results}


def test_a_checkpoint_resumes_its_controller_state_and_a_bad_one_re_profiles(tmp_path):
    """A fresh engine loading a good checkpoint plans as the saved one did, with its costs and risk model and
    no probes; a bad state (garbage, another model's units, unreadable on one rank) re-profiles everywhere
    with one message."""
    model_dir = save_tiny_model(tmp_path / "tiny-qwen2", "qwen2", seed=0)
    ranks = run_on_ranks(_resume_from_bad_states, 2,
                         args=(model_dir, make_grpo_batch(WORKLOAD, seed=3), str(tmp_path / "ckpt")))
    for rank, r in enumerate(ranks):
        assert r["files"] == ["hilore_controller.json"], r["files"]  # JSON, no pickle
        for case in ("garbage", "units", "one rank"):
            c = r["cases"][case]
            assert c["profiled"] == 1 and len(c["messages"]) == 1 and c["same_plan"], (rank, case, c)
            if case != "one rank":
                assert c["names_file"], (rank, case, c)
        assert r["cases"]["good"] == {"profiled": 0, "messages": [], "names_file": True, "same_plan": True,
                                      "same_risk": True, "same_costs": True}
    assert "another rank could not use" in ranks[0]["cases"]["one rank"]["messages"][0]
    assert "simulated" in ranks[1]["cases"]["one rank"]["messages"][0]
