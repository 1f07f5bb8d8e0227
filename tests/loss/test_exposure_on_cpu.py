"""Loss coefficients equal autograd of verl's ppo_loss (as the engine calls it) w.r.t. log_prob."""

import math

import pytest
import torch

from hilore_verl.loss import exposure
from hilore_verl.integration.actor import loss as actor_loss
from hilore_verl.integration.tools.verl_engine import actor_config, to_engine_batch
from hilore_verl.integration.actor.loss import aggregation_weights, policy_loss_modes
from hilore_verl.tiny.workload import GRPOWorkload, make_grpo_batch

AGG_MODES = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
KL_TYPES = ["kl", "abs", "mse", "low_var_kl"]
WORKLOAD = GRPOWorkload(num_groups=3, group_size=4, max_prompt_len=8, max_response_len=12, zero_advantage_share=1 / 3)


def _batch(seed=0, is_weights=False, ref=False):
    b = make_grpo_batch(WORKLOAD, seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    mask = b["response_mask"].float()
    log_prob = (-torch.rand(mask.shape, generator=g) * 3) * mask
    b["old_log_probs"] = (log_prob + 0.4 * torch.randn(mask.shape, generator=g)) * mask  # some tokens clip
    if is_weights:
        b["rollout_is_weights"] = torch.rand(mask.shape, generator=g) * 2 * mask
    if ref:
        b["ref_log_prob"] = (log_prob + 0.3 * torch.randn(mask.shape, generator=g)) * mask
    return b, log_prob


def _verl_engine_gradient(batch, log_prob, config, info):
    """autograd of verl's ppo_loss on the engine's no-padding micro-batch, mapped back to (B, T)."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import no_padding_2_padding

    td = to_engine_batch(batch, global_batch_size=info["global_batch_size"])
    P = batch["prompts"].shape[1]
    # the model output: log-prob of token i+1 at position i of each packed sequence
    rows = []
    for b in range(batch["input_ids"].shape[0]):
        valid = batch["attention_mask"][b].bool()
        full = torch.zeros(batch["input_ids"].shape[1])
        full[P - 1 : -1] = log_prob[b]
        rows.append(full[valid])  # packed position i holds the log-prob of the next valid token
    values = torch.cat(rows).requires_grad_(True)
    nested = torch.nested.nested_tensor_from_jagged(values, offsets=td["input_ids"].offsets())
    tu.assign_non_tensor(td, dp_size=info["dp_size"], batch_num_tokens=info["batch_num_tokens"])
    loss, _ = ppo_loss(config, {"log_probs": nested}, td)
    (grad,) = torch.autograd.grad(loss, values)
    grad_nested = torch.nested.nested_tensor_from_jagged(grad, offsets=td["input_ids"].offsets())
    return no_padding_2_padding(grad_nested, td) * batch["response_mask"], loss


def _compare(config, is_weights=False, ref=False, dp_size=1):
    batch, log_prob = _batch(is_weights=is_weights, ref=ref)
    mask = batch["response_mask"]
    info = {"dp_size": dp_size, "batch_num_tokens": int(mask.sum()) * dp_size,
            "global_batch_size": mask.shape[0] * dp_size}
    expected, loss = _verl_engine_gradient(batch, log_prob, config, info)
    c = actor_loss.loss_coefficients(log_prob, batch["old_log_probs"], batch["advantages"], mask, config,
                                   rollout_is_weights=batch.get("rollout_is_weights"),
                                   ref_log_prob=batch.get("ref_log_prob"), global_batch_info=info)
    assert torch.isfinite(loss)
    torch.testing.assert_close(c, expected, rtol=1e-5, atol=1e-7)
    return c, batch


def _policy_loss(mode):
    if mode == "bypass_mode":  # needs its rollout-correction settings
        return {"loss_mode": mode, "rollout_correction": {"loss_type": "reinforce", "rollout_is": "token"}}
    if mode == "dro":
        return {"loss_mode": mode, "dro_beta": 0.5}
    return {"loss_mode": mode}


@pytest.mark.parametrize("mode", policy_loss_modes())
@pytest.mark.parametrize("agg", AGG_MODES)
def test_every_policy_loss_mode_and_aggregation(mode, agg):
    config = actor_config(loss_agg_mode=agg, policy_loss=_policy_loss(mode))
    for is_weights in (False, True):
        c, _ = _compare(config, is_weights=is_weights, dp_size=2)
        assert c.abs().sum() > 0


@pytest.mark.parametrize("kl_type", KL_TYPES)
@pytest.mark.parametrize("mode", ["vanilla", "gspo", "cispo"])
def test_kl_loss_of_each_type(kl_type, mode):
    config = actor_config(use_kl_loss=True, kl_loss_type=kl_type, kl_loss_coef=0.05, policy_loss={"loss_mode": mode})
    _compare(config, ref=True)


def test_zero_advantage_groups_have_exactly_zero_exposure():
    config = actor_config(policy_loss={"loss_mode": "vanilla"})
    c, batch = _compare(config)
    e = exposure.summarize(c, batch["response_mask"])
    zero_groups = batch["zero_advantage_group"].repeat_interleave(4)
    assert zero_groups.any() and (e.token[zero_groups] == 0).all() and e.l2_of(zero_groups) == 0.0
    assert (e.token[~zero_groups].sum(-1) > 0).all()
    assert (e.token[batch["response_mask"] == 0] == 0).all()
    # the L2 over all sequences is the root of the sum over any split of them
    halves = [e.l2_of(slice(0, 6)), e.l2_of(slice(6, None))]
    assert e.l2_of() == pytest.approx(math.hypot(*halves)) and e.l2_of() == pytest.approx(
        float(c.double().mul(batch["response_mask"]).pow(2).sum().sqrt()), rel=1e-6)


def test_fully_clipped_tokens_have_zero_coefficient():
    config = actor_config(policy_loss={"loss_mode": "vanilla"}, clip_ratio=0.2)
    mask = torch.ones(2, 3)
    log_prob = torch.zeros(2, 3)
    old = torch.tensor([[0.0, -1.0, 1.0], [0.0, -1.0, 1.0]])  # ratio 1, e, 1/e
    adv = torch.tensor([[1.0] * 3, [-1.0] * 3])
    c = actor_loss.loss_coefficients(log_prob, old, adv, mask, config)
    # A > 0 clips when the ratio is above 1 + eps, A < 0 when below 1 - eps
    assert c[0, 1] == 0 and c[0, 0] != 0 and c[0, 2] != 0
    assert c[1, 2] == 0 and c[1, 0] != 0


def test_coefficients_at_the_on_policy_point():
    """What the engine predicts before a forward: c at log_prob = old_log_prob."""
    config = actor_config()
    batch, _ = _batch()
    mask = batch["response_mask"]
    pred = actor_loss.loss_coefficients(batch["old_log_probs"], batch["old_log_probs"], batch["advantages"], mask,
                                        config)
    # at ratio 1, vanilla token-mean: c = -A / tokens
    assert torch.allclose(pred, -batch["advantages"] * mask / mask.sum())


def test_jagged_inputs_are_accepted():
    config = actor_config()
    batch, log_prob = _batch()
    mask = batch["response_mask"]
    dense = actor_loss.loss_coefficients(log_prob, batch["old_log_probs"], batch["advantages"], mask, config)
    lengths = mask.sum(1)
    as_jagged = lambda t: torch.nested.nested_tensor([row[:n] for row, n in zip(t, lengths)], layout=torch.jagged)  # noqa
    # jagged rows padded back to the longest response: same as the dense tensors cut at that length
    T = int(lengths.max())
    jagged = actor_loss.loss_coefficients(as_jagged(log_prob), as_jagged(batch["old_log_probs"]),
                                        as_jagged(batch["advantages"]), as_jagged(mask.float()), config)
    torch.testing.assert_close(jagged, dense[:, :T])


def test_entropy_bound_is_added_per_token():
    mask = torch.ones(2, 4)
    mask[1, 2:] = 0
    c = torch.zeros(2, 4)
    w = aggregation_weights(mask, "token-mean")
    e = exposure.summarize(c, mask, entropy_coeff=0.01, entropy_weights=w, vocab_size=1000)
    expected = 0.01 * (1 / 6) * 2 * torch.log(torch.tensor(1000.0))
    assert torch.allclose(e.token[mask.bool()], expected.expand(6)) and (e.token[~mask.bool()] == 0).all()
    with pytest.raises(ValueError, match="entropy_weights and vocab_size are required"):
        exposure.summarize(c, mask, entropy_coeff=0.01)


def test_bad_input_names_the_field():
    config = actor_config()
    batch, log_prob = _batch()
    mask = batch["response_mask"]
    with pytest.raises(ValueError, match="old_log_prob has shape"):
        actor_loss.loss_coefficients(log_prob, batch["old_log_probs"][:, :5], batch["advantages"], mask, config)
    bad = batch["advantages"].clone()
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="advantages holds nan or inf"):
        actor_loss.loss_coefficients(log_prob, batch["old_log_probs"], bad, mask, config)
    with pytest.raises(ValueError, match="ref_log_prob is required: the actor config has use_kl_loss=True"):
        actor_loss.loss_coefficients(log_prob, batch["old_log_probs"], batch["advantages"], mask,
                                   actor_config(use_kl_loss=True))
    with pytest.raises(ValueError, match="advantages is required"):
        actor_loss.loss_coefficients(log_prob, batch["old_log_probs"], None, mask, config)


def test_value_checks_read_once_and_can_be_skipped(monkeypatch):
    batch, log_prob = _batch(is_weights=True)
    mask = batch["response_mask"]
    weights = batch["rollout_is_weights"].clone()
    row, col = mask.bool().nonzero()[0].tolist()
    weights[row, col] = -1.0  # on one response token
    with pytest.raises(ValueError, match="rollout_is_weights must be >= 0"):
        actor_loss.check_values(mask, advantages=batch["advantages"], rollout_is_weights=weights)
    off_response = batch["advantages"].clone()
    off_response[~mask.bool()] = float("nan")  # padding is not looked at
    actor_loss.check_values(mask, advantages=off_response)
    reads = []
    real = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(1) or real(t))
    monkeypatch.setattr(torch.Tensor, "__bool__", lambda t: pytest.fail("a read per flag"))
    actor_loss.check_values(mask, old_log_prob=batch["old_log_probs"], advantages=batch["advantages"],
                          rollout_is_weights=batch["rollout_is_weights"])
    assert reads == [1]  # every flag in one transfer
    monkeypatch.undo()
    bad = batch["advantages"].clone()
    bad[mask.bool()] = float("inf")
    c = actor_loss.loss_coefficients(log_prob, batch["old_log_probs"], bad, mask, actor_config(), check=False)
    assert c.shape == mask.shape  # unchecked: the caller checked the values
    assert exposure.read_floats([1.5, torch.tensor(0.25), torch.tensor(2.0, dtype=torch.float64)]) == [1.5, 0.25, 2.0]


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_actor_exposure_adds_the_entropy_bound_of_the_actor_config(agg):
    """Zero advantages give c = 0, but an entropy bonus still moves the policy: with entropy_coeff > 0
    the exposure is the stated bound |entropy_coeff| * w_t * 2 ln V, with entropy_coeff 0 it is 0."""
    batch, _ = _batch()
    mask = batch["response_mask"]
    zero = torch.zeros_like(batch["advantages"])
    for coeff in (0.0, 0.01):
        config = actor_config(loss_agg_mode=agg, entropy_coeff=coeff)
        c = actor_loss.loss_coefficients(batch["old_log_probs"], batch["old_log_probs"], zero, mask, config)
        assert (c == 0).all()
        e = actor_loss.actor_exposure(c, mask, config, vocab_size=512)
        if coeff == 0:
            assert e.l2_of() == 0 and (e.token == 0).all()
            continue
        w = aggregation_weights(mask, agg)
        expected = coeff * w * 2 * torch.log(torch.tensor(512.0)) * mask
        torch.testing.assert_close(e.token, expected)
        assert e.l2_of() > 0 and (e.token.sum(-1) > 0).all()
    with pytest.raises(ValueError, match="vocab_size is required"):
        actor_loss.actor_exposure(c, mask, actor_config(entropy_coeff=0.01))
    # without entropy the actor's exposure is summarize's
    c = actor_loss.loss_coefficients(batch["old_log_probs"], batch["old_log_probs"], batch["advantages"], mask,
                                     actor_config())
    assert actor_loss.actor_exposure(c, mask, actor_config()).l2_of() == exposure.summarize(c, mask).l2_of()


def test_aggregation_weights_are_made_on_the_mask_s_device():
    """On a GPU the mask is a CUDA tensor: the weights are built beside it (a host tensor would meet a
    device mask inside verl's agg_loss). The meta device stands in for an accelerator here."""
    from hilore_verl.integration.actor.loss import aggregation_weights

    assert aggregation_weights(torch.ones(2, 3, device="meta"), "token-mean").device.type == "meta"
