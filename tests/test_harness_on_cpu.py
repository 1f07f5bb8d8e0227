"""The 2-rank launcher: results come back in rank order, and a failure on any rank fails the call."""

import pytest
import torch
import torch.distributed as dist
from tests.harness.distributed import RankFailed, run_on_ranks


def _all_reduce_rank(rank, world_size, offset):
    t = torch.tensor([float(rank + offset)])
    dist.all_reduce(t)
    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "sum": t.item(),
            "backend": dist.get_backend()}


def _fail_on_rank_one(rank, world_size):
    if rank == 1:
        raise ValueError("rank one fails on purpose")
    return rank


def test_results_in_rank_order():
    results = run_on_ranks(_all_reduce_rank, 2, args=(10,))
    assert results == [{"rank": r, "world": 2, "sum": 21.0, "backend": "gloo"} for r in (0, 1)]


def test_a_failing_rank_fails_the_call():
    for _ in range(3):  # the other rank then fails in its barrier: the report must still name rank 1
        with pytest.raises(RankFailed, match="(?s)failed on rank 1.*rank one fails on purpose"):
            run_on_ranks(_fail_on_rank_one, 2)
