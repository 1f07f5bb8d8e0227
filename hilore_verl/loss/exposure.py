"""Policy-update exposure: which tokens (and so which activations) the parameter update can feel.

GRPO's gradient is sum_t c_t * grad log p(token t), with c_t = dL/dlog_prob_t known before
backward. An approximation of a unit's activations reaches the update only through tokens with
c_t != 0, weighted by |c_t|: that is its exposure. Tokens of zero-advantage groups, fully clipped
tokens and padding have c_t = 0 (without KL or entropy terms) and no exposure at all.

The coefficients themselves come from verl's own loss (`hilore_verl.integration.actor.loss.loss_coefficients`,
which also pads and checks verl's inputs); this module never imports verl.

Entropy bonus. It acts on the logits, not through log_prob, so it is not in c. Its gradient on
token t's logits is -entropy_coeff * w_t * dH_t/dz with |dH/dz|_1 = sum_i p_i |log p_i + H| <= 2 H
<= 2 ln V (V: vocabulary size), w_t the aggregation weight. `summarize` adds that bound per token
when given `entropy_coeff` and `vocab_size`: exposure stays an upper bound, never an undercount.
`integration.actor.loss.actor_exposure` takes the coefficient and the aggregation mode from verl's actor config (what the
engine plans with): a zero-advantage micro-batch still has exposure under an entropy bonus.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch


def read_floats(values: Sequence[float | torch.Tensor]) -> list[float]:
    """Numbers as Python floats; the tensors among them (0-d, on one device) read in one transfer."""
    tensors = [v.detach().reshape(()).to(torch.float64) for v in values if isinstance(v, torch.Tensor)]
    read = iter(torch.stack(tensors).tolist() if tensors else [])
    return [next(read) if isinstance(v, torch.Tensor) else float(v) for v in values]


@dataclass
class Exposure:
    token: torch.Tensor  # (B, T) |c_t| (+ entropy bound), zero outside the response mask

    def l2_tensor(self, rows: slice | torch.Tensor | None = None) -> torch.Tensor:
        """sqrt(sum of token^2) over the given sequences (all by default): the scale of a random per-token
        error's effect on the update, as a 0-d tensor on the exposure's device: nothing is read until the
        caller reads it."""
        sel = self.token if rows is None else self.token[rows]
        return sel.pow(2).sum().sqrt()

    def l2_of(self, rows: slice | torch.Tensor | None = None) -> float:
        """`l2_tensor` as a Python float."""
        return float(self.l2_tensor(rows))


def summarize(c: torch.Tensor, response_mask: torch.Tensor, entropy_coeff: float = 0.0,
              entropy_weights: torch.Tensor | None = None, vocab_size: int | None = None) -> Exposure:
    """Exposure per token: |c_t| on response tokens, 0 elsewhere.

    With `entropy_coeff` != 0, pass the aggregation weights (`integration.loss.aggregation_weights`)
    and `vocab_size`: each token gets |entropy_coeff| * w_t * 2 ln V on top of |c_t|.
    """
    mask = response_mask.to(c.dtype)
    token = c.abs() * mask
    if entropy_coeff:
        if entropy_weights is None or vocab_size is None:
            raise ValueError("entropy_weights and vocab_size are required when entropy_coeff != 0")
        token = token + abs(entropy_coeff) * entropy_weights.abs() * 2 * math.log(vocab_size) * mask
    return Exposure(token)

