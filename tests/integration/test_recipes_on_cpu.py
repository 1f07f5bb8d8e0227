"""The recipe switch, as verl composes it: hydra config -> actor config -> EngineRegistry -> actor worker.

Every recipe YAML composes over verl's ppo_trainer; `actor_rollout_ref.actor.hilore.enable=true`
gives HiLoReFSDPEngine, without it verl's own engine and engine config. Bad `hilore:` sections,
FSDP1 and verl's activation offload fail at config conversion (verl's start-up), naming the key.
On 2 gloo ranks, verl's ActorRolloutRefWorker builds the engine from the tiny CPU recipe, and one
actor update through the worker with HiLoRe (risk budget 0) leaves weights bitwise equal to the
stock worker with gradient checkpointing.
"""

from pathlib import Path

import pytest
import torch

from hilore_verl.tiny.models import save_tiny_model
from hilore_verl.tiny.workload import GRPOWorkload, make_grpo_batch, shard
from tests.harness.distributed import run_on_ranks

RECIPES = Path(__file__).resolve().parents[2] / "recipes" / "grpo"
MODEL_RECIPES = sorted(p.stem for p in RECIPES.glob("qwen2.5-*.yaml"))


def compose(name: str, overrides=()):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(RECIPES), version_base=None):
        return hydra_compose(name, overrides=list(overrides))


def actor(cfg):
    from verl.utils.config import omega_conf_to_dataclass

    return omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)


def engine_cls(actor_config):
    from verl.workers.engine import EngineRegistry

    return EngineRegistry.get_engine_cls("language_model", actor_config.engine.strategy)


def test_every_gpu_recipe_is_present():
    assert MODEL_RECIPES == [f"qwen2.5-{m}_{d}" for m in ("0.5b", "1.5b", "7b") for d in ("gsm8k", "math")]


@pytest.mark.parametrize("name", MODEL_RECIPES + ["tiny_cpu"])
def test_flag_selects_the_engine(name):
    from hilore_verl.integration.actor.config import HiLoReEngineConfig
    from hilore_verl.integration.actor.engine import HiLoReFSDPEngine
    from verl.workers.config import FSDPEngineConfig
    from verl.workers.engine import FSDPEngineWithLMHead

    overrides = ["actor_rollout_ref.model.path=/unused"] if name == "tiny_cpu" else []
    on = actor(compose(name, overrides + ["actor_rollout_ref.actor.hilore.enable=true"]))
    assert on.hilore.enable and type(on.engine) is HiLoReEngineConfig and engine_cls(on) is HiLoReFSDPEngine
    assert on.engine.as_fsdp2().strategy == "fsdp2" and on.fsdp_config.strategy == "fsdp2"
    off = actor(compose(name, overrides))
    assert not off.hilore.enable and type(off.engine) is FSDPEngineConfig and engine_cls(off) is FSDPEngineWithLMHead
    # apart from the hilore section, the flag changes nothing in the engine config verl sees
    fields = [f for f in FSDPEngineConfig.__dataclass_fields__ if f != "strategy"]
    assert all(getattr(on.engine, f) == getattr(off.engine, f) for f in fields)


@pytest.mark.parametrize("name", MODEL_RECIPES)
def test_the_kl_off_variant_composes_over_every_recipe(name):
    """`+variant=no_kl`: the KL loss off, everything else the recipe's (so HiLoRe may skip the sequences
    without a loss term); the KL loss is on without it."""
    from hilore_verl.integration.actor.engine import HiLoReFSDPEngine

    on = compose(name, ["actor_rollout_ref.actor.hilore.enable=true"])
    off = compose(name, ["actor_rollout_ref.actor.hilore.enable=true", "+variant=no_kl"])
    assert on.actor_rollout_ref.actor.use_kl_loss and not off.actor_rollout_ref.actor.use_kl_loss
    config = actor(off)
    assert config.hilore.skip_zero_exposure and engine_cls(config) is HiLoReFSDPEngine
    off.actor_rollout_ref.actor.use_kl_loss = True
    assert off == on


def test_stock_verl_config_is_untouched():
    """Without the recipe's _target_, verl's own FSDPActorConfig and engine (nothing of ours is involved)."""
    from verl.workers.config import FSDPActorConfig

    cfg = compose("qwen2.5-0.5b_gsm8k", ["actor_rollout_ref.actor._target_=verl.workers.config.FSDPActorConfig",
                                          "~actor_rollout_ref.actor.hilore"])
    assert type(actor(cfg)) is FSDPActorConfig


@pytest.mark.parametrize("override, message", [
    ("+actor_rollout_ref.actor.hilore.budjet=1", "hilore.budjet: unknown key"),
    ("actor_rollout_ref.actor.hilore.risk_budget=-1", "hilore.risk_budget: got -1"),
    ("actor_rollout_ref.actor.hilore.formats=[int3]", "hilore.formats: unknown format 'int3'"),
    ("actor_rollout_ref.actor.hilore.budget.value=0", "hilore.budget.value: got 0; valid: a finite number >= 1"),
    ("actor_rollout_ref.actor.hilore.budget.mode=gib", "hilore.budget.value: required with mode gib"),
    ("actor_rollout_ref.actor.hilore.enable=yes please", "hilore.enable: got 'yes please'; valid: true or false"),
    ("actor_rollout_ref.actor.strategy=fsdp", "strategy=fsdp (FSDP1)"),
])
def test_bad_config_fails_at_conversion(override, message):
    cfg = compose("qwen2.5-0.5b_gsm8k", ["actor_rollout_ref.actor.hilore.enable=true", override])
    with pytest.raises(Exception) as err:
        actor(cfg)
    assert message in str(err.value), str(err.value)


def test_activation_offload_is_refused_by_validate():
    cfg = compose("qwen2.5-0.5b_gsm8k", ["actor_rollout_ref.actor.hilore.enable=true",
                                          "actor_rollout_ref.model.enable_activation_offload=true"])
    with pytest.raises(ValueError, match="enable_activation_offload=false"):
        actor(cfg).validate(8, 256, cfg.actor_rollout_ref.model)


WORKLOAD = GRPOWorkload(num_groups=2, group_size=4, max_prompt_len=12, max_response_len=16, with_ref_log_prob=True)


def _worker_update(rank, world_size, model_dir, batch):
    from hilore_verl.integration.tools.verl_engine import to_engine_batch
    from hilore_verl.integration.actor.engine import HiLoReFSDPEngine
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine_workers import ActorRolloutRefWorker

    import hilore_verl.training.calibration as calibration
    from tests.harness.profiles import gpu_like_profile

    # a profile whose plans do not follow this host's timing: measured, the hooks' overhead could price GC's
    # plan run hands-off below any mix, and the update would compare GC with GC
    calibration.profile = gpu_like_profile(calibration.profile)
    results = {}
    for flag in ("false", "true"):
        cfg = compose("tiny_cpu", [f"actor_rollout_ref.model.path={model_dir}",
                                   f"actor_rollout_ref.actor.hilore.enable={flag}",
                                   "actor_rollout_ref.actor.hilore.risk_budget=0",
                                   # bitwise holds in verl's ordinary layout (the shared one: within reordering)
                                   "actor_rollout_ref.actor.hilore.shared_prompt=false",
                                   "actor_rollout_ref.actor.optim.lr=1e-3"])
        worker = ActorRolloutRefWorker(cfg.actor_rollout_ref, role="actor")
        worker.init_model()
        td = to_engine_batch(shard(batch, rank, world_size), global_batch_size=batch["input_ids"].shape[0])
        tu.assign_non_tensor(td, mini_batch_size=batch["input_ids"].shape[0], epochs=1)
        out = worker.actor.train_mini_batch(td)
        engine = worker.actor.engine
        weights = {n: p.full_tensor().clone() for n, p in engine.module.named_parameters()}
        metrics = dict(tu.get(out, "metrics")) if out is not None else {}
        results[flag] = {"engine": type(engine) is HiLoReFSDPEngine, "weights": weights,
                         "hilore_metrics": sorted(k for k in metrics if k.startswith("hilore/")),
                         "plan": _layer_modes(engine) if flag == "true" else None}
    return results


def _layer_modes(engine) -> dict[str, int]:
    """How many decoder-layer units the last micro-batch kept and recomputed (GC's plan keeps none of them,
    no GC's recomputes none), and whether the runtime ran its forward (not hands-off)."""
    from hilore_verl.planner.costs import in_layers

    plan = engine.controller.history[-1].plan
    modes = [str(p) for name, p in plan.items() if in_layers(name)]
    return {"keep": modes.count("keep"), "recompute": modes.count("recompute"), "other": len(modes) - modes.count(
        "keep") - modes.count("recompute"), "hands_off": engine.runtime.hands_off}


def test_actor_update_through_verl_worker_is_bitwise_with_keep_recompute(tmp_path):
    model_dir = save_tiny_model(tmp_path / "tiny-qwen2", "qwen2", seed=0)
    batch = make_grpo_batch(WORKLOAD, seed=5)
    ranks = run_on_ranks(_worker_update, 2, args=(str(model_dir), batch))
    off, on = ranks[0]["false"], ranks[0]["true"]
    assert not off["engine"] and on["engine"]
    plan = on["plan"]  # a mix of kept and recomputed layer units, run through the runtime
    assert plan["keep"] > 0 and plan["recompute"] > 0 and plan["other"] == 0 and not plan["hands_off"], plan
    changed = any(not torch.equal(on["weights"][n], w) for n, w in _initial(model_dir).items() if n in on["weights"])
    assert changed  # the update did something
    assert all(torch.equal(on["weights"][n], w) for n, w in off["weights"].items())
    assert "hilore/plan/predicted_peak_gib" in on["hilore_metrics"] and not off["hilore_metrics"]


def _initial(model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    return {n: p.detach() for n, p in model.named_parameters()}


def test_command_line_form_over_stock_ppo_trainer():
    """The README's form for a user's own recipe: three overrides on verl's stock ppo_trainer."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from hilore_verl.integration.actor.engine import HiLoReFSDPEngine

    config_dir = str(Path(__import__("verl").__file__).parent / "trainer" / "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        cfg = hydra_compose("ppo_trainer", overrides=[
            "actor_rollout_ref.actor.strategy=fsdp2",
            "actor_rollout_ref.actor._target_=hilore_verl.integration.HiLoReActorConfig",
            "+actor_rollout_ref.actor.hilore.enable=true", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2"])
    assert engine_cls(actor(cfg)) is HiLoReFSDPEngine
