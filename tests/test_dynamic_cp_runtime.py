"""Per-document CP over gloo: CP groups of sizes 1, 2, 4 and 8 in one micro-batch slot of a pool of G = 4 and 8
GPUs. Every GPU runs `dynamic_cp_attention` on its part; its outputs and the gradients of its q, k and v rows must
equal a dense single-process causal attention over the whole documents (tests/helpers, independent of packloader's
attention); the pool's aligned groups are created once."""

from __future__ import annotations

import pytest
import torch
from helpers.dense_attention import dense_causal_reference
from helpers.distributed import run_ranks

from packloader.contracts import CPPlacement, MicroBatch, Segment

D, HQ, HKV = 4, 4, 2

# per pool size: micro-batch slots, each {doc: (length, CPPlacement)}
SLOTS = {
    4: [
        {1: (37, CPPlacement(4, 0)), 2: (10, CPPlacement(2, 0)), 3: (5, CPPlacement(1, 2)), 4: (9, CPPlacement(2, 2)),
         5: (3, CPPlacement(1, 3)), 6: (1, CPPlacement(1, 0))},
        {7: (3, CPPlacement(4, 0)), 8: (6, CPPlacement(1, 1))},  # GPU 3 owns no token of document 7
    ],
    8: [
        {1: (53, CPPlacement(8, 0)), 2: (21, CPPlacement(4, 4)), 3: (11, CPPlacement(2, 0)),
         4: (7, CPPlacement(2, 2)), 5: (4, CPPlacement(1, 2)), 6: (6, CPPlacement(1, 3)), 7: (2, CPPlacement(4, 4))},
        {8: (3, CPPlacement(4, 4)), 9: (19, CPPlacement(4, 0)), 10: (5, CPPlacement(1, 6))},  # GPU 7: no token
    ],
}


def _micro_batch(slot: dict, gpu: int) -> MicroBatch:
    docs = [d for d, (_, p) in slot.items() if p.first <= gpu < p.first + p.size]
    if gpu % 2:
        docs.reverse()  # members list a group's documents in different orders
    return MicroBatch(segments=[Segment(d, 0, slot[d][0], 0) for d in docs], cp=[slot[d][1] for d in docs])


def _doc_tensors(doc: int, length: int):
    g = torch.Generator().manual_seed(1000 + doc)
    return tuple(torch.randn(length, h, D, generator=g, dtype=torch.float64) for h in (HQ, HKV, HKV, HQ))


def _rank(rank: int, world: int) -> dict:
    import numpy as np

    from packloader.collate.cp_document_shards import plan_dynamic_cp
    from packloader.runtime.cp_document_attention import dynamic_cp_attention
    from packloader.runtime.groups import ProcessGroupCache, prepare_cp_pool_groups

    cache = ProcessGroupCache()
    prepare_cp_pool_groups(world, groups=cache)
    created = cache.created
    prepare_cp_pool_groups(world, groups=cache)  # nothing new: created once, looked up per segment
    err, sizes = 0.0, set()
    for slot in SLOTS[world]:
        mb = _micro_batch(slot, rank)
        shard = plan_dynamic_cp(mb, gpu=rank, pool=world)
        sizes |= {g.size for g in shard.groups}
        runs = np.diff(shard.cu_seqlens_q)
        doc_of = [mb.segments[s].doc for s in np.repeat(shard.run_segment, runs)]
        pos = shard.position_ids.tolist()
        ref = {d: dense_causal_reference(*_doc_tensors(d, slot[d][0]), D ** -0.5) for d in set(doc_of)}
        local = [torch.stack([_doc_tensors(d, slot[d][0])[j][p] for d, p in zip(doc_of, pos)])
                 if pos else torch.zeros(0, HQ if j in (0, 3) else HKV, D, dtype=torch.float64) for j in range(4)]
        q, k, v = (t.clone().requires_grad_(True) for t in local[:3])
        out = dynamic_cp_attention(q, k, v, shard, cache, backend="reference")
        (out * local[3]).sum().backward()
        for j, got in enumerate((out.detach(), q.grad, k.grad, v.grad)):
            if pos:
                want = torch.stack([ref[d][j][p] for d, p in zip(doc_of, pos)])
                err = max(err, float((got - want).abs().max()))
    return {"created": created, "again": cache.created, "err": err, "sizes": sorted(sizes)}


@pytest.mark.multiprocess
@pytest.mark.parametrize("pool", [4, 8])
def test_dynamic_cp_attention_mixed_group_sizes_match_reference_over_gloo(pool):
    res = run_ranks(_rank, pool, timeout=180)
    assert all(r["created"] == pool - 1 and r["again"] == pool - 1 for r in res)  # sizes 2 .. pool, aligned
    assert max(r["err"] for r in res) < 1e-10
    assert set().union(*(r["sizes"] for r in res)) == {s for s in (1, 2, 4, 8) if s <= pool}
