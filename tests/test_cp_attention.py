"""CP attention over gloo (CP 2, 3, 4): outputs and gradients of q, k, v equal the single-process varlen reference
on the whole packed batch, for random packs (one long document; many short; lengths not divisible by 2 x CP;
single-token documents), every sharding mode, with and without GQA."""

from __future__ import annotations

import pytest
import torch
from helpers.distributed import run_ranks

from packloader.runtime.cp_cost import cp_cost

COST = cp_cost()  # the llama3-8b preset's estimate

PACKS = {
    "one_long": [37],
    "many_short": [3, 1, 4, 1, 5, 9, 2, 6, 5, 3],
    "not_divisible": [13, 7, 22, 9],
    "single_tokens": [1, 1, 1, 11, 1],
    "random": None,  # drawn per CP size
}
MODES = ("sequence", "document", "hierarchical", "adaptive")
HEADS = ((4, 4), (4, 2))  # (Hq, Hkv): MHA, GQA (MQA once per pack below)
D = 4


def _cu(lengths):
    c = [0]
    for n in lengths:
        c.append(c[-1] + n)
    return torch.tensor(c, dtype=torch.int32)


def _data(lengths, hq, hkv, seed):
    g = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    q = torch.randn(T, hq, D, generator=g, dtype=torch.float64)
    k = torch.randn(T, hkv, D, generator=g, dtype=torch.float64)
    v = torch.randn(T, hkv, D, generator=g, dtype=torch.float64)
    w = torch.randn(T, hq, D, generator=g, dtype=torch.float64)  # d(loss)/d(out)
    return q, k, v, w


def _reference(lengths, q, k, v, w, causal, window):
    from packloader.runtime.attention import varlen_attention

    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    cu = _cu(lengths)
    m = max(lengths)
    out = varlen_attention(q, k, v, cu, cu, m, m, causal=causal, window=window, backend="reference")
    (out * w).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def _configs(cp):
    import random

    rnd = random.Random(cp)
    out = []
    for name, lengths in PACKS.items():
        if lengths is None:
            lengths = [rnd.choice([1, 2, 3, 5, 8, 13, 21]) for _ in range(rnd.randint(2, 7))]
        for mode in MODES:
            for hq, hkv in HEADS:
                out.append((name, lengths, mode, hq, hkv, True, (-1, -1)))
        out.append((name, lengths, "adaptive", 4, 1, True, (-1, -1)))  # MQA
        out.append((name, lengths, "document", 4, 2, True, (2, -1)))  # sliding window
        out.append((name, lengths, "hierarchical", 4, 2, False, (-1, -1)))  # bidirectional
    return out


def _maxabs(a, b) -> float:
    if a is None:  # a rank that owns no token gets no gradient at all
        return 0.0 if b.numel() == 0 else float("inf")
    d = (a - b).abs()
    return float(d.max()) if d.numel() else 0.0


def _check_rank(rank: int, world: int, force_all_reduce: bool) -> list[tuple[str, float]]:
    import torch.distributed as dist

    from packloader.collate.cp_sequence_shards import plan_cp_shards
    from packloader.runtime import cp_attention as cpa

    torch.set_num_threads(1)
    cpa.FORCE_ALL_REDUCE = force_all_reduce
    results = []
    for i, (name, lengths, mode, hq, hkv, causal, window) in enumerate(_configs(world)):
        q, k, v, w = _data(lengths, hq, hkv, seed=1000 * world + i)
        ref_out, ref_dq, ref_dk, ref_dv = _reference(lengths, q, k, v, w, causal, window)
        plan = plan_cp_shards(lengths, world, mode, cost=COST)
        assert plan.cp_size == world and plan.ranks[rank].rank == rank
        shard = plan.ranks[rank]
        idx = torch.from_numpy(shard.token_index)
        ql, kl, vl = (t[idx].clone().requires_grad_(True) for t in (q, k, v))
        out = cpa.cp_attention(ql, kl, vl, shard, None, causal=causal, window=window, backend="reference")
        (out * w[idx]).sum().backward()
        err = max(_maxabs(out.detach(), ref_out[idx]), _maxabs(ql.grad, ref_dq[idx]),
                  _maxabs(kl.grad, ref_dk[idx]), _maxabs(vl.grad, ref_dv[idx]))
        results.append((f"{name}/{plan.mode}/{hq}:{hkv}/causal={causal}/window={window}", err))
    dist.barrier()
    return results


@pytest.mark.parametrize("cp", [2, 3, 4])
@pytest.mark.multiprocess
def test_cp_attention_matches_single_process_reference(cp):
    per_rank = run_ranks(_check_rank, cp, cp == 3, timeout=120)  # CP 3 also exercises the all_reduce fallback
    bad = [(rank, name, err) for rank, res in enumerate(per_rank) for name, err in res if not err < 1e-10]
    assert not bad, bad
    assert len(per_rank[0]) == len(_configs(cp))


def test_cp_size_one_without_distributed():
    from packloader.collate.cp_sequence_shards import plan_cp_shards
    from packloader.runtime.cp_attention import cp_attention

    lengths = [5, 1, 7]
    q, k, v, w = _data(lengths, 4, 2, seed=0)
    ref_out, ref_dq, ref_dk, ref_dv = _reference(lengths, q, k, v, w, True, (-1, -1))
    shard = plan_cp_shards(lengths, 1, "document", cost=COST).ranks[0]
    ql, kl, vl = (t.clone().requires_grad_(True) for t in (q, k, v))
    out = cp_attention(ql, kl, vl, shard)
    (out * w).sum().backward()
    for a, b in ((out.detach(), ref_out), (ql.grad, ref_dq), (kl.grad, ref_dk), (vl.grad, ref_dv)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_mismatched_shard_is_refused():
    from packloader.collate.cp_sequence_shards import plan_cp_shards
    from packloader.runtime.cp_attention import cp_attention

    shard = plan_cp_shards([4, 4], 2, "document", cost=COST).ranks[0]
    q = torch.randn(shard.num_tokens, 2, D)
    with pytest.raises(ValueError, match="CP size 2"):
        cp_attention(q, q, q, shard)
    one = plan_cp_shards([4, 4], 1, cost=COST).ranks[0]
    with pytest.raises(ValueError, match="owns 8 tokens"):
        cp_attention(q, q, q, one)
