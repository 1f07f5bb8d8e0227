"""`hilore-verl demo`: verl's own trainer (`main_ppo`) on a CPU recipe, HiLoRe next to verl's GC.

Each arm is one `python -m verl.trainer.main_ppo --config-path recipes/grpo --config-name demo_cpu`
run from the same seed (the demo task: a random 4-layer hidden-256 Qwen2 policy, prompts of 64-192
digits, answer with the first; `--recipe tiny_cpu`: the tests' tiny task), on 2 ranks through Ray,
generating with the plugin's `hf` rollout:

    hilore   actor_rollout_ref.actor.hilore.enable=true    (plans keep / compress / recompute)
    gc       actor_rollout_ref.actor.hilore.enable=false   (stock verl: full gradient checkpointing)

Per step it prints what verl's tracker logged (verl's file logger, one JSON line per step): the
reward (`critic/score/mean`), the actor update time (`timing_s/update_actor`) and HiLoRe's plan
(`actor/hilore/plan/*`), with the shares of tokens skipped and computed shared. Each arm's peak memory is the largest peak RSS (VmHWM) among its rank
processes (Ray's `WorkerDict` actors), read while the arm runs. HiLoRe's first actor call includes
its one-time profiling and the codec's compilation; the mean update time excludes step 1 in both arms.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

import psutil

from hilore_verl.measure import host_memory

ARMS = {"hilore": "true", "gc": "false"}
TASKS = {"demo_cpu": ("demo", ".demo_cpu"), "tiny_cpu": ("tiny", ".tiny_cpu")}  # recipe -> task shape, folder


@dataclass(frozen=True)
class DemoConfig:
    steps: int = 10
    """GRPO steps per arm."""
    seed: int = 0
    """verl's data shuffle seed and the rollout's sampling seed."""
    recipe: str = "demo_cpu"
    """The recipe both arms run: demo_cpu (the main job) or tiny_cpu (the tests' tiny task)."""
    recipe_dir: str = ""
    """Folder of the recipe's YAML (default: the repository's recipes/grpo)."""
    task_dir: str = ""
    """The task's folder (`hilore-verl tiny-task`; default .demo_cpu or .tiny_cpu); written first if missing."""
    overrides: tuple[str, ...] = field(default_factory=tuple)
    """Extra hydra overrides for both arms (e.g. `data.train_batch_size=16`)."""


def task_dir(config: DemoConfig) -> str:
    return config.task_dir or TASKS[config.recipe][1]


def default_recipe_dir() -> str:
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "recipes", "grpo")


def _rank_pids() -> list[int]:
    return [p.info["pid"] for p in psutil.process_iter(["pid", "cmdline"])
            if p.info["cmdline"] and p.info["cmdline"][0].startswith("ray::WorkerDict")]


def _vm_hwm_gib(pid: int) -> float:
    try:
        return host_memory.peak_resident_bytes(pid) / 2**30
    except (OSError, RuntimeError):
        return 0.0


class _PeakWatcher(threading.Thread):
    """The largest peak RSS among the rank processes, polled while an arm runs (VmHWM only grows)."""

    def __init__(self, period_s: float = 0.5):
        super().__init__(daemon=True)
        self.period_s, self.peak_gib, self.stop = period_s, 0.0, threading.Event()

    def run(self):
        while not self.stop.is_set():
            for pid in _rank_pids():
                self.peak_gib = max(self.peak_gib, _vm_hwm_gib(pid))
            self.stop.wait(self.period_s)


def step_record(step: int, metrics: dict) -> dict:
    """The demo's view of one step of verl's metrics."""
    plan = {key.rsplit("_", 1)[1]: int(v) for key, v in metrics.items()
            if key.startswith("actor/hilore/plan/units_")}
    record = {"step": step, "reward": metrics["critic/score/mean"], "update_s": metrics["timing_s/update_actor"],
              "step_s": metrics["timing_s/step"], "gen_s": metrics.get("timing_s/gen"),
              "response_length": metrics.get("response_length/mean"),
              "response_clip_ratio": metrics.get("response_length/clip_ratio"),
              "plan": " ".join(f"{m}:{n}" for m, n in sorted(plan.items())) or "full recompute (verl GC)"}
    for key in ("predicted_peak_gib", "budget_gib"):
        if f"actor/hilore/plan/{key}" in metrics:
            record[key] = metrics[f"actor/hilore/plan/{key}"]
    if "actor/hilore/skip/token_share" in metrics:  # tokens left out of the update (zero-exposure sequences)
        record["skipped_share"] = metrics["actor/hilore/skip/token_share"]
    if "actor/hilore/shared/token_share" in metrics:  # tokens the shared layout computed of the packed rows
        record["shared_share"] = metrics["actor/hilore/shared/token_share"]
    if "actor/hilore/shared_prompt_on" in metrics:
        record["shared_prompt_on"] = metrics["actor/hilore/shared_prompt_on"]
    if "actor/hilore/arm/baseline" in metrics:  # share of micro-batches on the measured hands-off baseline
        record["baseline_share"] = metrics["actor/hilore/arm/baseline"]
    return record


def arm_command(arm: str, config: DemoConfig) -> list[str]:
    recipe = os.path.abspath(config.recipe_dir or default_recipe_dir())
    task = os.path.abspath(task_dir(config))
    return [sys.executable, "-m", "verl.trainer.main_ppo", "--config-path", recipe, "--config-name", config.recipe,
            f"actor_rollout_ref.actor.hilore.enable={ARMS[arm]}", f"trainer.total_training_steps={config.steps}",
            "trainer.logger=[file]", f"trainer.experiment_name=demo_{arm}", f"data.seed={config.seed}",
            f"actor_rollout_ref.rollout.seed={config.seed}", f"actor_rollout_ref.model.path={task}/model",
            f"data.train_files={task}/train.parquet", f"data.val_files={task}/val.parquet", *config.overrides]


def run_arm(arm: str, config: DemoConfig, workdir: str, echo=print) -> dict:
    """One arm through `main_ppo`; its per-step records as verl logged them, and its peak memory."""
    log_path, out_path = os.path.join(workdir, f"{arm}.jsonl"), os.path.join(workdir, f"{arm}.log")
    # a fresh local Ray per arm, even where another Ray instance runs on this machine
    env = {**os.environ, "VERL_FILE_LOGGER_PATH": log_path, "HYDRA_FULL_ERROR": "1", "RAY_ADDRESS": "local"}
    watcher = _PeakWatcher()
    watcher.start()
    steps: list[dict] = []
    with open(out_path, "w") as out:
        proc = subprocess.Popen(arm_command(arm, config), stdout=out, stderr=subprocess.STDOUT, env=env,
                                cwd=os.getcwd())
        while True:
            done = proc.poll() is not None
            steps = _read_steps(log_path, steps, arm, config, echo)
            if done:
                break
            time.sleep(1.0)
    watcher.stop.set()
    watcher.join()
    if proc.returncode != 0 or len(steps) != config.steps:
        with open(out_path) as f:
            tail = f.read()[-4000:]
        raise RuntimeError(f"demo arm {arm!r}: main_ppo exited with {proc.returncode} after {len(steps)} of "
                           f"{config.steps} steps; its output ends:\n{tail}")
    return {"arm": arm, "steps": steps, "peak_rss_gib": watcher.peak_gib, "command": arm_command(arm, config)}


def _read_steps(path: str, steps: list[dict], arm: str, config: DemoConfig, echo) -> list[dict]:
    if not os.path.exists(path):
        return steps
    with open(path) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    for line in lines[len(steps):]:
        record = step_record(line["step"], line["data"])
        steps.append(record)
        skipped = f"  skipped {100 * record['skipped_share']:5.1f}% of tokens" if "skipped_share" in record else ""
        if "shared_share" in record:
            skipped += f", computed {100 * record['shared_share']:5.1f}% shared"
        echo(f"[{arm:>6}] step {record['step']:2d}/{config.steps}  reward {record['reward']:.3f}  "
             f"update {record['update_s']:6.3f} s{skipped}  {record['plan']}"
             + (" (hands-off baseline, measured faster)" if record.get("baseline_share") else ""))
    return steps


def recipe_line(config: DemoConfig) -> str:
    """What both arms train: the loss settings that decide what HiLoRe may skip, from the recipe as hydra
    composes it (the overrides applied)."""
    from omegaconf import OmegaConf

    recipe = os.path.abspath(config.recipe_dir or default_recipe_dir())
    layers = ["hilore_grpo.yaml", "cpu_host.yaml", f"{config.recipe}.yaml"]  # the recipe's defaults, in order
    actor = OmegaConf.merge(*(OmegaConf.load(os.path.join(recipe, name)) for name in layers),
                            OmegaConf.from_dotlist([o for o in config.overrides if "=" in o]))
    a = actor.actor_rollout_ref.actor
    loss = a.get("policy_loss", {}).get("loss_mode", "vanilla")
    kl = f"KL loss {a.kl_loss_coef} ({a.kl_loss_type})" if a.get("use_kl_loss") else "no KL loss"
    return (f"recipe {config.recipe}: GRPO, policy loss {loss}, {a.loss_agg_mode}, {kl}, entropy coefficient "
            f"{a.entropy_coeff}, {actor.actor_rollout_ref.rollout.n} responses per prompt, prompts up to "
            f"{actor.data.max_prompt_length} tokens, responses up to {actor.data.max_response_length}, both arms "
            f"from seed {config.seed}")


def run_demo(config: DemoConfig = DemoConfig(), arms: tuple[str, ...] = ("hilore", "gc"), echo=print):
    """Both arms in turn; returns their DemoResult (demo_report.py)."""
    from hilore_verl.integration.tools.demo_report import DemoResult
    from hilore_verl.tiny.task import make_tiny_task

    bad = [a for a in arms if a not in ARMS]
    if bad:
        raise ValueError(f"unknown demo arm {bad[0]!r}; valid: hilore, gc")
    if config.recipe not in TASKS:
        raise ValueError(f"unknown demo recipe {config.recipe!r}; valid: {', '.join(TASKS)}")
    make_tiny_task(task_dir(config), shape=TASKS[config.recipe][0])
    echo(recipe_line(config))
    results = {}
    with tempfile.TemporaryDirectory(prefix="hilore-demo-") as tmp:
        for arm in arms:
            echo(f"[{arm:>6}] {' '.join(arm_command(arm, config)[1:])}")
            results[arm] = run_arm(arm, config, tmp, echo)
    return DemoResult(config, results)
