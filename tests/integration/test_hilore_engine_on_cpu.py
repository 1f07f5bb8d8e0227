"""HiLoReFSDPEngine (verl's FSDP engine + runtime + planner) on 2 gloo ranks against stock verl with GC.

lr = 0, so both engines see the same weights. Risk budget 0: the planner may only keep or
recompute, so gradients must be bitwise those of stock verl. Risk budget > 0: compressed units
appear and the gradient stays within the runtime's bounds (cosine >= 0.999, 0.996 with int4).

The engines here run verl's ordinary layout (`shared_prompt: False`): bitwise equality with stock
verl holds there; the shared layout agrees within reordering (tests/integration/test_shared_prompt_engine_on_cpu.py).
"""

import dataclasses

import pytest
import torch

from hilore_verl.tiny.models import save_tiny_model
from hilore_verl.tiny.workload import GRPOWorkload, make_grpo_batch, shard
from tests.harness.distributed import run_on_ranks
from tests.harness.profiles import gpu_like_profile

WORKLOAD = GRPOWorkload(num_groups=2, group_size=4, max_prompt_len=12, max_response_len=24)


def _cosine(grads, ref) -> float:
    a = torch.cat([grads[n].flatten().double() for n in ref])
    b = torch.cat([g.flatten().double() for g in ref.values()])
    return float(a @ b / (a.norm() * b.norm()))


def _train_step(engine, batch, rank, world_size, loss_fn):
    """One verl train_batch on this rank's shard; returns verl's output and the full gradients."""
    from hilore_verl.integration.tools.verl_engine import to_engine_batch

    td = to_engine_batch(shard(batch, rank, world_size), global_batch_size=batch["input_ids"].shape[0])
    with engine.train_mode():
        out = engine.train_batch(td, loss_function=loss_fn)
        grads = {n: p.grad.full_tensor() for n, p in engine.module.named_parameters()}
    return out, grads


def _compare(rank, world_size, model_dir, batch, risk_budget):
    import hilore_verl.training.calibration as calibration
    from hilore_verl.integration.tools.verl_engine import actor_config, build_fsdp_engine, ppo_loss_fn
    from hilore_verl.integration.actor.engine import HiLoReFSDPEngine

    calibration.profile = gpu_like_profile(calibration.profile)

    config = actor_config()
    loss_fn = ppo_loss_fn(config)

    def step(engine):
        return _train_step(engine, batch, rank, world_size, loss_fn)

    stock = build_fsdp_engine(model_dir, gradient_checkpointing=True, lr=0.0, clip_grad=1e9)
    _, grads0 = step(stock)
    hilore = build_fsdp_engine(model_dir, gradient_checkpointing=True, lr=0.0, clip_grad=1e9,
                               engine_cls=HiLoReFSDPEngine, actor_config=config,
                               hilore={"enable": True, "shared_prompt": False, "risk_budget": risk_budget, "min_bytes": 1024,
                                       "budget": {"mode": "gc_ratio", "value": 1.1}, "audit_every": 0})
    results = []
    for _ in range(2):
        out, grads = step(hilore)
        flat = lambda g: torch.cat([x.flatten().double() for x in g.values()])  # noqa: E731
        a, b = flat(grads), flat(grads0)
        results.append({"bitwise": all(torch.equal(grads[n], g) for n, g in grads0.items()),
                        "cos": float(a @ b / (a.norm() * b.norm())),
                        "plan": dict(hilore.controller.history[-1].plan),
                        "metrics": {k: v for k, v in out["metrics"].items() if k.startswith("hilore/")}})
    return results


@pytest.mark.parametrize("risk_budget", [0.0, 0.5])
def test_hilore_engine_against_stock_verl(tmp_path, risk_budget):
    model_dir = save_tiny_model(tmp_path / "tiny-qwen2", "qwen2", seed=0)
    batch = make_grpo_batch(WORKLOAD, seed=3)
    ranks = run_on_ranks(_compare, 2, args=(model_dir, batch, risk_budget))
    assert ranks[0][0]["plan"] == ranks[1][0]["plan"]  # every rank planned the same
    for step in ranks[0]:
        modes = set(step["plan"].values())
        assert "hilore/plan/predicted_peak_gib" in step["metrics"] and "hilore/plan/solver_ms" in step["metrics"]
        if risk_budget == 0:  # a mix, not GC's all-recompute plan nor no GC's all-keep one
            assert modes == {"keep", "recompute"} and step["bitwise"], step
        else:
            # the runtime's stated bounds for the lossiest format in the plan (docs/design.md, Testing)
            floor = 0.996 if "int4" in {v.fmt for v in step["plan"].values()} else 0.999
            assert step["cos"] >= floor, step
    if risk_budget > 0:
        assert any(set(s["plan"].values()) - {"keep", "recompute"} for s in ranks[0]), ranks[0]


def _audit_and_oom(rank, world_size, model_dir, batch):
    import hilore_verl.training.calibration as calibration
    from hilore_verl.integration.tools.verl_engine import actor_config, build_fsdp_engine, ppo_loss_fn
    from hilore_verl.integration.actor.engine import HiLoReFSDPEngine

    calibration.profile = gpu_like_profile(calibration.profile)
    config = actor_config()
    loss_fn = ppo_loss_fn(config)  # no actor_config passed: the engine takes it from the bound loss

    def step(engine):
        return _train_step(engine, batch, rank, world_size, loss_fn)

    stock = build_fsdp_engine(model_dir, gradient_checkpointing=True, lr=0.0, clip_grad=1e9)
    _, exact = step(stock)
    engine = build_fsdp_engine(model_dir, gradient_checkpointing=True, lr=0.0, clip_grad=1e9,
                               engine_cls=HiLoReFSDPEngine,
                               hilore={"enable": True, "shared_prompt": False, "risk_budget": 0.5, "min_bytes": 1024, "audit_every": 1})
    out1, _ = step(engine)  # audited step
    plan_micro_batch, calls = engine.controller.plan_micro_batch, []

    def out_of_memory_once(index, gradients=True):
        calls.append(index)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("injected: out of memory")
        return plan_micro_batch(index, gradients)

    engine.controller.plan_micro_batch = out_of_memory_once
    engine.controller.audit.every = 1000  # no audit in the step that runs out of memory
    factor = engine.controller.memory_factor
    out2, grads = step(engine)
    return {"audit": {k: v for k, v in out1["metrics"].items() if k.startswith("hilore/audit")},
            "retries": out2["metrics"]["hilore/oom_retries"], "factor": engine.controller.memory_factor / factor,
            "cos_after_retry": _cosine(grads, exact)}


def test_audit_metrics_and_oom_retry(tmp_path):
    model_dir = save_tiny_model(tmp_path / "tiny-qwen2", "qwen2", seed=0)
    ranks = run_on_ranks(_audit_and_oom, 2, args=(model_dir, make_grpo_batch(WORKLOAD, seed=3)))
    assert ranks[0]["audit"] == ranks[1]["audit"]  # the audit reduces over ranks: one result everywhere
    audit = ranks[0]["audit"]
    assert audit["hilore/audit/rel_error"][0] <= 0.5 and audit["hilore/audit/cosine"][0] >= 0.99, audit  # risk budget 0.5
    for r in ranks:
        assert r["retries"] == [1.0] and r["factor"] == pytest.approx(0.9)
        # the retry runs the planned (compressed) plan with kept units recomputed: within the codec's bounds;
        # that it is bitwise the uninterrupted update is tests/training/test_faults_on_cpu.py's to show
        assert r["cos_after_retry"] >= 0.99, r  # risk budget 0.5, as the audit above


def _with_model_options(rank, world_size, model_dir, batch, options):
    """verl's engine with model options (`HFModelConfig` fields): stock with GC against HiLoRe with
    keep / recompute plans only; gradients of every trainable parameter."""
    from hilore_verl.integration.tools.verl_engine import actor_config, build_fsdp_engine, ppo_loss_fn, to_engine_batch
    from hilore_verl.integration.actor.engine import HiLoReFSDPEngine

    config = actor_config()
    packed = options.pop("use_remove_padding", True)
    td = to_engine_batch(shard(batch, rank, world_size), global_batch_size=batch["input_ids"].shape[0],
                         use_remove_padding=packed)

    def step(engine):
        with engine.train_mode():
            engine.train_batch(td.clone(), loss_function=ppo_loss_fn(config))
            return {n: p.grad.full_tensor() for n, p in engine.module.named_parameters() if p.grad is not None}

    build = dict(gradient_checkpointing=True, lr=0.0, clip_grad=1e9, model_options=options, use_remove_padding=packed)
    torch.manual_seed(0)  # peft draws the adapters' initial weights: the same in both engines
    grads0 = step(build_fsdp_engine(model_dir, **build))
    torch.manual_seed(0)
    engine = build_fsdp_engine(model_dir, **build, engine_cls=HiLoReFSDPEngine, actor_config=config,
                               hilore={"enable": True, "shared_prompt": False, "risk_budget": 0.0, "min_bytes": 1024,
                                       "audit_every": 0, "budget": {"mode": "gc_ratio", "value": 1.0}})  # a mix
    grads = step(engine)
    proj = {u.name: u for u in engine.runtime.units}["layers.0.attn.proj"]
    return {"same_parameters": sorted(grads0) == sorted(grads) and len(grads0) > 0,
            "adapters_only": all("lora" in n for n in grads0),
            "bitwise": all(torch.equal(grads[n], g) for n, g in grads0.items()),
            "wrapped": all(hasattr(m, "base_layer") and hasattr(m, "lora_A") for m in proj.modules),
            "outside_share": engine.runtime.stats().unmanaged_bytes / (engine.runtime.stats().unmanaged_bytes
                                                                       + engine.runtime.stats().saved_bytes),
            "stats": "|".join(f"{n}:{u.saved_bytes}" for n, u in engine.runtime.stats().units.items())
            + f"|out:{engine.runtime.stats().unmanaged_bytes}",
            "modes": sorted({m for r in engine.controller.history for m in r.plan.values()})}


@pytest.mark.parametrize("options", [{"lora_rank": 4, "lora_alpha": 8, "target_modules": "all-linear"},
                                     {"use_fused_kernels": True}, {"use_remove_padding": False}],
                         ids=["lora", "fused_kernels", "padded"])
def test_verl_model_options_update_as_stock_verl(tmp_path, options):
    model_dir = save_tiny_model(tmp_path / "tiny-qwen2", "qwen2", seed=0)
    ranks = run_on_ranks(_with_model_options, 2, args=(model_dir, make_grpo_batch(WORKLOAD, seed=3), dict(options)))
    for r in ranks:
        assert r["same_parameters"] and r["bitwise"], r
        assert set(r["modes"]) == {"keep", "recompute"}, r  # a mix of both, bitwise
        assert r["adapters_only"] == r["wrapped"] == ("lora_rank" in options), r
        # the log-prob code's saves are the head's, fused or not (0.06-0.10 measured; 0.33-0.40 when
        # the logits it saves counted as outside units)
        assert r["outside_share"] <= 0.2, r["stats"]


def test_start_up_checks_the_codec_launch_where_compression_can_run(monkeypatch):
    import hilore_verl.kernels as kernels
    from hilore_verl.training.config import HiLoReConfig
    from hilore_verl.integration.actor.engine import check_codec_device

    asked = []
    monkeypatch.setattr(kernels, "triton_status", lambda device: asked.append(device) or (False, "no C compiler"))
    cuda = torch.device("cuda", 0)
    assert check_codec_device(HiLoReConfig(enable=True), cuda) is False and asked == [cuda]
    assert check_codec_device(HiLoReConfig(enable=True, risk_budget=0.0), cuda) is True  # keep / recompute only
    assert check_codec_device(HiLoReConfig(enable=True), torch.device("cpu")) is True
    assert asked == [cuda]


def _first_steps_without_exposure(rank, world_size, model_dir, batch):
    """verl's engine on data a GRPO run starts with: step 1 with every advantage zero on every rank, step 2
    with exposure on rank 1 only, step 3 on both."""
    import hilore_verl.training.calibration as calibration
    from hilore_verl.integration.tools.verl_engine import actor_config, build_fsdp_engine, ppo_loss_fn
    from hilore_verl.integration.actor.engine import HiLoReFSDPEngine

    calibration.profile = gpu_like_profile(calibration.profile)
    config = actor_config()
    loss_fn = ppo_loss_fn(config)
    flat = {**batch, "advantages": torch.zeros_like(batch["advantages"])}
    stock = build_fsdp_engine(model_dir, gradient_checkpointing=True, lr=0.0, clip_grad=1e9)
    engine = build_fsdp_engine(model_dir, gradient_checkpointing=True, lr=0.0, clip_grad=1e9,
                               engine_cls=HiLoReFSDPEngine, actor_config=config,
                               hilore={"enable": True, "shared_prompt": False, "risk_budget": 0.5, "min_bytes": 1024, "audit_every": 1})
    _, exact = _train_step(stock, flat, rank, world_size, loss_fn)
    steps = []
    for data in (flat, flat if rank == 0 else batch, batch):
        out, grads = _train_step(engine, data, rank, world_size, loss_fn)
        steps.append({"metrics": {k: v for k, v in out["metrics"].items() if k.startswith("hilore/")},
                      "bitwise": all(torch.equal(grads[n], g) for n, g in exact.items()),
                      "plans": [dict(r.plan) for r in engine.controller.history]})
    return steps, dict(engine.controller.risk.sensitivity)


def test_an_engine_starting_without_exposure_trains_exactly_then_calibrates(tmp_path):
    model_dir = save_tiny_model(tmp_path / "tiny-qwen2", "qwen2", seed=0)
    every_group = dataclasses.replace(WORKLOAD, zero_advantage_share=0.0)  # exposure on both ranks' shards
    (steps0, sens0), (steps1, sens1) = run_on_ranks(_first_steps_without_exposure, 2,
                                                   args=(model_dir, make_grpo_batch(every_group, seed=3)))
    first, second, third = steps0
    assert first["metrics"]["hilore/risk_calibrated"] == [0.0] and first["bitwise"]  # stock verl's (zero) gradient
    assert "hilore/audit/cosine" not in first["metrics"]  # exact plans: nothing to audit
    assert all(p.exact for plan in first["plans"] for p in plan.values())
    assert second["metrics"]["hilore/risk_calibrated"] == [1.0] and "hilore/audit/cosine" in second["metrics"]
    assert sens0 == sens1 and len(sens0) > 0  # rank 1's measurement on both ranks
    assert steps0[-1]["plans"] == steps1[-1]["plans"]
    assert any(not p.exact for plan in third["plans"] for p in plan.values())  # compressing pays (GPU-like table)
