"""`hilore-verl demo`: a short GRPO run on CPU through verl's FSDP2 engine, HiLoRe next to verl's GC.

Everything is embedded: a random tiny Qwen2-shaped policy with a 16-token vocabulary, and a
verifiable toy task. Prompt `BOS d1 d2 d3 d4 SEP` (digits); a response is correct when its first
token is d1 (exact match, reward 1, else 0). Per step, on each of 2 gloo ranks:

  rollout      HF `generate` (sampling) from a full copy of the policy, G responses per prompt
  old log-p    the same copy (on-policy: the PPO ratio starts at 1)
  advantages   verl's GRPO estimator (`compute_grpo_outcome_advantage`)
  update       verl's FSDP2 engine `train_batch` with verl's `ppo_loss` (one mini-batch)

Each arm (HiLoRe, then verl's full gradient checkpointing) runs in fresh rank processes from the
same seed, so the physical peak (process peak RSS) belongs to that arm alone (both load the codec's
compiled code first). Step 1 of HiLoRe includes its one-time profiling and calibration, reported
against GC's mean update; the mean update time excludes step 1 for both.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import resource
import tempfile
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
import torch.distributed as dist

PAD, BOS, SEP, EOS = 0, 1, 2, 3
DIGITS = torch.arange(4, 14)  # ten digit tokens
VOCAB = 16


@dataclass(frozen=True)
class DemoConfig:
    steps: int = 12
    """GRPO steps per arm."""
    prompts_per_rank: int = 8
    """Prompts each of the 2 ranks rolls out per step."""
    group_size: int = 8
    """Responses per prompt (GRPO's G)."""
    max_response_len: int = 12
    """Longest response; generation stops at EOS."""
    hidden_size: int = 128
    num_layers: int = 4
    micro_batch_size: int = 16
    """Sequences per micro-batch on each rank."""
    lr: float = 1e-2
    seed: int = 0
    hilore: dict = field(default_factory=lambda: {"enable": True, "risk_budget": 0.01, "min_bytes": 4096,
                                                  "budget": {"mode": "gc_ratio", "value": 1.10},
                                                  "audit_every": 5})
    """The `hilore:` section for the HiLoRe arm (docs/config.md)."""


def save_policy(path: str, config: DemoConfig) -> str:
    from hilore_verl.tiny_models import save_tiny_model

    return save_tiny_model(path, "qwen2", seed=config.seed, vocab_size=VOCAB, hidden_size=config.hidden_size,
                           intermediate_size=2 * config.hidden_size, num_hidden_layers=config.num_layers,
                           max_position_embeddings=64)


def make_prompts(n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, 6) prompts `BOS d1 d2 d3 d4 SEP` and the answers d1."""
    digits = DIGITS[torch.randint(0, 10, (n, 4), generator=generator)]
    prompts = torch.cat([torch.full((n, 1), BOS), digits, torch.full((n, 1), SEP)], dim=1)
    return prompts, digits[:, 0]


def rollout(policy, prompts, answers, config: DemoConfig, seed: int) -> dict[str, torch.Tensor]:
    """Sample G responses per prompt; a mini-batch in verl's padded layout with rewards and log-probs."""
    G, R = config.group_size, config.max_response_len
    prompts = prompts.repeat_interleave(G, 0)
    answers = answers.repeat_interleave(G, 0)
    torch.manual_seed(seed)
    with torch.no_grad():
        out = policy.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=True, top_k=0,
                              max_new_tokens=R, eos_token_id=EOS, pad_token_id=PAD)
    responses = torch.nn.functional.pad(out[:, prompts.shape[1]:], (0, R - (out.shape[1] - prompts.shape[1])),
                                        value=PAD)
    ended = (responses == EOS).int()
    lengths = torch.where(ended.any(1), ended.argmax(1) + 1, torch.full_like(ended[:, 0], R))  # EOS included
    response_mask = (torch.arange(R)[None] < lengths[:, None]).long()
    responses = responses * response_mask
    reward = (responses[:, 0] == answers).float()
    input_ids = torch.cat([prompts, responses], dim=1)
    attention_mask = torch.cat([torch.ones_like(prompts), response_mask], dim=1)
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0) * attention_mask
    with torch.no_grad():
        logits = policy(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
        logp = torch.log_softmax(logits[:, prompts.shape[1] - 1:-1].float(), -1)
        old_log_probs = logp.gather(-1, responses[..., None]).squeeze(-1) * response_mask
    return {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
            "prompts": prompts, "responses": responses, "response_mask": response_mask,
            "old_log_probs": old_log_probs, "reward": reward, "lengths": lengths}


def grpo_advantages(reward: torch.Tensor, response_mask: torch.Tensor, group_size: int, offset: int) -> torch.Tensor:
    """verl's GRPO estimator on outcome rewards (the reward sits on each response's last token)."""
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    last = response_mask.sum(1) - 1
    token_rewards = torch.zeros(response_mask.shape, dtype=torch.float32)
    token_rewards[torch.arange(len(reward)), last] = reward
    index = np.array([offset + i // group_size for i in range(len(reward))], dtype=object)
    advantages, _ = compute_grpo_outcome_advantage(token_rewards, response_mask, index)
    return advantages


def _arm(rank: int, world_size: int, arm: str, model_dir: str, config: DemoConfig) -> dict:
    from transformers import AutoModelForCausalLM

    from hilore_verl import kernels
    from hilore_verl.integration.engine import actor_config, build_fsdp_engine, ppo_loss_fn, to_engine_batch
    from hilore_verl.integration.hilore_engine import HiLoReFSDPEngine

    logging.getLogger("hilore_verl").setLevel(logging.ERROR if rank else logging.WARNING)
    kernels.warm_up()  # both arms hold the codec's compiled code: peak RSS compares what the updates hold
    extra = {"engine_cls": HiLoReFSDPEngine, "hilore": config.hilore} if arm == "hilore" else {}
    with contextlib.redirect_stdout(io.StringIO()):  # verl prints its model set-up; the demo prints steps
        engine = build_fsdp_engine(model_dir, gradient_checkpointing=True, lr=config.lr, clip_grad=1.0,
                                   micro_batch_size_per_gpu=config.micro_batch_size,
                                   total_training_steps=config.steps, **extra)
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    loss_fn = ppo_loss_fn(actor_config(loss_agg_mode="token-mean"))
    data_rng = torch.Generator().manual_seed(config.seed * 7919 + rank)
    global_batch = world_size * config.prompts_per_rank * config.group_size
    steps = []
    for step in range(1, config.steps + 1):
        full = {n: p.full_tensor() for n, p in engine.module.named_parameters()}  # weights to the rollout copy
        policy.load_state_dict(full, strict=False)
        prompts, answers = make_prompts(config.prompts_per_rank, data_rng)
        batch = rollout(policy, prompts, answers, config, seed=config.seed * 100003 + step * 101 + rank)
        batch["advantages"] = grpo_advantages(batch["reward"], batch["response_mask"], config.group_size,
                                              offset=rank * config.prompts_per_rank)
        td = to_engine_batch(batch, micro_batch_size_per_gpu=config.micro_batch_size, global_batch_size=global_batch)
        dist.barrier()
        start = time.perf_counter()
        with engine.train_mode():
            out = engine.train_batch(td, loss_function=loss_fn)
        dist.barrier()
        seconds = time.perf_counter() - start
        stats = torch.tensor([batch["reward"].sum(), batch["reward"].numel(), batch["lengths"].float().mean()])
        dist.all_reduce(stats)
        record = {"step": step, "reward": float(stats[0] / stats[1]), "update_s": seconds,
                  "response_len": float(stats[2] / world_size),
                  "plan": _plan_summary(engine) if arm == "hilore" else "full recompute (verl GC)"}
        if arm == "hilore":
            metrics = out["metrics"]
            record["predicted_peak_gib"] = metrics["hilore/plan/predicted_peak_gib"][0]
            record["budget_gib"] = metrics["hilore/plan/budget_gib"][0]
        steps.append(record)
        if rank == 0:
            print(f"[{arm:>6}] step {step:2d}/{config.steps}  reward {record['reward']:.3f}  "
                  f"update {seconds:6.3f} s  {record['plan']}", flush=True)
    peak = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20], dtype=torch.float64)  # GiB
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return {"arm": arm, "steps": steps, "peak_rss_gib": float(peak)}


def _plan_summary(engine) -> str:
    counts: dict[str, int] = {}
    for choice in engine.controller.history[-1].plan.values():
        counts[choice] = counts.get(choice, 0) + 1
    return " ".join(f"{mode}:{n}" for mode, n in sorted(counts.items()))


@dataclass
class DemoResult:
    config: DemoConfig
    arms: dict[str, dict]

    def mean_update_s(self, arm: str) -> float:
        times = [s["update_s"] for s in self.arms[arm]["steps"][1:]] or [self.arms[arm]["steps"][0]["update_s"]]
        return sum(times) / len(times)

    def table(self) -> str:
        names = list(self.arms)
        lines = ["step | " + " | ".join(f"reward {a:>6} | update s {a:>6}" for a in names)]
        for i in range(self.config.steps):
            row = [f"{self.arms[a]['steps'][i]['reward']:13.3f} | {self.arms[a]['steps'][i]['update_s']:15.3f}"
                   for a in names]
            lines.append(f"{i + 1:4d} | " + " | ".join(row))
        lines.append("")
        for a in names:
            lines.append(f"{a:>6}: mean update {self.mean_update_s(a):.3f} s (steps 2..{self.config.steps}), "
                         f"peak RSS {self.arms[a]['peak_rss_gib']:.2f} GiB per rank, "
                         f"final reward {self.arms[a]['steps'][-1]['reward']:.3f}")
        if {"hilore", "gc"} <= set(names):
            last = self.arms["hilore"]["steps"][-1]
            lines.append(f"HiLoRe / GC actor-update time: {self.mean_update_s('hilore') / self.mean_update_s('gc'):.3f}"
                         f"; last plan {last['plan']}; predicted peak {last['predicted_peak_gib'] * 1024:.2f} MiB "
                         f"of a {last['budget_gib'] * 1024:.2f} MiB budget")
            first = self.arms["hilore"]["steps"][0]["update_s"]
            lines.append(f"HiLoRe's first step (profiling, calibration, one update): {first:.3f} s = "
                         f"{first / self.mean_update_s('gc'):.2f}x GC's mean update (target <= 3); peak RSS "
                         f"{self.arms['hilore']['peak_rss_gib'] / self.arms['gc']['peak_rss_gib']:.3f}x GC's")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"config": asdict(self.config), "arms": self.arms}


def run_demo(config: DemoConfig = DemoConfig(), arms: tuple[str, ...] = ("hilore", "gc")) -> DemoResult:
    from hilore_verl.integration.launch import run_on_ranks

    bad = [a for a in arms if a not in ("hilore", "gc")]
    if bad:
        raise ValueError(f"unknown demo arm {bad[0]!r}; valid: hilore, gc")
    results = {}
    with tempfile.TemporaryDirectory(prefix="hilore-demo-") as tmp:
        model_dir = save_policy(os.path.join(tmp, "policy"), config)
        for arm in arms:
            results[arm] = run_on_ranks(_arm, 2, args=(arm, model_dir, config), timeout_s=1800)[0]
    return DemoResult(config, results)
