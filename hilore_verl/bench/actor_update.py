"""The benchmark's actor update: a Qwen2-shaped policy, a GRPO mini-batch, forward + backward + AdamW.

The loss is the GRPO policy gradient at the on-policy point in verl's token-mean form,

    L = -sum_t A_t * log p_t / N_tokens        (dL/dlog p_t = c_t = -A_t / N: verl's ppo_loss at ratio 1)

so its gradient is the actor update's. Shaped like a verl GPU job:

- precision: on the CPU fp32 weights, gradients and AdamW state with bf16 autocast activations
  (verl's FSDP mixed precision); on CUDA bf16 weights (Triton codecs), with `master_fp32` stepped by
  AdamW on fp32 master copies (`MasterAdamW`);
- layout: the sequences packed into one row with restarting position ids (verl's
  use_remove_padding), so no token is padding; `pack=False` gives verl's left-right padded
  layout, refused when more than 20% of its tokens are padding;
- size: static memory (16 bytes per parameter) at most 60% of GC's peak, GC's overhead over no
  GC 20-33%, the vocabulary head a GPU-like share of the FLOPs; all printed, out-of-range
  proportions refused or flagged by `hilore-verl bench`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from hilore_verl.shared_prompt import (ATTENTION_NAME, LAYOUT_KWARG, SharedLayout, ShareRule, install,
                                       shared_layout, shared_token_count)
from hilore_verl.tiny.models import build_tiny_model
from hilore_verl.tiny.workload import GRPOWorkload, make_grpo_batch


MAX_PADDING_SHARE = 0.20  # of the batch's token positions


@dataclass(frozen=True)
class BenchConfig:
    hidden_size: int = 512
    """Model width (Qwen2 shape; intermediate = 8/3 x hidden rounded to 64)."""
    num_layers: int = 4
    vocab_size: int = 4000
    num_groups: int = 4
    """Prompts per mini-batch."""
    group_size: int = 8
    """Responses per prompt (GRPO's G)."""
    max_prompt_len: int = 64
    max_response_len: int = 192
    zero_advantage_share: float = 0.5
    """Share of groups whose responses all got the same reward (zero advantage)."""
    kl_coef: float = 0.0
    """KL loss coefficient: the k1 estimator's gradient, kl_coef / N, on every response token's coefficient
    (0: no KL loss, so zero-advantage sequences have no loss term)."""
    rounds: int | None = None
    """A fixed count of paired rounds per set (no target, no cap); None: rounds until `target_ci`."""
    min_rounds: int = 3
    """Rounds every paired set runs before its stop is weighed (bench/rounds.py)."""
    target_ci: float = 0.02
    """Stop a set when every 95% interval of a throughput over GC's is within +- this share of the ratio."""
    time_cap_s: float = 900.0
    """Seconds of timed rounds for the methods' set (bench/rounds.py, `StopRule.time_cap_s`)."""
    sweep_time_cap_s: float = 300.0
    """Seconds of timed rounds shared equally by the sweep's budgets."""
    candidates: int = 4
    """Runner-ups of HiLoRe's plan run beside it at each budget of the sweep (planner/ranking.py), plus
    keep / recompute's plan where it differs; 0: none."""
    seed: int = 0
    model: str | None = None
    """A preset or HF model directory: its architecture (random weights) instead of the Qwen2 shape above."""
    pack: bool = True
    """Pack the sequences into one row (no padding), as verl's use_remove_padding; False: left-right padded."""
    autocast: bool = True
    """CPU: bf16 autocast over fp32 weights (False: fp32 throughout). CUDA runs bf16 weights either way."""
    profile_tokens: int = 2048
    """The planners' probe bound, as hilore.profile_tokens (and at most 1/8 of the step's tokens)."""
    model_layers: int | None = None
    """With `model`: keep only its first this many decoder layers (None: all of them)."""
    per_sequence_attention: bool = False
    """Every method's attention per packed sequence (the shared-prompt implementation with nothing shared,
    what a GPU's varlen kernel computes) instead of SDPA over the whole row under a block-diagonal mask,
    which on the CPU computes every pair of the row. Set by `--shared-prompt`, so that its rows differ only
    in the sharing."""
    master_fp32: bool = False
    """CUDA: bf16 weights and gradients for compute, AdamW on fp32 master copies with fp32 moments (verl's
    FSDP2 mixed precision on one rank) instead of AdamW on the bf16 weights themselves."""

    @property
    def intermediate_size(self) -> int:
        return max(1, round(self.hidden_size * 8 / 3 / 64)) * 64

    @property
    def num_heads(self) -> int:  # head_dim 64 where the hidden size allows: the most heads <= hidden / 64 dividing it
        return next(h for h in range(max(1, self.hidden_size // 64), 0, -1) if self.hidden_size % h == 0)

    @property
    def num_kv_heads(self) -> int:  # grouped-query attention: about 3 query heads per key/value head, dividing them
        return next(k for k in range(max(1, self.num_heads // 3), 0, -1) if self.num_heads % k == 0)

    def to_dict(self) -> dict:
        return {**asdict(self), "intermediate_size": self.intermediate_size, "num_heads": self.num_heads,
                "num_kv_heads": self.num_kv_heads}


def device() -> torch.device:
    """CUDA when present (bf16 weights, Triton codecs), else the CPU (fp32 weights, fused CPU codecs)."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def dtype(config: BenchConfig | None = None) -> torch.dtype:
    return torch.bfloat16 if device().type == "cuda" else torch.float32


def forward_context(config: BenchConfig):
    """What the forward runs under: bf16 autocast on the CPU (verl's mixed precision), else nothing."""
    enabled = config.autocast and device().type == "cpu"
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled)


class MasterAdamW:
    """AdamW on fp32 master copies of low-precision weights: after backward each gradient is widened
    into its master's, the master steps, and the weight takes the master's value rounded back. What
    verl's FSDP2 mixed precision does on one rank (bf16 compute; fp32 weights, gradients, moments)."""

    def __init__(self, params, lr: float):
        self.params = list(params)
        self.master = [torch.nn.Parameter(p.detach().float().clone()) for p in self.params]
        self.inner = torch.optim.AdamW(self.master, lr=lr)

    @property
    def param_groups(self):
        return self.inner.param_groups

    @property
    def state(self):
        return self.inner.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None
        self.inner.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(self) -> None:
        for p, m in zip(self.params, self.master):
            m.grad = None if p.grad is None else p.grad.float()
        self.inner.step()
        for p, m in zip(self.params, self.master):
            p.copy_(m)
            m.grad = None


def make_optimizer(model: torch.nn.Module, config: BenchConfig):
    """AdamW as the bench steps it: on fp32 master copies when `master_fp32` and the weights are not fp32."""
    low = next(model.parameters()).dtype != torch.float32
    if config.master_fp32 and low:
        return MasterAdamW(model.parameters(), lr=1e-6)
    return torch.optim.AdamW(model.parameters(), lr=1e-6)


def build_model(config: BenchConfig, where: torch.device | str | None = None) -> torch.nn.Module:
    """The policy, initialised on `where` (default: the device it trains on; "meta": shapes only)."""
    where = torch.device(where) if where is not None else device()
    if config.model is not None:
        from transformers import AutoModelForCausalLM

        from hilore_verl.presets import load_config

        hf_config = load_config(config.model)
        if config.model_layers is not None:
            hf_config.num_hidden_layers = min(config.model_layers, hf_config.num_hidden_layers)
            if isinstance(getattr(hf_config, "layer_types", None), list):
                hf_config.layer_types = hf_config.layer_types[:hf_config.num_hidden_layers]
        with torch.random.fork_rng(devices=[]), where:  # initialised where it trains
            torch.manual_seed(config.seed)
            model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype(config), attn_implementation="sdpa")
    else:
        with where if where.type == "meta" else torch.device("cpu"):
            model = build_tiny_model("qwen2", seed=config.seed, dtype=dtype(config), hidden_size=config.hidden_size,
                                     intermediate_size=config.intermediate_size, num_hidden_layers=config.num_layers,
                                     num_attention_heads=config.num_heads, num_key_value_heads=config.num_kv_heads,
                                     vocab_size=config.vocab_size, max_position_embeddings=4096)
    if config.per_sequence_attention and where.type != "meta":
        install(model)
    return model if where.type == "meta" else model.to(where).train()


def make_batch(config: BenchConfig) -> dict[str, torch.Tensor]:
    """Model inputs (`input_ids`, `position_ids`, and `attention_mask` when padded) and, per response
    token, where its log-probability is read (`logit_index` into the flattened logits), the token
    (`targets`) and its loss coefficient (`coef`); `tokens`: real tokens, `positions`: all positions."""
    workload = GRPOWorkload(num_groups=config.num_groups, group_size=config.group_size,
                            max_prompt_len=config.max_prompt_len, max_response_len=config.max_response_len,
                            min_prompt_len=max(1, config.max_prompt_len // 2),
                            zero_advantage_share=config.zero_advantage_share, vocab_size=config.vocab_size)
    padded = make_grpo_batch(workload, seed=config.seed)
    mask = padded["attention_mask"].bool()
    B, S = mask.shape
    R = padded["responses"].shape[1]
    resp = padded["response_mask"].bool()
    # the logit predicting response token j of row b sits at position S - R - 1 + j of that row
    rows, cols = resp.nonzero(as_tuple=True)
    source = rows * S + (S - R - 1) + cols
    # c_t = dL/dlog p_t of the token-mean loss, -A_t / N, plus the k1 KL term's kl_coef / N
    c = (config.kl_coef * resp - padded["advantages"]) / resp.sum()
    batch = {"targets": padded["responses"][rows, cols], "coef": c[rows, cols].float(), "target_seq": rows,
             "seq_lens": mask.sum(-1), "prompt_lens": mask[:, :S - R].sum(-1), "tokens": mask.sum(),
             "positions": torch.tensor(mask.numel()),
             "zero_advantage": ~((padded["advantages"] != 0) & resp).any(-1),  # (B,) what verl's open PRs drop
             "zero_coef": ~((c != 0) & resp).any(-1)}  # (B,) no loss term at all: what HiLoRe skips
    if config.pack:  # valid tokens in one row; a packed position's index is its rank among the valid ones
        rank = torch.full((B * S,), -1, dtype=torch.long)
        rank[mask.view(-1)] = torch.arange(int(mask.sum()))
        batch.update(input_ids=padded["input_ids"][mask][None], position_ids=padded["position_ids"][mask][None],
                     logit_index=rank[source], positions=mask.sum())
    else:
        batch.update(input_ids=padded["input_ids"], position_ids=padded["position_ids"],
                     attention_mask=padded["attention_mask"], logit_index=source)
    return {k: v.to(device()) for k, v in batch.items()}


def probe_batch(batch: dict[str, torch.Tensor], index: list[int]) -> dict[str, torch.Tensor]:
    """The batch restricted to sequences `index` (ascending), packed or padded as it was."""
    idx = torch.as_tensor(index, device=batch["seq_lens"].device)
    keep = torch.isin(batch["target_seq"], idx)  # response tokens of the chosen sequences
    new_seq = torch.full((len(batch["seq_lens"]),), -1, dtype=torch.long, device=idx.device)
    new_seq[idx] = torch.arange(len(idx), device=idx.device)
    out = {"targets": batch["targets"][keep], "coef": batch["coef"][keep],
           "target_seq": new_seq[batch["target_seq"][keep]], "seq_lens": batch["seq_lens"][idx],
           "tokens": batch["seq_lens"][idx].sum(), "prompt_lens": batch["prompt_lens"][idx]}
    out.update({k: batch[k][idx] for k in ("zero_advantage", "zero_coef") if k in batch})
    if "attention_mask" in batch:  # padded rows: logit index = row * S + column
        S = batch["input_ids"].shape[1]
        out.update({k: batch[k][idx] for k in ("input_ids", "position_ids", "attention_mask")})
        li = batch["logit_index"][keep]
        out.update(logit_index=new_seq[li // S] * S + li % S, positions=torch.tensor(len(idx) * S))
    else:  # one packed row, sequences in order: keep their tokens, re-rank the logit indices
        sequences = torch.arange(len(batch["seq_lens"]), device=idx.device)
        seq_of_token = torch.repeat_interleave(sequences, batch["seq_lens"])
        tok = torch.isin(seq_of_token, idx)
        rank = torch.cumsum(tok, 0) - 1
        out.update(input_ids=batch["input_ids"][:, tok], position_ids=batch["position_ids"][:, tok],
                   logit_index=rank[batch["logit_index"][keep]], positions=out["tokens"])
    return out


def tokens_of(batch: dict[str, torch.Tensor]) -> int:
    return int(batch["tokens"])


def padding_share(batch: dict[str, torch.Tensor]) -> float:
    return 1.0 - int(batch["tokens"]) / int(batch["positions"])


def coefficients(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """c_t = dL/dlog p_t of the token-mean GRPO loss at the on-policy point: -A_t / N_tokens (per response token)."""
    return batch["coef"]


def indexed_log_probs(logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """(N,) log-probabilities of the response tokens, read at `logit_index` of the flattened logits (the
    vocabulary-sized part of the step; hilore_verl.tiny.workload.response_log_probs reads verl's padded rows)."""
    rows = logits.reshape(-1, logits.shape[-1])[batch["logit_index"]]
    return torch.log_softmax(rows.float(), dim=-1).gather(-1, batch["targets"][:, None]).squeeze(-1)


def shared_inputs(batch: dict[str, torch.Tensor], share: bool = True,
                  rule: ShareRule | None = None) -> tuple[dict, dict[str, torch.Tensor]]:
    """A packed batch in the shared-prompt layout (hilore_verl/shared_prompt/): sequences with equal prompt
    tokens share one prompt (`share` false: every sequence its own segment, the ordinary row attended per
    sequence). Returns (the model's inputs, the batch with `logit_index` into the layout's row)."""
    layout = SharedLayout.build(_sequences(batch, share), device=batch["input_ids"].device, rule=rule)
    inputs = {"input_ids": layout.input_ids, "position_ids": layout.position_ids, LAYOUT_KWARG: layout}
    return inputs, dict(batch, logit_index=layout.unshared_index[batch["logit_index"]])


def _sequences(batch: dict[str, torch.Tensor], share: bool) -> list:
    """(prompt key or None, prompt ids [P], response ids [R]) per sequence of a packed batch."""
    if "attention_mask" in batch:
        raise ValueError("the shared-prompt layout needs the packed batch (drop --no-pack)")
    row, sequences, start = batch["input_ids"][0], [], 0
    for length, prompt_len in zip(batch["seq_lens"].tolist(), batch["prompt_lens"].tolist()):
        tokens = row[start:start + length]
        key = tuple(tokens[:prompt_len].tolist()) if share else None
        sequences.append((key, tokens[:prompt_len], tokens[prompt_len:]))
        start += length
    return sequences


def layer_tokens(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> int:
    """Tokens the model's layers compute for `batch`: its packed tokens, or the shared layout's row where
    the model computes each group's prompt once (bench *_shared); what its planner sizes a step by."""
    if not (is_shared(model) and getattr(model, SHARE_ATTRIBUTE, False)):
        return tokens_of(batch)
    return shared_token_count([(key, p.numel(), r.numel()) for key, p, r in _sequences(batch, True)],
                              ShareRule.of(model))


def head_rows(batch: dict[str, torch.Tensor]) -> int:
    """Rows the head's log-prob code computes for `batch`: its response tokens (`indexed_log_probs`)."""
    return int(batch["targets"].numel())


def is_shared(model: torch.nn.Module) -> bool:
    """Whether the model's attention is the shared-prompt implementation (shared_prompt.install)."""
    return str(model.config._attn_implementation).startswith(ATTENTION_NAME)


SHARE_ATTRIBUTE = "hilore_share_prompts"  # on a model: its groups' prompts are computed once (bench *_shared)


def loss_of(model: torch.nn.Module, batch: dict[str, torch.Tensor], c: torch.Tensor, head=None) -> torch.Tensor:
    """Forward: the surrogate sum_t c_t log p_t; `head(fn, *args)` runs the log-prob part (a runtime's unit).
    A model with the shared-prompt attention installed runs the batch in the shared layout."""
    if is_shared(model):
        inputs, batch = shared_inputs(batch, share=getattr(model, SHARE_ATTRIBUTE, False), rule=ShareRule.of(model))
        with shared_layout(inputs[LAYOUT_KWARG]):  # the layout is the mask: the model builds no [L, L] one
            logits = model(**inputs, use_cache=False).logits
    else:
        inputs = {k: batch[k] for k in ("input_ids", "position_ids", "attention_mask") if k in batch}
        logits = model(**inputs, use_cache=False).logits
    logp = head(indexed_log_probs, logits, batch) if head is not None else indexed_log_probs(logits, batch)
    return (logp * c).sum()


def static_bytes(model: torch.nn.Module, config: BenchConfig | None = None) -> int:
    """Weights + grads + two AdamW moments in the weights' dtype (fp32 here: 16 bytes per parameter); with
    fp32 master weights (`master_fp32`, low-precision weights) + the fp32 master and its two moments."""
    total = 0
    for p in model.parameters():
        n, e = p.numel(), p.element_size()
        master = config is not None and config.master_fp32 and p.dtype != torch.float32
        total += n * (2 * e + 12) if master else 4 * n * e
    return total


def head_flop_share(model: torch.nn.Module) -> float:
    """The vocabulary projection's share of the forward matmul FLOPs (2 x weights per token each)."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    head = model.get_output_embeddings()
    return head.weight.numel() / sum(m.weight.numel() for m in linears)
