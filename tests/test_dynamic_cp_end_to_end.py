"""Per-document CP end to end over gloo: the real dynamic-cp planner (PackedLoader with cp_mode "dynamic") hands
each of G = 4 processes (DP 2 x CP 2) its part of every step by its cp_rank; each runs `dynamic_cp_attention`
over the pool's groups (`prepare_cp_pool_groups`). Outputs and q/k/v gradients must equal a dense single-process
causal attention over each whole piece (the document cut at the context: tests/helpers, independent of packloader's
attention and plan), and over the pool every token of every document is trained once in the epoch."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from helpers.dense_attention import dense_causal_reference
from helpers.distributed import run_ranks
from helpers.docs import token_docs

D, HQ, HKV = 4, 4, 2
DP, CP, CONTEXT = 2, 2, 128


def _docs():
    return token_docs(40, seed=3, max_len=200)


def _config():
    from packloader.contracts import ParallelConfig, PlanConfig

    # 32 tokens per GPU a slot (max_tokens / cp): 128-token pieces need the whole pool, shorter ones less
    return PlanConfig(strategy="auto", parallel=ParallelConfig(dp=DP, cp=CP), max_tokens=64, context=CONTEXT,
                      tokens_per_step=400, allow_slicing=False, cp_mode="dynamic")


def _doc_tensors(doc: int, length: int):
    g = torch.Generator().manual_seed(2600 + doc)
    return tuple(torch.randn(length, h, D, generator=g, dtype=torch.float64) for h in (HQ, HKV, HKV, HQ))


def _piece_reference(doc: int, length: int, start: int, cache: dict):
    """Dense attention over the piece of `doc` starting at `start`: the document cut every CONTEXT tokens."""
    key = (doc, start)
    if key not in cache:
        full = _doc_tensors(doc, length)
        end = min(length, start + CONTEXT)
        cache[key] = dense_causal_reference(*(t[start:end] for t in full), D ** -0.5)
    return cache[key]


def _rank(rank: int, world: int) -> dict:
    import numpy as np

    from packloader.loader.loader import PackedLoader
    from packloader.runtime.cp_document_attention import dynamic_cp_attention
    from packloader.runtime.groups import ProcessGroupCache, prepare_cp_pool_groups
    from packloader.sources.base import IterableSource

    groups = ProcessGroupCache()
    prepare_cp_pool_groups(world, groups=groups)
    docs = _docs()
    loader = PackedLoader(IterableSource(docs), config=_config(), dp_rank=rank // CP, cp_rank=rank % CP,
                          num_threads=0)
    seen: Counter = Counter()
    refs: dict = {}
    err, sizes, batches, wrong_ids = 0.0, set(), 0, 0
    for b in loader:
        batches += 1
        shard = b.cp
        assert shard is not None and shard.gpu == rank
        sizes |= {g.size for g in shard.groups}
        segs = [b.segments[i] for i in np.repeat(shard.run_segment, np.diff(b.cu_seqlens.numpy()))]
        at = [s.start + p for s, p in zip(segs, b.position_ids.tolist())]
        doc_of = [s.doc for s in segs]
        lengths = {d: len(loader.stream.read([d])[0]) for d in set(doc_of)}
        tokens = {d: loader.stream.read([d])[0] for d in set(doc_of)}
        wrong_ids += sum(int(t != tokens[d][a]) for d, a, t in zip(doc_of, at, b.input_ids.tolist()))
        local = [torch.stack([_doc_tensors(d, lengths[d])[j][a] for d, a in zip(doc_of, at)]) if at else
                 torch.zeros(0, HQ if j in (0, 3) else HKV, D, dtype=torch.float64) for j in range(4)]
        q, k, v = (t.clone().requires_grad_(True) for t in local[:3])
        out = dynamic_cp_attention(q, k, v, shard, groups, backend="reference")
        (out * local[3]).sum().backward()
        for j, got in enumerate((out.detach(), q.grad, k.grad, v.grad)):
            if at:
                want = torch.stack([_piece_reference(d, lengths[d], a - a % CONTEXT, refs)[j][a % CONTEXT]
                                    for d, a in zip(doc_of, at)])
                err = max(err, float((got - want).abs().max()))
        seen.update(zip(doc_of, at))
    n_docs = loader.stream.num_docs
    all_lengths = [len(loader.stream.read([d])[0]) for d in range(n_docs)]
    loader.close()
    return {"err": err, "sizes": sorted(sizes), "seen": dict(seen), "lengths": all_lengths, "batches": batches,
            "wrong_ids": wrong_ids}


@pytest.mark.multiprocess
def test_dynamic_cp_loader_planner_and_attention_match_reference_every_token_once_over_gloo():
    res = run_ranks(_rank, DP * CP, timeout=300)
    assert max(r["err"] for r in res) < 1e-10
    assert all(r["wrong_ids"] == 0 for r in res)
    assert set().union(*(r["sizes"] for r in res)) == {1, 2, 4}  # the planner mixed every CP size of the pool
    assert len({r["batches"] for r in res}) == 1  # every GPU runs every slot, in step
    seen: Counter = Counter()
    for r in res:
        seen.update(r["seen"])
    lengths = res[0]["lengths"]
    assert sorted(len(d) for d in _docs()) == sorted(lengths)
    want = {(d, p) for d, n in enumerate(lengths) for p in range(n)}
    assert set(seen) == want and set(seen.values()) == {1}
