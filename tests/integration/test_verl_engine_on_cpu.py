"""verl's own FSDP2 engine (train_batch with verl's ppo_loss) on 2 gloo ranks vs plain transformers.

One GRPO mini-batch of 8 sequences, 4 per rank, 2 micro-batches per rank, fp32. The reference
runs the same model in one process with the PPO dual-clip loss written out by hand. fp32
tolerances: loss to 1e-6 relative (measured: 1e-8 packed, 8e-8 padded); every gradient tensor to
5e-6 of its largest entry (measured: at most 9.3e-7, in the norm weights). Summation order
differs between sharded/packed micro-batches and the whole padded batch, so bitwise is not expected.
"""

import pytest
import torch

from hilore_verl.tiny.models import build_tiny_model, save_tiny_model
from hilore_verl.tiny.workload import GRPOWorkload, make_grpo_batch, shard
from tests.harness.distributed import run_on_ranks
from hilore_verl.tiny.workload import response_log_probs
from tests.harness.reference import ppo_clip_loss

WORKLOAD = GRPOWorkload(num_groups=2, group_size=4, max_prompt_len=12, max_response_len=16, zero_advantage_share=0.5)


def _train_one_mini_batch(rank, world_size, model_dir, batch, use_remove_padding):
    from hilore_verl.integration.tools.verl_engine import actor_config, build_fsdp_engine, ppo_loss_fn, to_engine_batch
    from verl.utils.device import get_device_name

    engine = build_fsdp_engine(model_dir, use_remove_padding=use_remove_padding, micro_batch_size_per_gpu=2,
                               clip_grad=1e9)  # no clipping: gradients are compared raw
    td = to_engine_batch(shard(batch, rank, world_size), use_remove_padding=use_remove_padding,
                         micro_batch_size_per_gpu=2, global_batch_size=batch["input_ids"].shape[0])
    with engine.train_mode():
        out = engine.train_batch(td, loss_function=ppo_loss_fn(actor_config()))
        # full_tensor() all-gathers each sharded gradient (every rank calls it).
        grads = {name: p.grad.full_tensor() for name, p in engine.module.named_parameters()}
    return {
        "device": get_device_name(),
        "module": type(engine.module).__name__,
        "micro_batch_losses": [float(x) for x in out["loss"]],
        "grad_norm": float(out["metrics"]["grad_norm"]),
        "grads": grads,
    }


@pytest.mark.parametrize("use_remove_padding", [True, False], ids=["packed", "padded"])
def test_fsdp2_train_batch_matches_transformers(tmp_path, use_remove_padding):
    model_dir = save_tiny_model(tmp_path / "tiny-qwen2", "qwen2", seed=0)
    batch = make_grpo_batch(WORKLOAD, seed=1)

    reference = build_tiny_model("qwen2", seed=0)
    log_prob = response_log_probs(reference, batch)
    # Rollout log-probs near the current policy, so some tokens clip and some do not.
    noise = torch.randn(log_prob.shape, generator=torch.Generator().manual_seed(2)) * 0.3
    batch["old_log_probs"] = (log_prob.detach() + noise) * batch["response_mask"]
    ref_loss = ppo_clip_loss(log_prob, batch["old_log_probs"], batch["advantages"], batch["response_mask"])
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in reference.named_parameters()}
    ratio = torch.exp(log_prob - batch["old_log_probs"])[batch["response_mask"].bool()]
    assert ((ratio < 0.8) | (ratio > 1.2)).any() and ((ratio > 0.8) & (ratio < 1.2)).any()

    results = run_on_ranks(_train_one_mini_batch, 2, args=(model_dir, batch, use_remove_padding))

    assert [r["device"] for r in results] == ["cpu", "cpu"]
    assert results[0]["module"].startswith("FSDP")  # FSDP2 wraps the model class itself
    assert all(len(r["micro_batch_losses"]) == 2 for r in results)
    # ppo_loss scales each rank's share by dp_size; FSDP averages gradients over ranks.
    engine_loss = sum(sum(r["micro_batch_losses"]) for r in results) / 2
    assert engine_loss == pytest.approx(ref_loss.item(), rel=1e-6, abs=1e-9)

    grads = results[0]["grads"]
    assert set(grads) == set(ref_grads)
    for name, ref in ref_grads.items():
        scale = ref.abs().max().item()
        diff = (grads[name] - ref).abs().max().item()
        assert diff <= 5e-6 * scale + 1e-12, f"{name}: max|diff| {diff:.3e} vs max|grad| {scale:.3e}"
        assert torch.equal(grads[name], results[1]["grads"][name])  # both ranks hold the same gradient
    ref_norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in ref_grads.values()])).item()
    assert results[0]["grad_norm"] == pytest.approx(ref_norm, rel=1e-5)
