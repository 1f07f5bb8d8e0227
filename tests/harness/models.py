"""A training-shaped forward/backward of a tiny causal LM on a synthetic GRPO batch (plain PyTorch)."""

from __future__ import annotations

import torch

from hilore_verl.tiny.workload import GRPOWorkload, make_grpo_batch, response_log_probs

WORKLOAD = GRPOWorkload(num_groups=2, group_size=4, max_prompt_len=24, max_response_len=72)


def policy_gradient_step(model, batch=None, seed: int = 0):
    """Loss = -(weights * log p(response)) summed: a GRPO-like gradient. Returns (loss, {param: grad})."""
    batch = batch if batch is not None else make_grpo_batch(WORKLOAD, seed=0)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # dropout, if the config has any
    logp = response_log_probs(model, batch)
    weights = torch.randn(logp.shape, generator=torch.Generator().manual_seed(1)) * batch["response_mask"]
    loss = -(logp * weights).sum() / batch["response_mask"].sum()
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def flat(grads: dict) -> torch.Tensor:
    return torch.cat([g.flatten().double() for g in grads.values()])


def cosine_and_rel_error(grads, ref) -> tuple[float, float]:
    a, b = flat(grads), flat(ref)
    return (torch.dot(a, b) / (a.norm() * b.norm())).item(), ((a - b).norm() / b.norm()).item()


def surrogate_gradient(model, runtime, batch, c, plan) -> torch.Tensor:
    """The policy gradient sum_t c_t grad log p_t under `plan`, flattened (c: loss coefficients)."""
    runtime.set_plan(plan)
    model.zero_grad(set_to_none=True)
    (response_log_probs(model, batch) * c).sum().backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])
