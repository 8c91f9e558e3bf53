"""The gloo harness itself: results come back per rank, and a failing rank is reported, not hung on."""

import os

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


def _where(rank: int, world: int) -> tuple:
    import sys

    return os.environ.get("PACKLOADER_HARNESS_PROBE"), os.getcwd(), sys.path[0], torch.get_num_threads()


def test_ranks_see_the_callers_environment_cwd_and_path_at_the_call(tmp_path, monkeypatch):
    """The ranks are forked from a server started at the first call; each still gets what a spawned rank got:
    the environment, working directory and sys.path of the caller as they are at this call, not at the server's
    start, and the thread count OMP_NUM_THREADS gives torch, not the caller's."""
    run_ranks(_where, 1)  # the server runs from here on (if no earlier test started it)
    monkeypatch.setenv("PACKLOADER_HARNESS_PROBE", "set after the server started")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 3)
    try:
        got = run_ranks(_where, 2)
    finally:
        torch.set_num_threads(threads)
    # a spawned rank's torch took its thread count from OMP_NUM_THREADS, which the harness sets to 1 if unset
    threads = int(os.environ.get("OMP_NUM_THREADS", "1"))
    assert got == [("set after the server started", str(tmp_path), str(tmp_path), threads)] * 2
