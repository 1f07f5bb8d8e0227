"""Whole prompt groups per rank in verl's v1 trainer under `actor.use_prefix_grouper` (group_balance.py):
verl 0.9.1's own `PPOTrainer._balance_batch`, wrapped, on a batch laid out as its rollouts finish."""

import random
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from hilore_verl.integration.actor import group_balance


def _batch(groups: int, n: int, seed: int = 0, pad: int = 0):
    """verl's v1 batch metadata: keys `{uid}_{session}_0`, in a shuffled (finish) order; `pad` extra samples
    of one padding group, as verl's upsampling adds them."""
    from transfer_queue import KVBatchMeta

    rng = random.Random(seed)
    uids = [f"{rng.getrandbits(64):016x}-{g}" for g in range(groups)]
    samples = [(uid, s, rng.randint(20, 200)) for uid in uids for s in range(n)]
    samples += [("padfeed", s, 1) for s in range(pad)]
    rng.shuffle(samples)
    return KVBatchMeta(keys=[f"{uid}_{s}_0" for uid, s, _ in samples],
                       tags=[{"seq_len": length, "status": "success"} for _, _, length in samples])


def _trainer(ranks: int, grouper: bool):
    config = OmegaConf.create({"actor_rollout_ref": {"actor": {"use_prefix_grouper": grouper}}})
    return SimpleNamespace(config=config, tokenizer=SimpleNamespace(eos_token_id=0),
                           actor_rollout_wg=SimpleNamespace(_dispatch_info={"actor": list(range(ranks))}),
                           _get_required_batch_multiple=lambda dp: dp)


def _balance(batch, ranks: int, grouper: bool) -> dict:
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    import hilore_verl.plugin  # noqa: F401  (loads the plugin: the wrap is in place once verl imported the module)

    assert getattr(PPOTrainer._balance_batch, "__hilore_groups__", False)
    metrics: dict = {}
    out = PPOTrainer._balance_batch(_trainer(ranks, grouper), batch, metrics=metrics)
    assert out is batch
    return metrics


def _chunks(batch, ranks: int) -> list[list[str]]:
    per = len(batch) // ranks  # verl's dispatch: equal contiguous chunks, one per rank
    return [[group_balance.group_of(k) for k in batch.keys[r * per:(r + 1) * per]] for r in range(ranks)]


@pytest.mark.parametrize("groups,n,ranks", [(8, 8, 2), (12, 4, 4), (6, 5, 3), (4, 16, 2)])
def test_under_the_flag_each_rank_holds_whole_groups_each_contiguous(groups, n, ranks):
    batch = _batch(groups, n)
    before = sorted(zip(batch.keys, (t["seq_len"] for t in batch.tags)))
    metrics = _balance(batch, ranks, grouper=True)
    assert sorted(zip(batch.keys, (t["seq_len"] for t in batch.tags))) == before  # a permutation, tags with keys
    seen = set()
    for chunk in _chunks(batch, ranks):
        runs = [chunk[i] for i in range(len(chunk)) if i == 0 or chunk[i] != chunk[i - 1]]
        assert len(runs) == len(set(runs)) == groups // ranks  # contiguous, whole, as many groups per rank
        assert all(chunk.count(u) == n for u in runs)
        seen |= set(runs)
    assert len(seen) == groups
    lengths = [t["seq_len"] for t in batch.tags]
    per = len(lengths) // ranks
    loads = [sum(lengths[r * per:(r + 1) * per]) for r in range(ranks)]
    assert metrics["global_seqlen/max"] == max(loads) and metrics["global_seqlen/min"] == min(loads)


def test_without_the_flag_verls_balance_of_sequences_stands():
    batch = _batch(8, 8, seed=3)
    _balance(batch, 2, grouper=False)
    assert any(len(set(chunk)) > 4 for chunk in _chunks(batch, 2))  # groups spread over the ranks


def test_groups_that_cannot_be_balanced_whole_keep_verls_order_with_the_reason():
    assert group_balance.group_order(["a_0_0", "a_1_0", "b_0_0"], [1, 1, 1], 1)[1].startswith("groups of [1, 2]")
    assert "do not divide over 2 ranks" in group_balance.group_order(["a_0_0", "b_0_0", "c_0_0"], [1] * 3, 2)[1]
    assert "is not verl's" in group_balance.group_order(["a_0_0", "weird"], [1, 1], 1)[1]
    batch = _batch(8, 4, seed=5, pad=2)  # verl's padding samples: a group of another size
    expected = list(batch.keys)
    verl_only = _batch(8, 4, seed=5, pad=2)
    _balance(verl_only, 2, grouper=False)
    _balance(batch, 2, grouper=True)
    assert batch.keys == verl_only.keys and sorted(batch.keys) == sorted(expected)


def test_group_keys_read_from_verls_sample_keys():
    assert group_balance.group_of("3f2a-uuid-with-dashes_7_0") == "3f2a-uuid-with-dashes"
    assert group_balance.group_of("uid_with_underscores_3_1") == "uid_with_underscores"
    assert group_balance.group_of("pad0a1b_2_0") == "pad0a1b"
    assert group_balance.group_of("noparts") is None and group_balance.group_of("a_x_0") is None
