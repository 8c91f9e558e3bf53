"""DP-Merge groups over gloo: created once up front (all ranks, same order), and a plan's dp_group micro-batch run
as CP over its group gives the single-process reference result."""

from __future__ import annotations

import pytest
import torch
from helpers.distributed import run_ranks

from packloader.contracts import MicroBatch, RankPlan, Segment, StepPlan
from packloader.runtime.groups import contiguous_pow2_groups, groups_in_plans

D = 4


def _plan() -> StepPlan:
    outlier = MicroBatch(segments=[Segment(7, 0, 29, 0), Segment(8, 0, 3, 0)], dp_group=[1, 2])
    everyone = MicroBatch(segments=[Segment(9, 0, 41, 0), Segment(10, 0, 1, 0), Segment(11, 0, 6, 0)],
                          dp_group=[3, 2, 1, 0])
    plain = MicroBatch(segments=[Segment(1, 0, 5, 0)])
    return StepPlan(step=0, ranks=[
        RankPlan(micro_batches=[plain, everyone]),
        RankPlan(micro_batches=[outlier, everyone]),
        RankPlan(micro_batches=[outlier, everyone]),
        RankPlan(micro_batches=[plain, everyone]),
    ])


def _data(mb: MicroBatch, seed: int):
    g = torch.Generator().manual_seed(seed)
    T = mb.num_tokens
    return tuple(torch.randn(T, h, D, generator=g, dtype=torch.float64) for h in (4, 2, 2, 4))  # q, k, v, dout


def _reference(mb: MicroBatch, q, k, v, w):
    from packloader.runtime.attention import varlen_attention

    lengths = [s.num_tokens for s in mb.segments]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    out = varlen_attention(q, k, v, cu, cu, max(lengths), max(lengths), backend="reference")
    (out * w).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def _rank(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from packloader.runtime.groups import ProcessGroupCache, dp_merge_attention, dp_merge_shard, prepare_dp_merge_groups

    plan = _plan()
    cache = ProcessGroupCache()
    prepare_dp_merge_groups(world, plans=[plan], groups=cache)  # aligned pow2 blocks + [1, 2] from the plan
    created = cache.created
    prepare_dp_merge_groups(world, plans=[plan, plan], groups=cache)  # nothing new: created once
    errors = []
    for i, mb in enumerate(plan.ranks[rank].micro_batches):
        if not mb.dp_group:
            continue
        q, k, v, w = _data(mb, seed=i)
        ref = _reference(mb, q, k, v, w)
        shard = dp_merge_shard(mb, dp_rank=rank, mode="document" if mb.dp_group == [1, 2] else None)
        idx = torch.from_numpy(shard.token_index)
        ql, kl, vl = (t[idx].clone().requires_grad_(True) for t in (q, k, v))
        out = dp_merge_attention(ql, kl, vl, mb, dp_rank=rank, shard=shard, groups=cache, backend="reference")
        (out * w[idx]).sum().backward()
        for got, want in zip((out.detach(), ql.grad, kl.grad, vl.grad), ref):
            errors.append(float((got - want[idx]).abs().max()) if got is not None and got.numel() else 0.0)
    missing = ""
    try:
        cache.get([0, 3])
    except KeyError as e:
        missing = str(e)
    dist.barrier()
    return {"created": created, "again": cache.created, "keys": cache.keys(), "err": max(errors), "missing": missing}


@pytest.mark.multiprocess
def test_dp_merge_groups_run_cp_attention_over_gloo():
    res = run_ranks(_rank, 4, timeout=120)
    for r in res:
        assert r["err"] < 1e-10
        assert r["created"] == r["again"] == 4  # (0,1), (2,3), (0,1,2,3) aligned, plus (1,2) from the plan
        assert r["keys"] == [(0, 1), (1, 2), (2, 3), (0, 1, 2, 3)]
        assert "no process group was created for ranks [0, 3]" in r["missing"] and "up front" in r["missing"]


def test_group_lists():
    assert contiguous_pow2_groups(8) == [(0, 1), (2, 3), (4, 5), (6, 7), (0, 1, 2, 3), (4, 5, 6, 7), tuple(range(8))]
    assert contiguous_pow2_groups(4, aligned=False) == [(0, 1), (1, 2), (2, 3), (0, 1, 2, 3)]
    assert contiguous_pow2_groups(6) == [(0, 1), (2, 3), (4, 5), (0, 1, 2, 3)]
    # DP ranks 0..3 at global ranks 0, 2, 4, 6 (say TP=2) and 1, 3, 5, 7 (the other TP coordinate)
    maps = [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert groups_in_plans([_plan()], rank_maps=maps) == [(2, 4), (3, 5), (0, 2, 4, 6), (1, 3, 5, 7)]


def test_not_a_member_or_no_group():
    from packloader.runtime.groups import dp_merge_group

    with pytest.raises(ValueError, match="not in this micro-batch's dp_group"):
        dp_merge_group(_plan().ranks[1].micro_batches[0], dp_rank=0)
    with pytest.raises(ValueError, match="no dp_group"):
        dp_merge_group(MicroBatch(segments=[Segment(0, 0, 3, 0)]), dp_rank=0)
