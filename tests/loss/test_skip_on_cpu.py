"""Zero-exposure skip: which losses allow it (verified against verl's ppo_loss), how micro-batches pair
over ranks (skip.form), and the update through verl's engine on 2 gloo ranks against stock verl.

Bound: with skipping the gradient is stock verl's summed in another order (other micro-batches), so it
is compared with max |g - g_stock| <= 1e-5 * max |g_stock| (fp32); without skipping, bitwise.

The engines here run verl's ordinary layout (`shared_prompt: False`), where the skip is bitwise stock
verl's; the shared layout's own tests are tests/integration/test_shared_prompt_engine_on_cpu.py.
"""

import threading

import pytest
import torch

from hilore_verl.integration.actor.batch import chunks
from hilore_verl.loss import skip
from hilore_verl.training.host import SingleProcess
from hilore_verl.tiny.models import save_tiny_model
from hilore_verl.tiny.workload import GRPOWorkload, make_grpo_batch, shard
from tests.harness.distributed import run_on_ranks

TOLERANCE = 1e-5
# what every registered policy-loss mode needs beyond verl's defaults to run at all
MODE_SETTINGS = {"dro": {"dro_beta": 0.1}, "bypass_mode": {"rollout_correction": {"loss_type": "ppo_clip"}}}
AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


# ---------------------------------------------------------------------------- which losses
def _random_batch(seed, B=16, T=9):
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(B, T, generator=g) > 0.25).float()
    mask[:, 0] = 1
    adv = torch.randn(B, 1, generator=g).expand(B, T) * mask
    zero = torch.rand(B, generator=g) < 0.4
    zero[0], zero[1] = True, False
    adv = adv * (~zero)[:, None]
    old = -torch.rand(B, T, generator=g) * 3
    log_prob = old + torch.randn(B, T, generator=g) * 0.7  # off-policy: ratios far from 1, clipping active
    return log_prob, old, adv.contiguous(), mask, zero


@pytest.mark.parametrize("agg", AGG_MODES)
def test_declared_modes_are_proportional_to_the_advantage(agg):
    """For every declared mode: a zero-advantage sequence has c = 0 for any log-probs, and leaving it out
    leaves every other sequence's c as it was, within 1e-6 relative (a few fp32 ulps: the vectorised exp and
    sigmoid over another batch shape may round a last bit differently) (same global normalisation)."""
    from hilore_verl.integration.tools.verl_engine import actor_config
    from hilore_verl.integration.actor.loss import ADVANTAGE_PROPORTIONAL_MODES, loss_coefficients

    for mode in sorted(ADVANTAGE_PROPORTIONAL_MODES):
        config = actor_config(policy_loss={"loss_mode": mode, **MODE_SETTINGS.get(mode, {})}, loss_agg_mode=agg,
                              loss_scale_factor=8)
        for seed in range(4):
            log_prob, old, adv, mask, zero = _random_batch(seed)
            kept = (~zero).nonzero().flatten()
            info = {"dp_size": 1, "batch_num_tokens": int(mask.sum()), "global_batch_size": len(zero)}
            c = loss_coefficients(log_prob, old, adv, mask, config, global_batch_info=info)
            part = loss_coefficients(log_prob[kept], old[kept], adv[kept], mask[kept], config, global_batch_info=info)
            assert torch.all(c[zero] == 0), (mode, agg, seed)
            # elementwise the same arithmetic; vectorised math (exp, sigmoid) may round a last bit differently
            assert torch.allclose(c[kept], part, rtol=1e-6, atol=0), (mode, agg, seed)


def test_every_registered_mode_is_declared_or_refused():
    """A mode verl registers later is refused until it is checked and declared here."""
    from hilore_verl.integration.tools.verl_engine import actor_config, ppo_loss_fn
    from hilore_verl.integration.actor.loss import ADVANTAGE_PROPORTIONAL_MODES, policy_loss_modes, skip_refusal

    refused = {"clip_cov", "kl_cov", "geo_mean", "dro", "bypass_mode"}
    assert set(policy_loss_modes()) == ADVANTAGE_PROPORTIONAL_MODES | refused
    for mode in policy_loss_modes():
        config = actor_config(policy_loss={"loss_mode": mode, **MODE_SETTINGS.get(mode, {})})
        assert (skip_refusal(config, ppo_loss_fn(config)) is None) == (mode in ADVANTAGE_PROPORTIONAL_MODES)


def test_geo_mean_is_refused_because_it_couples_sequences():
    """What keeps geo_mean out: leaving a zero-advantage sequence out changes the others' coefficients."""
    from hilore_verl.integration.tools.verl_engine import actor_config
    from hilore_verl.integration.actor.loss import loss_coefficients

    log_prob, old, adv, mask, zero = _random_batch(0)
    kept = (~zero).nonzero().flatten()
    info = {"dp_size": 1, "batch_num_tokens": int(mask.sum()), "global_batch_size": len(zero)}
    config = actor_config(policy_loss={"loss_mode": "geo_mean"})
    c = loss_coefficients(log_prob, old, adv, mask, config, global_batch_info=info)
    part = loss_coefficients(log_prob[kept], old[kept], adv[kept], mask[kept], config, global_batch_info=info)
    assert not torch.allclose(c[kept], part)


def test_refusals_name_their_reason():
    from functools import partial

    from hilore_verl.integration.tools.verl_engine import actor_config, ppo_loss_fn
    from hilore_verl.integration.actor.loss import skip_refusal

    cases = {"KL loss": dict(use_kl_loss=True, kl_loss_coef=0.001), "entropy": dict(entropy_coeff=0.01),
             "padded response length": dict(loss_agg_mode="seq-mean-token-sum-norm")}
    for words, overrides in cases.items():
        config = actor_config(**overrides)
        assert words in skip_refusal(config, ppo_loss_fn(config)), words
    config = actor_config()
    assert skip_refusal(config, ppo_loss_fn(config)) is None
    assert skip_refusal(actor_config(use_kl_loss=True, kl_loss_coef=0.0), ppo_loss_fn(config)) is None
    assert "ppo_loss" in skip_refusal(config, partial(lambda **kw: None, config=config))
    assert skip_refusal(actor_config(loss_agg_mode="seq-mean-token-sum-norm", loss_scale_factor=16),
                        ppo_loss_fn(config)) is None


# ---------------------------------------------------------------------------- pairing over ranks
class _Ranks:
    """Collectives for ranks run as threads (every call a barrier)."""

    def __init__(self, world_size):
        self.world_size, self._values, self._barrier = world_size, {}, threading.Barrier(world_size)

    def on(self, rank):
        ranks = self

        class View:
            world_size = ranks.world_size

            def gather(self, values):
                ranks._values[rank] = [float(v) for v in values]
                ranks._barrier.wait()
                rows = [ranks._values[r] for r in range(ranks.world_size)]
                ranks._barrier.wait()
                return rows

            def reduce(self, values, op="sum"):
                fn = {"sum": sum, "max": max, "min": min}[op]
                return [fn(col) for col in zip(*self.gather(values))]

        return View()


def _form_on_ranks(zeros, lengths, split):
    ranks, out = _Ranks(len(zeros)), [None] * len(zeros)

    def run(r):
        out[r] = skip.form(zeros[r], lengths[r], split, ranks.on(r))

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(zeros))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_ranks_run_the_same_number_of_micro_batches():
    split = lambda kept, at_least: chunks(kept, 2, at_least)  # noqa: E731
    zeros = [[True] * 8, [True, False] * 4, [False] * 8]  # 100%, 50%, 0% skipped
    lengths = [[5, 3, 7, 2, 9, 4, 6, 8]] * 3
    layouts = _form_on_ranks(zeros, lengths, split)
    counts = {len(layout.micro_batches) for layout in layouts}
    assert counts == {4}  # the rank that skips nothing sets the count
    assert layouts[0].micro_batches == [[3]] * 4 and layouts[0].fillers == 4  # its shortest skipped sequence
    assert layouts[1].fillers == 0 and sorted(sum(layouts[1].micro_batches, [])) == [1, 3, 5, 7]
    assert all(len(mb) <= 2 for layout in layouts for mb in layout.micro_batches)
    assert layouts[0].sequences == 12 and layouts[0].tokens == 44 + (5 + 7 + 9 + 6)
    assert layouts[2].metrics()["hilore/skip/token_share"] == pytest.approx(71 / 132)


def test_nothing_skipped_anywhere_leaves_the_split_to_the_framework():
    split = lambda kept, at_least: chunks(kept, 2, at_least)  # noqa: E731
    layouts = _form_on_ranks([[False] * 4, [False] * 4], [[3] * 4] * 2, split)
    assert [(x.micro_batches, x.total_sequences, x.total_tokens) for x in layouts] == [(None, 8, 24)] * 2
    assert skip.form([False, False], [3, 4], split, SingleProcess()).micro_batches is None


def test_a_rank_too_short_to_pair_turns_the_skip_off_everywhere():
    split = lambda kept, at_least: chunks(kept, 1, at_least)  # noqa: E731
    zeros = [[False, False, False, False], [False, True]]  # rank 1: one kept; 4 micro-batches wanted
    layouts = _form_on_ranks(zeros, [[3] * 4, [3, 3]], split)
    assert layouts[1].fillers == 3 and len(layouts[1].micro_batches) == 4  # padded with its skipped one
    # rank 1: one sequence, none skipped, so nothing to fill its 3 micro-batches with: no skip anywhere
    layouts = _form_on_ranks([[False, False, False, True], [False]], [[3] * 4, [3]], split)
    assert [(x.micro_batches, x.sequences) for x in layouts] == [(None, 0)] * 2


def test_chunks_respect_the_micro_batch_size():
    for n in range(1, 12):
        for size in (1, 2, 3, 5):
            for at_least in (1, 3, 20):
                parts = chunks(list(range(n)), size, at_least)
                assert sum(parts, []) == list(range(n)) and all(1 <= len(p) <= size for p in parts)
                assert len(parts) == min(n, max(-(-n // size), at_least))


# ---------------------------------------------------------------------------- through verl's engine
WORKLOAD = GRPOWorkload(num_groups=4, group_size=4, max_prompt_len=10, max_response_len=16, zero_advantage_share=0.0)


def _batch():
    """16 sequences; rank 0 holds groups 0-1 (all zero advantage: 100% skipped), rank 1 groups 2-3 (one zero)."""
    batch = make_grpo_batch(WORKLOAD, seed=5)
    batch["advantages"][:12] = 0.0
    return batch


def _engine_batch(batch, rank, world_size, dynamic):
    from hilore_verl.integration.tools.verl_engine import to_engine_batch
    from verl.utils import tensordict_utils as tu

    td = to_engine_batch(shard(batch, rank, world_size), global_batch_size=batch["input_ids"].shape[0])
    if dynamic:
        tu.assign_non_tensor(td, use_dynamic_bsz=True, max_token_len_per_gpu=40)
    return td


def _grads(engine, td, loss_fn):
    with engine.train_mode():
        out = engine.train_batch(td, loss_function=loss_fn)
        grads = {n: p.grad.full_tensor() for n, p in engine.module.named_parameters()}
    return out, grads


def _modes_against_stock(rank, world_size, model_dir, batch, defer):
    from hilore_verl.integration.tools.verl_engine import actor_config, build_fsdp_engine, ppo_loss_fn
    from hilore_verl.integration.actor.engine import HiLoReFSDPEngine
    from hilore_verl.integration.actor.loss import policy_loss_modes

    common = dict(gradient_checkpointing=True, lr=0.0, clip_grad=1e9, defer_gradient_sync=defer)
    stock = build_fsdp_engine(model_dir, **common)
    hilore = build_fsdp_engine(model_dir, engine_cls=HiLoReFSDPEngine, **common,
                               hilore={"enable": True, "shared_prompt": False, "risk_budget": 0.0, "audit_every": 0, "min_bytes": 1024})
    results = []
    cases = [(m, "token-mean", False) for m in policy_loss_modes()]
    cases += [("vanilla", agg, dyn) for agg in AGG_MODES for dyn in (False, True)]
    for mode, agg, dynamic in cases:
        config = actor_config(policy_loss={"loss_mode": mode, **MODE_SETTINGS.get(mode, {})}, loss_agg_mode=agg)
        loss_fn = ppo_loss_fn(config)
        _, g0 = _grads(stock, _engine_batch(batch, rank, world_size, dynamic), loss_fn)
        out, g = _grads(hilore, _engine_batch(batch, rank, world_size, dynamic), loss_fn)
        scale = max(float(t.abs().max()) for t in g0.values())
        results.append({"case": (mode, agg, dynamic), "scale": scale,
                        "bitwise": all(torch.equal(g[n], t) for n, t in g0.items()),
                        "error": max(float((g[n] - t).abs().max()) for n, t in g0.items()),
                        "skipped": out["metrics"].get("hilore/skip/sequences", [0.0])[0],
                        "fillers": out["metrics"].get("hilore/skip/filler_micro_batches", [0.0])[0],
                        "loss": out["metrics"]["actor/pg_loss"] if "actor/pg_loss" in out["metrics"] else None})
    return results


@pytest.mark.parametrize("defer", [True, False])
def test_skip_against_stock_verl_on_two_ranks(tmp_path, defer):
    """Every registered loss mode (token-mean) and every aggregation mode (vanilla, fixed and dynamic
    micro-batch sizes), deferred gradient sync on and off: skipped where declared and exact, the update
    within the stated bound of stock verl's; bitwise stock verl's where it is refused."""
    from hilore_verl.integration.actor.loss import ADVANTAGE_PROPORTIONAL_MODES

    model_dir = save_tiny_model(tmp_path / "tiny-qwen2", "qwen2", seed=0)
    ranks = run_on_ranks(_modes_against_stock, 2, args=(model_dir, _batch(), defer))
    for r0, r1 in zip(*ranks):
        mode, agg, _ = r0["case"]
        safe = mode in ADVANTAGE_PROPORTIONAL_MODES and agg != "seq-mean-token-sum-norm"
        assert r0["scale"] > 0, r0
        if safe:
            assert r0["skipped"] == 12 and r0["fillers"] >= 1 and r1["fillers"] == 0, (r0, r1)
            assert r0["error"] <= TOLERANCE * r0["scale"], r0
        else:
            assert r0["skipped"] == 0 and r0["bitwise"], r0


def _whole_mini_batch_skipped(rank, world_size, model_dir, batch):
    from hilore_verl.integration.tools.verl_engine import actor_config, build_fsdp_engine, ppo_loss_fn
    from hilore_verl.integration.actor.engine import HiLoReFSDPEngine

    loss_fn = ppo_loss_fn(actor_config())
    common = dict(gradient_checkpointing=True, lr=1e-3, clip_grad=1.0)
    zero = dict(batch, advantages=torch.zeros_like(batch["advantages"]))
    out = {}
    for name, kwargs in (("stock", {}), ("hilore", dict(engine_cls=HiLoReFSDPEngine, hilore={
            "enable": True, "shared_prompt": False, "risk_budget": 0.0, "audit_every": 0, "min_bytes": 1024}))):
        engine = build_fsdp_engine(model_dir, **common, **kwargs)
        metrics = []
        for b in (batch, zero):  # moments first, then a mini-batch that is skipped whole
            with engine.train_mode():
                metrics.append(engine.train_batch(_engine_batch(b, rank, world_size, False), loss_function=loss_fn))
        state = engine.optimizer.state_dict()["state"]
        whole = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t  # noqa: E731
        moments = {(i, k): whole(s[k]) for i, s in state.items() for k in ("exp_avg", "exp_avg_sq")}
        out[name] = ({n: p.full_tensor() for n, p in engine.module.named_parameters()},
                     sorted({float(s["step"]) for s in state.values()}),
                     metrics[1]["metrics"].get("hilore/skip/token_share", [None])[0], moments)
    return out


def test_a_mini_batch_skipped_whole_steps_adam_as_stock_verl(tmp_path):
    model_dir = save_tiny_model(tmp_path / "tiny-qwen2", "qwen2", seed=0)
    ranks = run_on_ranks(_whole_mini_batch_skipped, 2, args=(model_dir, _batch()))
    stock, hilore = ranks[0]["stock"], ranks[0]["hilore"]
    assert stock[1] == hilore[1] == [2.0]  # Adam stepped twice, as stock verl steps on a zero gradient
    assert hilore[2] == 1.0
    moved = max(float((hilore[0][n] - stock[0][n]).abs().max()) for n in stock[0])
    assert moved <= 1e-6, moved
    # Adam's moments too: the zero step decays them as stock verl's does (the first step's gradient within
    # the module's bound, 1e-5 of its largest value: the first moment within that of its largest, the
    # second, a square, within twice that)
    assert hilore[3].keys() == stock[3].keys() and stock[3]
    for (index, kind), m in stock[3].items():
        bound = (1e-5 if kind == "exp_avg" else 2e-5) * float(m.abs().max())
        assert float((hilore[3][index, kind] - m).abs().max()) <= bound, (index, kind)
