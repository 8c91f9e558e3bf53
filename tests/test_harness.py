"""The gloo harness itself: results come back per rank, and a failing rank is reported, not hung on."""

import pytest
import torch
import torch.distributed as dist
from helpers.distributed import run_ranks

pytestmark = pytest.mark.multiprocess  # every test here starts processes


def _allreduce(rank: int, world: int) -> float:
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return float(t)


def _fails_on_one(rank: int, world: int) -> int:
    if rank == 1:
        raise RuntimeError("rank one broke")
    return rank


def test_allreduce_over_gloo():
    assert run_ranks(_allreduce, 3) == [6.0, 6.0, 6.0]


def test_failing_rank_is_reported():
    with pytest.raises(AssertionError, match="rank one broke"):
        run_ranks(_fails_on_one, 2, timeout=60)
