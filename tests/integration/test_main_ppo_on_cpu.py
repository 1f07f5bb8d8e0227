"""verl's own trainer end to end on the CPU: `python -m verl.trainer.main_ppo` through Ray, 2 ranks, the
tiny task, the plugin's `hf` rollout. Each test is one or two trainer runs of about a minute: the recipe's
features with a resume, verl's stock config with the documented overrides and the shared prompt, and verl's
legacy trainer on a run that starts without a loss term."""

import json
import os
import sys
from pathlib import Path

import pytest

from tests.harness import subprocess as harness

REPO = Path(__file__).resolve().parents[2]
RECIPES = REPO / "recipes" / "grpo"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from hilore_verl.tiny.task import make_tiny_task

    return Path(make_tiny_task(str(tmp_path_factory.mktemp("tiny") / "task")))


def main_ppo(tmp_path, task, *overrides, name="run", config_path=RECIPES, config_name="tiny_cpu", timeout=900):
    """Run main_ppo; returns (exit status, combined output, per-step metrics as verl's file logger wrote them)."""
    log = tmp_path / f"{name}.jsonl"
    env = {**os.environ, "VERL_FILE_LOGGER_PATH": str(log), "HYDRA_FULL_ERROR": "1", "RAY_ADDRESS": "local"}
    paths = [f"actor_rollout_ref.model.path={task}/model", f"data.train_files={task}/train.parquet",
             f"data.val_files={task}/val.parquet"]
    cmd = [sys.executable, "-m", "verl.trainer.main_ppo", "--config-path", str(config_path), "--config-name",
           config_name, *paths, "trainer.logger=[console,file]", *overrides]
    proc = harness.run(cmd, timeout_s=timeout, env=env, cwd=tmp_path)
    steps = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return proc.returncode, proc.stdout + proc.stderr, steps


def _hilore_keys(step) -> set[str]:
    return {k for k in step["data"] if "hilore" in k}


def test_hilore_epochs_minibatches_dynamic_bsz_kl_audit_then_resume_without_probing(tmp_path, task):
    ckpt = tmp_path / "ckpt"
    common = ["actor_rollout_ref.actor.hilore.enable=true", "actor_rollout_ref.actor.hilore.audit_every=1",
              "actor_rollout_ref.actor.ppo_epochs=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",  # 4 prompts: 2
              "actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=96",
              "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true",
              "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=96",
              "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=true",
              "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=96",
              "actor_rollout_ref.actor.use_kl_loss=true",  # the recipe's KL variant: no sequence can be skipped
              "trainer.save_freq=1", f"trainer.default_local_dir={ckpt}", "trainer.resume_mode=auto"]
    rc, out, steps = main_ppo(tmp_path, task, *common, "trainer.total_training_steps=2", name="first")
    assert rc == 0, out[-6000:]
    assert [s["step"] for s in steps] == [1, 2]
    assert "profiled on" in out  # the first step probes and calibrates
    for s in steps:
        m = s["data"]
        assert m["actor/kl_coef"] > 0 and "actor/kl_loss" in m  # the KL loss is on
        assert m["actor/hilore/plan/predicted_peak_gib"] <= m["actor/hilore/plan/budget_gib"] * 1.0001
        # the plans may compress where the measured transient leaves room (risk budget 0.01): the audit
        # runs and reads a close gradient; its own check of measured against predicted error is
        # tests/integration/test_hilore_engine_on_cpu.py's
        assert m["actor/hilore/audit/cosine"] >= 0.99, m
        assert m["actor/hilore/oom_retries"] == 0
    assert (ckpt / "global_step_2" / "actor").is_dir()

    rc, out, resumed = main_ppo(tmp_path, task, *common, "trainer.total_training_steps=3", name="resumed")
    assert rc == 0, out[-6000:]
    assert [s["step"] for s in resumed] == [3]
    assert "resumed from the checkpoint's costs and calibration" in out and "profiled on" not in out
    assert resumed[0]["data"]["actor/hilore/audit/cosine"] >= 0.99  # as above


def test_stock_ppo_trainer_plus_documented_overrides_with_the_shared_prompt(tmp_path, task):
    """No project YAML: verl's own ppo_trainer and the command-line overrides recipes/README.md documents, with
    hilore.shared_prompt (on by default) through verl's v1 trainer (its jagged response masks, its
    micro-batches, its balance keeping whole groups under use_prefix_grouper, docs/config.md): each group's
    prompt computed once in the actor's update and log-prob passes, no micro-batch refused. (Two runs from
    one seed sample different rollouts here, so equality with the ordinary layout is tested in the engine,
    on one batch: tests/integration/test_shared_prompt_engine_on_cpu.py.)"""
    import verl

    stock = Path(verl.__file__).parent / "trainer" / "config"
    overrides = ["algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.strategy=fsdp2",
                 "actor_rollout_ref.ref.strategy=fsdp2",
                 "actor_rollout_ref.actor._target_=hilore_verl.integration.HiLoReActorConfig",
                 "+actor_rollout_ref.actor.hilore.enable=true",
                 # the tiny CPU host (recipes/grpo/tiny_cpu.yaml sets the same)
                 "trainer.device=cpu", "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
                 "trainer.n_gpus_per_node=2", "trainer.nnodes=1", "trainer.total_training_steps=1",
                 "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.save_freq=-1",
                 "data.train_batch_size=4", "data.max_prompt_length=16", "data.max_response_length=4",
                 "data.dataloader_num_workers=0", "actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.rollout.n=2",
                 "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
                 "actor_rollout_ref.rollout.agent.num_workers=1", "reward.num_workers=1",
                 "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                 "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
                 "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
                 "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
                 "transfer_queue.backend.SimpleStorage.num_data_storage_units=1", "ray_kwargs.ray_init.num_cpus=16",
                 "reward.custom_reward_function.path=pkg://hilore_verl.tiny.task",
                 "reward.custom_reward_function.name=compute_score",
                 # the shared prompt's needs (docs/config.md): whole groups per rank, remove-padding
                 "actor_rollout_ref.actor.use_prefix_grouper=true", "actor_rollout_ref.model.use_remove_padding=true",
                 # every sequence trained: a first step whose rewards are all 0 would otherwise train only
                 # fillers of one sequence each, with nothing to share
                 "+actor_rollout_ref.actor.hilore.skip_zero_exposure=false"]
    rc, out, steps = main_ppo(tmp_path, task, *overrides, config_path=stock, config_name="ppo_trainer")
    assert rc == 0, out[-6000:]
    assert len(steps) == 1 and "actor/hilore/plan/budget_gib" in steps[0]["data"]
    assert "shared prompt off" not in out and "shared_prompt is off" not in out, out[-6000:]
    m = steps[0]["data"]
    assert m["actor/hilore/shared_prompt_on"] == 1.0
    # rollout.n=2: sharing a group's prompt P between responses R1, R2 computes P + R1 + R2 of 2P + R1 + R2
    # tokens, so the share lies in (1/2, 1) once any group shares (1: none did). Where it lands depends on the
    # sampled lengths and on ShareRule declining short prompts, both of which vary between rollouts here.
    assert 0.5 < m["actor/hilore/shared/token_share"] < 1.0, [line for line in out.splitlines() if "shared" in line]
    assert all(abs(m[k]) < float("inf") for k in ("actor/pg_loss", "actor/grad_norm", "critic/score/mean"))


def test_legacy_trainer_starting_without_a_loss_term_calibrates_later(tmp_path, task):
    """verl's legacy trainer (use_v1=false) on a run whose first step has no loss term anywhere (every response
    rewarded 0: a GRPO run's first steps on a hard task): the first step plans exactly with an uncalibrated
    risk model, the first mini-batch with a loss term calibrates it."""
    reward = REPO / "tests" / "harness" / "flat_start_reward.py"
    rc, out, steps = main_ppo(tmp_path, task, "actor_rollout_ref.actor.hilore.enable=true", "trainer.use_v1=false",
                              "trainer.total_training_steps=2", f"reward.custom_reward_function.path={reward}",
                              "+reward.custom_reward_function.reward_kwargs.flat_calls=64")  # step 1: 8 x 8
    assert rc == 0, out[-6000:]
    assert [s["step"] for s in steps] == [1, 2] and "actor/hilore/plan/budget_gib" in steps[0]["data"]
    first, second = (s["data"] for s in steps)
    assert first["critic/score/mean"] == 0.0 and first["actor/hilore/risk_calibrated"] == 0.0
    assert "the risk model is not calibrated" in out
    assert 0.0 < second["critic/score/mean"] < 1.0  # rewards that differ within groups from step 2
    assert second["actor/hilore/risk_calibrated"] == 1.0 and "risk model calibrated at step" in out
