"""GRPO / PPO loss coefficients c = dL/dlog_prob through verl's own actor loss (`ppo_loss`).

verl's `ppo_loss` is called as the engine calls it, on a synthetic no-padding layout built so that
its response slice is exactly `log_prob`; autograd with respect to that tensor alone gives c. No
model runs. Every registered policy-loss mode, aggregation mode, KL type and IS-weight setting is
therefore covered as verl defines it, including modes added later. The entropy bonus is not part
of c: it depends on the logits (see `hilore_verl.loss.exposure`). verl's loss inputs are padded and
checked here (`padded`, `check_inputs`, `check_values`: shapes, config, nan / inf in one read).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Mapping

import torch

import hilore_verl.integration  # noqa: F401  (version check first)
from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY
from verl.utils import tensordict_utils as tu
from verl.workers.utils.losses import ppo_loss

from hilore_verl.loss import exposure


def padded(name: str, t: torch.Tensor | None) -> torch.Tensor | None:
    """`t` as a padded tensor (a nested one padded with zeros; None stays None); `name` for the error."""
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
    return torch.nested.to_padded_tensor(t, 0.0) if t.is_nested else t


def check_inputs(log_prob, old_log_prob, advantages, response_mask, actor_config, rollout_is_weights, ref_log_prob,
                 values: bool = True):
    """Shapes and config (on the host); with `values`, also nan / inf on response tokens and negative
    IS weights: every flag is computed on the tensors' device and read in one transfer."""
    named = (("log_prob", log_prob), ("old_log_prob", old_log_prob), ("advantages", advantages),
             ("rollout_is_weights", rollout_is_weights), ("ref_log_prob", ref_log_prob))
    shape = response_mask.shape
    for name, t in named:
        if t is not None and t.shape != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, response_mask has {tuple(shape)}: they must agree")
    if getattr(actor_config, "use_kl_loss", False) and ref_log_prob is None:
        raise ValueError("ref_log_prob is required: the actor config has use_kl_loss=True")
    if values:
        check_values(response_mask, **{name: t for name, t in named if t is not None})


def check_values(response_mask: torch.Tensor, **tensors: torch.Tensor) -> None:
    """Raise ValueError if a tensor holds nan or inf on response tokens, or rollout_is_weights is
    negative there. Padded (B, T) tensors of one shape; one read of device data for all of them."""
    mask = response_mask.bool()
    flags, messages = [], []
    for name, t in tensors.items():
        flags.append((~torch.isfinite(t) & mask).any())
        messages.append(f"{name} holds nan or inf on response tokens: nothing is computed from it")
        if name == "rollout_is_weights":
            flags.append(((t < 0) & mask).any())
            messages.append("rollout_is_weights must be >= 0")
    if not flags:
        return
    for bad, message in zip(torch.stack(flags).tolist(), messages):
        if bad:
            raise ValueError(message)


def policy_loss_modes() -> list[str]:
    """The policy-loss modes registered in verl (`actor.policy_loss.loss_mode`)."""
    return sorted(POLICY_LOSS_REGISTRY)


def _private_config(actor_config, loss_scale_factor):
    """A copy for ppo_loss to write its global_batch_info into, with entropy switched off."""
    changes = {"global_batch_info": {}, "entropy_coeff": 0.0}
    if loss_scale_factor is not None:
        changes["loss_scale_factor"] = loss_scale_factor
    if dataclasses.is_dataclass(actor_config):
        return dataclasses.replace(actor_config, **changes)
    config = copy.deepcopy(actor_config)
    for key, value in changes.items():
        setattr(config, key, value)
    return config


def _ppo_coefficients(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor,
                      response_mask: torch.Tensor, actor_config: Any, rollout_is_weights: torch.Tensor | None = None,
                      ref_log_prob: torch.Tensor | None = None,
                      global_batch_info: Mapping[str, Any] | None = None) -> torch.Tensor:
    """c[b, t] = dL/dlog_prob[b, t] of verl's actor loss (without the entropy term), padded (B, T) inputs."""
    B, T = log_prob.shape
    info = dict(global_batch_info or {})
    lp = log_prob.detach().float().clone().requires_grad_(True)
    # layout: every sequence = 1 prompt token + T response tokens; ppo_loss reads the log-prob of
    # response token t at flat position b * (T + 1) + t (the model output is shifted by one token)
    values = torch.cat([lp, lp.new_zeros(B, 1)], dim=1).reshape(-1)
    device = lp.device  # built where the inputs live: no host-to-device copy per call
    fields = {
        "prompts": torch.zeros(B, 1, dtype=torch.long, device=device),
        "responses": torch.zeros(B, T, dtype=torch.long, device=device),
        "attention_mask": torch.ones(B, T + 1, dtype=torch.long, device=device),
        "response_mask": response_mask.to(torch.long),
        "old_log_probs": old_log_prob.detach().float(),
        "advantages": advantages.detach().float(),
    }
    if rollout_is_weights is not None:
        fields["rollout_is_weights"] = rollout_is_weights.detach().float()
    if ref_log_prob is not None:
        fields["ref_log_prob"] = ref_log_prob.detach().float()
    data = tu.get_tensordict({k: v.to(device) for k, v in fields.items()})
    tu.assign_non_tensor(data, dp_size=int(info.get("dp_size", 1)), batch_num_tokens=info.get("batch_num_tokens"),
                         global_batch_size=info.get("global_batch_size"))
    config = _private_config(actor_config, info.get("loss_scale_factor"))
    loss, _ = ppo_loss(config, {"log_probs": values}, data)
    (grad,) = torch.autograd.grad(loss, lp, allow_unused=True)
    return torch.zeros_like(lp) if grad is None else grad.detach()


def loss_coefficients(log_prob, old_log_prob, advantages, response_mask, actor_config, rollout_is_weights=None,
                      ref_log_prob=None, global_batch_info: Mapping[str, Any] | None = None,
                      check: bool = True) -> torch.Tensor:
    """c[b, t] = dL/dlog_prob[b, t] for verl's actor loss as configured (policy loss mode,
    loss_agg_mode, KL loss, IS weights); entropy excluded (see the module docstring).

    Tensors are padded (B, T) response-aligned, or jagged nested (one row per sequence) as in
    verl's no-padding batches. `global_batch_info`: dp_size, batch_num_tokens, global_batch_size,
    loss_scale_factor, as the engine sets them (omit for a single-rank, single-micro-batch view).
    `check=False` skips the value checks (`check_values`, one read of device data) of inputs already
    checked; shapes and config are checked either way.
    """
    log_prob, old_log_prob, advantages, response_mask, rollout_is_weights, ref_log_prob = (
        padded(n, t) for n, t in (("log_prob", log_prob), ("old_log_prob", old_log_prob),
                                   ("advantages", advantages), ("response_mask", response_mask),
                                   ("rollout_is_weights", rollout_is_weights), ("ref_log_prob", ref_log_prob)))
    for name, t in (("log_prob", log_prob), ("old_log_prob", old_log_prob), ("advantages", advantages),
                    ("response_mask", response_mask)):
        if t is None:
            raise ValueError(f"{name} is required")
    check_inputs(log_prob, old_log_prob, advantages, response_mask, actor_config, rollout_is_weights, ref_log_prob,
                 values=check)
    c = _ppo_coefficients(log_prob, old_log_prob, advantages, response_mask, actor_config, rollout_is_weights,
                          ref_log_prob, global_batch_info)
    return c * response_mask.to(c.dtype)


def aggregation_weights(response_mask: torch.Tensor, loss_agg_mode: str,
                        global_batch_info: Mapping[str, Any] | None = None) -> torch.Tensor:
    """w[b, t] = d agg_loss / d loss_mat[b, t]: how much one token's per-token loss counts (e.g. for entropy)."""
    from verl.trainer.ppo.core_algos import agg_loss

    mat = torch.zeros(response_mask.shape, device=response_mask.device, requires_grad=True)
    loss = agg_loss(mat, response_mask.float(), loss_agg_mode, **dict(global_batch_info or {}))
    (w,) = torch.autograd.grad(loss, mat)
    return w


def actor_exposure(c: torch.Tensor, response_mask: torch.Tensor, actor_config, vocab_size: int | None = None,
                   global_batch_info: Mapping[str, Any] | None = None) -> exposure.Exposure:
    """`exposure.summarize` with the entropy bound that verl's actor config calls for.

    With `actor_config.entropy_coeff` != 0, each token gets |entropy_coeff| * w_t * 2 ln V on top of
    |c_t|, w_t from `aggregation_weights` for the config's `loss_agg_mode` (and `loss_scale_factor`)
    in the same view as c (`global_batch_info` as given to `loss_coefficients`); `vocab_size` is
    then required. With entropy_coeff 0 this is `exposure.summarize(c, response_mask)`.
    """
    c, response_mask = padded("c", c), padded("response_mask", response_mask)
    coeff = float(getattr(actor_config, "entropy_coeff", 0.0) or 0.0)
    entropy = {}
    if coeff:
        if not vocab_size or vocab_size < 2:
            raise ValueError(f"vocab_size is required (>= 2) for the entropy bound: entropy_coeff is {coeff}")
        info = {"loss_scale_factor": getattr(actor_config, "loss_scale_factor", None)}
        info.update(global_batch_info or {})
        weights = aggregation_weights(response_mask, actor_config.loss_agg_mode, info).to(c.dtype)
        entropy = {"entropy_coeff": coeff, "entropy_weights": weights, "vocab_size": vocab_size}
    return exposure.summarize(c, response_mask, **entropy)


# Policy-loss modes whose per-token loss is the advantage times a function of that token's (and its own
# sequence's) log-probs, with no term across sequences: a sequence whose advantages are all 0 has a zero
# loss term for any log-probs. Verified against ppo_loss by tests/loss/test_skip_on_cpu.py. Not here, so never
# skipped: clip_cov / kl_cov (tokens chosen by covariance over the batch), geo_mean (measured coupled over
# the micro-batch), dro (a log-ratio penalty without the advantage), bypass_mode (IS weights and rejection
# masks computed in the loss, optionally normalised over the batch), and any mode registered later.
ADVANTAGE_PROPORTIONAL_MODES = frozenset({"vanilla", "cispo", "dppo_kl", "dppo_tv", "gpg", "gspo", "sapo"})


def skip_refusal(actor_config: Any, loss_function: Any) -> str | None:
    """Why a zero-advantage sequence cannot be left out of the actor update under this loss (None: it can,
    and the update is unchanged as long as the mini-batch's normalisation is stock verl's)."""
    func = getattr(loss_function, "func", None)
    if func is not ppo_loss or actor_config is None:
        return "the loss function is not verl's ppo_loss bound to an actor config"
    mode = (actor_config.policy_loss or {}).get("loss_mode", "vanilla")
    if mode not in ADVANTAGE_PROPORTIONAL_MODES:
        return (f"policy_loss.loss_mode={mode} is not one whose loss is proportional to the advantage "
                f"({', '.join(sorted(ADVANTAGE_PROPORTIONAL_MODES))})")
    if getattr(actor_config, "use_kl_loss", False) and getattr(actor_config, "kl_loss_coef", 0.0):
        return "use_kl_loss=true: the KL loss moves every sequence, whatever its advantage"
    if getattr(actor_config, "entropy_coeff", 0.0):
        return "entropy_coeff != 0: the entropy bonus moves every sequence, whatever its advantage"
    if actor_config.loss_agg_mode == "seq-mean-token-sum-norm" and actor_config.loss_scale_factor is None:
        return ("loss_agg_mode=seq-mean-token-sum-norm without loss_scale_factor divides each micro-batch by its "
                "own padded response length, which depends on which sequences share it")
    return None


def batch_skip_refusal(actor_config: Any, data) -> str | None:
    """Why this mini-batch's zero-advantage sequences cannot be left out (None: they can)."""
    if tu.get_non_tensor_data(data=data, key="return_model_output", default=False):
        return "the caller asked for every sequence's model output (return_model_output)"
    if tu.get_non_tensor_data(data=data, key="force_group_size", default=1) != 1:
        return "force_group_size != 1 keeps sequences together in micro-batches"
    if actor_config.loss_agg_mode.startswith("seq-mean") and tu.get_non_tensor_data(
            data=data, key="global_batch_size", default=None) is None:
        return ("a sequence-mean loss without global_batch_size is divided by each micro-batch's own sequence "
                "count, which depends on which sequences share it")
    return None
