"""hilore.shared_prompt through verl's FSDP2 engine on 2 CPU ranks: each group's prompt computed once, the
update equal to stock verl's within floating-point reordering (fp32), verl's loss and metrics the same."""

import pytest
import torch

from hilore_verl.tiny.models import build_tiny_model, save_tiny_model
from hilore_verl.tiny.workload import GRPOWorkload, make_grpo_batch, shard
from tests.harness.distributed import run_on_ranks

# 2 groups of 4: each rank holds one group, its micro-batches of 2 sequences share one prompt
WORKLOAD = GRPOWorkload(num_groups=2, group_size=4, max_prompt_len=12, max_response_len=24)


def _step(engine, batch, rank, world_size, loss_fn, **kwargs):
    from hilore_verl.integration.tools.verl_engine import to_engine_batch

    td = to_engine_batch(shard(batch, rank, world_size), global_batch_size=batch["input_ids"].shape[0], **kwargs)
    with engine.train_mode():
        out = engine.train_batch(td, loss_function=loss_fn)
        grads = {n: p.grad.full_tensor().clone() for n, p in engine.module.named_parameters()}
    return out["metrics"], grads


def _messages() -> list[str]:
    """Every message hilore_verl logs in this process from now on."""
    import logging

    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("hilore_verl").addHandler(handler)
    return said


def _compare(rank, world_size, model_dir, batch, remove_padding):
    from hilore_verl.integration.tools.verl_engine import actor_config, build_fsdp_engine, ppo_loss_fn
    from hilore_verl.integration.actor.engine import HiLoReFSDPEngine

    said = _messages()
    config = actor_config()
    loss_fn = ppo_loss_fn(config)
    kwargs = remove_padding if isinstance(remove_padding, dict) else {"use_remove_padding": remove_padding}
    stock = build_fsdp_engine(model_dir, gradient_checkpointing=True, lr=0.0, clip_grad=1e9)
    metrics0, grads0 = _step(stock, batch, rank, world_size, loss_fn, **kwargs)
    engine = build_fsdp_engine(model_dir, gradient_checkpointing=True, lr=0.0, clip_grad=1e9,
                               engine_cls=HiLoReFSDPEngine, actor_config=config,
                               hilore={"enable": True, "risk_budget": 0.0, "min_bytes": 1024, "audit_every": 0,
                                       "skip_zero_exposure": False, "shared_prompt": True})
    steps = []
    for _ in range(2):  # the first step profiles and calibrates, the second runs the controller's plan
        metrics, grads = _step(engine, batch, rank, world_size, loss_fn, **kwargs)
        a = torch.cat([grads[n].flatten().double() for n in grads0])
        b = torch.cat([g.flatten().double() for g in grads0.values()])
        worst = max(float((grads[n] - g).norm() / g.norm()) for n, g in grads0.items() if g.norm() > 0)
        planned = [engine.controller.tokens(i) for i in range(len(engine.controller._micro))]
        steps.append({"planned": planned, "cos": float(a @ b / (a.norm() * b.norm())), "rel": float((a - b).norm() / b.norm()),
                      "worst_param_rel": worst, "share": (metrics.get("hilore/shared/token_share") or [None])[0],
                      "on": (metrics.get("hilore/shared_prompt_on") or [None])[0],
                      "verl": {k: metrics[k] for k in metrics0 if not k.startswith("hilore/")},
                      "verl0": {k: metrics0[k] for k in metrics0 if not k.startswith("hilore/")}})
    return {"steps": steps, "refusals": [m for m in said if "shared prompt off" in m],
            "check": engine._shared.check if engine._shared is not None else None}


def _numbers(value) -> list[float]:
    """A metric as verl returns it (a number, a list, or verl's Metric holding values) as floats."""
    value = getattr(value, "values", value)
    return [float(getattr(v, "values", v) if not isinstance(v, list) else v[0]) for v in
            (value if isinstance(value, (list, tuple)) else [value])]


def _close(a, b, rel=1e-5, mean=False):
    """Metrics equal per micro-batch, or (`mean`: micro-batches formed differently) in their mean, which is
    what verl's trainer logs."""
    a, b = (torch.tensor(_numbers(x), dtype=torch.float64) for x in (a, b))
    a, b = (a.mean(0, keepdim=True), b.mean(0, keepdim=True)) if mean else (a, b)
    return bool(((a - b).abs() <= rel * b.abs().clamp_min(1e-6)).all())


SPLIT_FREE = {"actor/pg_loss", "grad_norm"}  # metrics whose mean over micro-batches does not depend on their split


def _scattered(batch):
    """The batch's sequences interleaved across groups (g0, g1, g0, g1, ...), as verl's trainer can hand
    them after balancing lengths over ranks: verl's own split puts no two of a group together."""
    bsz, n = batch["input_ids"].shape[0], WORKLOAD.group_size
    order = torch.tensor([g * n + i for i in range(n) for g in range(bsz // n)])
    return {k: (v[order] if v.shape[:1] == (bsz,) else v) for k, v in batch.items()}


@pytest.mark.parametrize("remove_padding,split", [(True, "grouped"), (False, "grouped"), (True, "scattered"),
                                                  (True, "dynamic")])
def test_shared_prompt_update_equals_stock_verl(tmp_path, remove_padding, split):
    """Fixed micro-batches of whole groups; the groups scattered (the engine's own split puts each
    group's sequences together); scattered under dynamic batch sizes (verl's token limit kept)."""
    model_dir = save_tiny_model(tmp_path / "tiny-qwen2", "qwen2", seed=0)
    batch = make_grpo_batch(WORKLOAD, seed=3)
    batch = batch if split == "grouped" else _scattered(batch)
    if split == "dynamic":  # every sequence fits; about two micro-batches per rank
        remove_padding = {"max_token_len_per_gpu": int(batch["attention_mask"].sum(-1).max()) * 2 + 8}
    ranks = run_on_ranks(_compare, 2, args=(model_dir, batch, remove_padding))
    print("\n", [(round(s["cos"], 9), f'{s["rel"]:.1e}', f'{s["worst_param_rel"]:.1e}', s["share"], s["planned"])
                 for r in ranks for s in r["steps"]])
    for rank in ranks:
        for step in rank["steps"]:
            assert step["cos"] >= 0.999999 and step["rel"] <= 1e-5 and step["worst_param_rel"] <= 1e-5, step
            for key, value in step["verl0"].items():  # verl's loss and metrics, as stock verl computes them
                if split != "grouped" and key not in SPLIT_FREE:
                    continue  # a per-micro-batch mean (clip fractions, ppo_kl): it follows how they are formed
                assert _close(step["verl"][key], value, mean=split != "grouped"), (key, step["verl"][key], value)
        if remove_padding:  # each micro-batch: one prompt for two responses
            assert rank["check"]["ok"] and all(s["on"] == 1.0 for s in rank["steps"]), rank  # the self-check passed
            assert all(s["share"] is not None and s["share"] < 0.9 for s in rank["steps"]), rank["steps"]
            # planned at the tokens the layers compute, budgeted at verl's packed rows; the first step is planned
            # before the self-check (in verl's trainer the log-prob pass runs it first) at the packed rows
            assert all(t <= r for t, r in rank["steps"][0]["planned"]), rank["steps"][0]
            for s in rank["steps"][1:]:
                assert all(t < r for t, r in s["planned"]), s
            assert rank["refusals"] == []
        else:  # verl's padded layout cannot be shared: said once, trained (and planned) as before
            assert all(s["share"] is None for s in rank["steps"]) and len(rank["refusals"]) == 1, rank
            assert all(t == r for s in rank["steps"] for t, r in s["planned"]), rank


def test_a_model_with_attention_sinks_is_refused_at_start_up():
    from hilore_verl.integration.actor.shared_prompt import unsupported_model

    assert "sinks" in unsupported_model(build_tiny_model("gpt_oss"))
    assert unsupported_model(build_tiny_model("qwen2")) is None


def test_the_split_is_read_from_jagged_or_padded_response_masks():
    from hilore_verl.integration.actor.shared_prompt import _response_lengths

    offsets = [0, 5, 9]  # two sequences of 5 and 4 tokens
    jagged = torch.nested.nested_tensor_from_jagged(torch.ones(3), offsets=torch.tensor([0, 2, 3]))  # verl's trainer
    assert _response_lengths({"response_mask": jagged}, offsets) == [2, 1]
    too_long = torch.nested.nested_tensor_from_jagged(torch.ones(7), offsets=torch.tensor([0, 6, 7]))
    assert _response_lengths({"response_mask": too_long}, offsets) is None
    padded = {"response_mask": torch.ones(2, 3),  # left_right_2_no_padding: responses right-padded, 3 wide
              "attention_mask": torch.tensor([[0, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 0, 0]])}
    assert _response_lengths(padded, offsets) == [2, 1]
    assert _response_lengths({"response_mask": torch.ones(2, 3)}, offsets) is None


def test_the_planner_is_told_the_tokens_the_shared_layout_computes():
    """SharedPrompt.tokens (what the session plans a micro-batch by) is the row the layout builds, read
    from verl's micro-batch (nested ids, jagged response mask); verl's packed row where it cannot share."""
    import verl.utils.tensordict_utils as tu
    from tensordict import TensorDict

    from hilore_verl.integration.actor.shared_prompt import SharedPrompt, _sequences
    from hilore_verl.shared_prompt import SharedLayout

    prompts = [[5, 6, 7], [5, 6, 7], [9, 8], [5, 6, 7], [4]]
    responses = [[1, 2], [3], [4, 4, 4], [2, 2, 2, 2], [7, 7]]
    ids = torch.nested.as_nested_tensor([torch.tensor(p + r) for p, r in zip(prompts, responses)],
                                        layout=torch.jagged)
    mask = torch.nested.as_nested_tensor([torch.ones(len(r)) for r in responses], layout=torch.jagged)
    micro_batch = TensorDict({"input_ids": ids, "response_mask": mask}, batch_size=[len(prompts)])
    tu.assign_non_tensor(micro_batch, use_remove_padding=True)
    layout = SharedLayout.build([(k, p, r) for k, p, r in _sequences(micro_batch)])
    n = sum(len(p) + len(r) for p, r in zip(prompts, responses))
    def checked(shared):  # after a passed first-use self-check
        shared.checked(True, "agreed", 0.0)
        return shared

    assert SharedPrompt().tokens(micro_batch) == n  # before the self-check nothing runs shared
    assert SharedPrompt().would_share(micro_batch)
    assert checked(SharedPrompt()).tokens(micro_batch) == layout.shared_tokens == n - 2 * 3 < n
    tu.assign_non_tensor(micro_batch, use_fused_kernels=True)  # a micro-batch the layout refuses
    assert checked(SharedPrompt()).tokens(micro_batch) == n
    assert checked(SharedPrompt(sp_size=2)).tokens(micro_batch) == n
    assert not SharedPrompt().would_share(micro_batch)


def _forced_mismatch(rank, world_size, model_dir, batch):
    """The shared attention perturbed (as a wrong mask would): the self-check must turn sharing off."""
    from hilore_verl.integration.actor.engine import HiLoReFSDPEngine
    from hilore_verl.integration.tools.verl_engine import actor_config, build_fsdp_engine, ppo_loss_fn
    from hilore_verl.shared_prompt import attention

    exact = attention.shared_prompt_attention

    def wrong(*args, **kwargs):
        out, weights = exact(*args, **kwargs)
        return out + 0.5, weights

    attention.shared_prompt_attention = wrong
    said = _messages()
    config = actor_config()
    loss_fn = ppo_loss_fn(config)
    stock = build_fsdp_engine(model_dir, gradient_checkpointing=True, lr=0.0, clip_grad=1e9)
    _, grads0 = _step(stock, batch, rank, world_size, loss_fn)
    engine = build_fsdp_engine(model_dir, gradient_checkpointing=True, lr=0.0, clip_grad=1e9,
                               engine_cls=HiLoReFSDPEngine, actor_config=config,
                               hilore={"enable": True, "risk_budget": 0.0, "min_bytes": 1024, "audit_every": 0,
                                       "skip_zero_exposure": False})  # shared_prompt: on by default
    metrics, grads = _step(engine, batch, rank, world_size, loss_fn)
    return {"on": metrics["hilore/shared_prompt_on"], "share": metrics.get("hilore/shared/token_share"),
            "said": [m for m in said if "self-check" in m], "check": engine._shared.check,
            "equal": all(torch.equal(grads[n], g) for n, g in grads0.items())}


def test_a_shared_forward_that_disagrees_turns_sharing_off_for_the_run(tmp_path):
    """On by default; the first micro-batch it would share is also computed per sequence: a disagreement
    (forced here) turns sharing off on every rank with one warning and the metric, and the update is
    stock verl's bitwise (the ordinary layout, exact plans)."""
    model_dir = save_tiny_model(tmp_path / "tiny-qwen2", "qwen2", seed=0)
    ranks = run_on_ranks(_forced_mismatch, 2, args=(model_dir, make_grpo_batch(WORKLOAD, seed=3)))
    for rank in ranks:
        assert rank["check"]["ok"] is False and "max |diff|" in rank["check"]["why"], rank
        assert _numbers(rank["on"]) == [0.0] and rank["share"] is None, rank
        assert len(rank["said"]) == 1 and "shared prompt off for this run" in rank["said"][0], rank["said"]
        assert rank["equal"], rank
