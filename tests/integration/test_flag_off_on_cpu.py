"""`hilore.enable: false` is stock verl, bit for bit: one actor update through verl's ActorRolloutRefWorker from
the tiny CPU recipe with the flag off, against the same recipe with verl's own FSDPActorConfig and no `hilore:`
section (nothing of HiLoRe's in the actor), from the same weights, batch and seeds. The updated weights, the
gradient norm and the loss are equal (torch.equal, ==), and both run verl's own engine.

(tests/integration/test_recipes_on_cpu.py compares the flag off with HiLoRe on at risk budget 0, and shows the flag off
selects verl's engine config and engine; the GC arm of tests/integration/test_demo_on_cpu.py runs main_ppo with the
flag off, without comparing numbers.)
"""

from pathlib import Path

import torch

from hilore_verl.tiny.models import save_tiny_model
from hilore_verl.tiny.workload import GRPOWorkload, make_grpo_batch
from tests.harness.distributed import run_on_ranks

RECIPES = Path(__file__).resolve().parents[2] / "recipes" / "grpo"
WORKLOAD = GRPOWorkload(num_groups=2, group_size=4, max_prompt_len=12, max_response_len=16, with_ref_log_prob=True)
ARMS = {
    "stock": ["actor_rollout_ref.actor._target_=verl.workers.config.FSDPActorConfig", "~actor_rollout_ref.actor.hilore"],
    "flag_off": ["actor_rollout_ref.actor.hilore.enable=false"],
}


def _one_update(rank, world_size, model_dir, batch, arms):
    from hydra import compose, initialize_config_dir
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine_workers import ActorRolloutRefWorker

    from hilore_verl.integration.tools.verl_engine import to_engine_batch

    results = {}
    for arm, overrides in arms.items():
        with initialize_config_dir(config_dir=str(RECIPES), version_base=None):
            cfg = compose("tiny_cpu", [f"actor_rollout_ref.model.path={model_dir}", *overrides])
        torch.manual_seed(0)
        worker = ActorRolloutRefWorker(cfg.actor_rollout_ref, role="actor")
        worker.init_model()
        td = to_engine_batch(batch, global_batch_size=batch["input_ids"].shape[0])
        tu.assign_non_tensor(td, mini_batch_size=batch["input_ids"].shape[0], epochs=1)
        torch.manual_seed(1)
        out = worker.actor.train_mini_batch(td)
        engine = worker.actor.engine
        metrics = dict(tu.get(out, "metrics"))
        results[arm] = {"actor_config": type(worker.actor.loss_fn.keywords["config"]).__qualname__,  # ppo_loss's
                        "engine": f"{type(engine).__module__}.{type(engine).__qualname__}",
                        "weights": {n: p.full_tensor().clone() for n, p in engine.module.named_parameters()},
                        "metrics": {k: v for k, v in metrics.items() if "loss" in k or "grad_norm" in k},
                        "hilore_metrics": sorted(k for k in metrics if "hilore" in k)}
    return results


def test_flag_off_updates_bitwise_as_stock_verl(tmp_path):
    model_dir = save_tiny_model(tmp_path / "tiny-qwen2", "qwen2", seed=0)
    (result,) = run_on_ranks(_one_update, 1, args=(str(model_dir), make_grpo_batch(WORKLOAD, seed=5), ARMS))
    stock, off = result["stock"], result["flag_off"]
    # the flag off: HiLoRe's config class in the worker, with verl's engine
    assert (stock["actor_config"], off["actor_config"]) == ("FSDPActorConfig", "HiLoReActorConfig")
    assert stock["engine"] == off["engine"] == "verl.workers.engine.fsdp.transformer_impl.FSDPEngineWithLMHead"
    assert not stock["hilore_metrics"] and not off["hilore_metrics"]
    assert {"grad_norm", "actor/pg_loss"} <= set(stock["metrics"]), stock["metrics"]
    assert off["metrics"] == stock["metrics"], (off["metrics"], stock["metrics"])
    assert set(off["weights"]) == set(stock["weights"])
    initial = _initial(model_dir)
    assert any(not torch.equal(stock["weights"][n], w) for n, w in initial.items())  # the update moved the weights
    unequal = [n for n, w in stock["weights"].items() if not torch.equal(off["weights"][n], w)]
    assert not unequal, unequal


def _initial(model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    return {n: p.detach() for n, p in model.named_parameters()}
