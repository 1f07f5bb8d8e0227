"""The benchmark's actor update: a Qwen2-shaped policy, a GRPO mini-batch, forward + backward + AdamW.

The loss is the GRPO policy gradient at the on-policy point in verl's token-mean form,

    L = -sum_t A_t * log p_t / N_tokens        (dL/dlog p_t = c_t = -A_t / N: verl's ppo_loss at ratio 1)

so its gradient is the actor update's. On CUDA the model runs in bf16 (Triton codecs); on the CPU in
fp32 (torch reference codecs). Sizes follow docs/design.md's realism rules: static memory
(fp32 weights, grads and two Adam moments: 16 bytes per parameter) about half of the full-GC peak,
the vocabulary head a GPU-like share of the FLOPs, and GC's overhead over no GC printed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from hilore_verl.tiny_models import build_tiny_model
from hilore_verl.workload import GRPOWorkload, make_grpo_batch


@dataclass(frozen=True)
class BenchConfig:
    hidden_size: int = 768
    """Model width (Qwen2 shape; intermediate = 8/3 x hidden rounded to 64)."""
    num_layers: int = 4
    vocab_size: int = 4000
    num_groups: int = 2
    """Prompts per mini-batch."""
    group_size: int = 8
    """Responses per prompt (GRPO's G)."""
    max_prompt_len: int = 32
    max_response_len: int = 64
    zero_advantage_share: float = 0.5
    """Share of groups whose responses all got the same reward (zero advantage)."""
    rounds: int = 3
    """Timed steps per method (after one warm-up step), taken round-robin over the methods."""
    seed: int = 0
    model: str | None = None
    """A preset or HF model directory: its architecture (random weights) instead of the Qwen2 shape above."""

    @property
    def intermediate_size(self) -> int:
        return int(round(self.hidden_size * 8 / 3 / 64)) * 64

    @property
    def num_heads(self) -> int:  # head_dim 64
        return max(1, self.hidden_size // 64)

    @property
    def num_kv_heads(self) -> int:  # grouped-query attention, 3 query heads per key/value head
        return max(1, self.num_heads // 3)

    def to_dict(self) -> dict:
        return {**asdict(self), "intermediate_size": self.intermediate_size, "num_heads": self.num_heads,
                "num_kv_heads": self.num_kv_heads}


def device() -> torch.device:
    """CUDA when present (bf16 weights, Triton codecs), else the CPU (fp32, torch reference codecs)."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def dtype() -> torch.dtype:
    return torch.bfloat16 if device().type == "cuda" else torch.float32


def build_model(config: BenchConfig) -> torch.nn.Module:
    if config.model is not None:
        from transformers import AutoModelForCausalLM

        from hilore_verl.presets import load_config

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.seed)
            model = AutoModelForCausalLM.from_config(load_config(config.model), dtype=dtype(),
                                                     attn_implementation="sdpa")
    else:
        model = build_tiny_model("qwen2", seed=config.seed, dtype=dtype(), hidden_size=config.hidden_size,
                                 intermediate_size=config.intermediate_size, num_hidden_layers=config.num_layers,
                                 num_attention_heads=config.num_heads, num_key_value_heads=config.num_kv_heads,
                                 vocab_size=config.vocab_size, max_position_embeddings=4096)
    return model.to(device()).train()


def make_batch(config: BenchConfig) -> dict[str, torch.Tensor]:
    workload = GRPOWorkload(num_groups=config.num_groups, group_size=config.group_size,
                            max_prompt_len=config.max_prompt_len, max_response_len=config.max_response_len,
                            zero_advantage_share=config.zero_advantage_share, vocab_size=config.vocab_size)
    return {k: v.to(device()) for k, v in make_grpo_batch(workload, seed=config.seed).items()}


def coefficients(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """c_t = dL/dlog p_t of the token-mean GRPO loss at the on-policy point: -A_t / N_tokens."""
    mask = batch["response_mask"].float()
    return -batch["advantages"] * mask / mask.sum()


def response_log_probs(logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """(B, R) log-probabilities of the response tokens (the vocabulary-sized part of the step)."""
    R = batch["responses"].shape[1]
    logp = torch.log_softmax(logits[:, -R - 1:-1].float(), dim=-1)
    return logp.gather(-1, batch["responses"][..., None]).squeeze(-1)


def loss_of(model: torch.nn.Module, batch: dict[str, torch.Tensor], c: torch.Tensor, head=None) -> torch.Tensor:
    """Forward: the surrogate sum_t c_t log p_t; `head(fn, *args)` runs the log-prob part (a runtime's unit)."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   position_ids=batch["position_ids"], use_cache=False).logits
    logp = head(response_log_probs, logits, batch) if head is not None else response_log_probs(logits, batch)
    return (logp * c).sum()


def static_bytes(model: torch.nn.Module) -> int:
    """Weights + grads + two AdamW moments, in the weights' dtype (fp32 here: 16 bytes per parameter)."""
    return sum(4 * p.numel() * p.element_size() for p in model.parameters())


def head_flop_share(model: torch.nn.Module) -> float:
    """The vocabulary projection's share of the forward matmul FLOPs (2 x weights per token each)."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    head = model.get_output_embeddings()
    return head.weight.numel() / sum(m.weight.numel() for m in linears)
