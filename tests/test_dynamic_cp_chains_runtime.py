"""Per-document CP running dynamic-cp's slice chains over gloo: a document cut into slices on one CP subgroup in
consecutive micro-batches, each attending to the earlier slices' keys, beside whole documents of other CP sizes.
Every GPU runs its step with `DynamicCPExecutor`; its outputs and the gradients of its q, k and v rows must equal a
dense single-process causal attention over the whole documents (tests/helpers, independent of packloader's
attention), and the pool covers every token once. Also the shard metadata of a slice, hand-worked, and what is
still refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.dense_attention import dense_causal_reference
from helpers.distributed import run_ranks

from packloader.contracts import CPPlacement, MicroBatch, Segment

D, HQ, HKV = 4, 4, 2
P = CPPlacement

# per pool size: document lengths and micro-batch slots, each a list of (doc, start, end, attend_from, placement)
LENGTHS = {1: 45, 2: 19, 3: 8, 4: 5, 5: 30, 6: 2, 7: 11, 8: 4, 9: 24, 10: 3, 11: 6}
STEPS = {
    "4": [
        # document 1 as a 2-slice chain on CP 2 (GPUs 0, 1); document 9 on all four GPUs beside its first slice, so
        # GPUs 2 and 3 share a group with the chain's GPUs in the slot they recompute; CP 1 documents around it
        [(1, 0, 20, 0, P(2, 0)), (9, 0, 24, 0, P(4, 0)), (3, 0, 8, 0, P(1, 2)), (4, 0, 5, 0, P(1, 3))],
        [(1, 20, 45, 0, P(2, 0)), (5, 0, 30, 0, P(2, 2)), (6, 0, 2, 0, P(1, 0))],
        [(7, 0, 11, 0, P(2, 2)), (8, 0, 4, 0, P(1, 1))],  # GPU 0: an empty slot
    ],
    "8": [
        # document 1 as a 3-slice chain on CP 4 (GPUs 4..7), document 2 as a 2-slice chain on CP 2 (GPUs 0, 1)
        [(1, 0, 15, 0, P(4, 4)), (2, 0, 10, 0, P(2, 0)), (3, 0, 8, 0, P(2, 2)), (4, 0, 5, 0, P(1, 0)),
         (10, 0, 3, 0, P(1, 1))],
        [(1, 15, 33, 0, P(4, 4)), (2, 10, 19, 0, P(2, 0)), (5, 0, 30, 0, P(8, 0))],
        [(1, 33, 45, 0, P(4, 4)), (6, 0, 2, 0, P(4, 4)), (7, 0, 11, 0, P(2, 2)), (8, 0, 4, 0, P(1, 6)),
         (11, 0, 6, 0, P(1, 1))],  # GPUs 5..7 own no token of document 6
    ],
    "4-nested": [
        # as "4", but slot 1 too holds a document on all four GPUs: GPUs 2 and 3 keep nothing in slot 0, so unless
        # the pool agrees to defer slot 0's backward, their backward's reduce-scatter over the four GPUs would meet
        # the chain's GPUs' slot-1 all-gather
        [(1, 0, 20, 0, P(2, 0)), (9, 0, 24, 0, P(4, 0)), (3, 0, 8, 0, P(1, 2)), (4, 0, 5, 0, P(1, 3))],
        [(1, 20, 45, 0, P(2, 0)), (5, 0, 30, 0, P(4, 0)), (6, 0, 2, 0, P(1, 2))],
        [(7, 0, 11, 0, P(2, 2)), (8, 0, 4, 0, P(1, 1))],
    ],
}


def _micro_batches(case: str, gpu: int) -> list[MicroBatch]:
    out = []
    for slot in STEPS[case]:
        mine = [x for x in slot if x[4].first <= gpu < x[4].first + x[4].size]
        if gpu % 2:
            mine.reverse()  # members list a group's segments in different orders
        out.append(MicroBatch(segments=[Segment(*x[:4]) for x in mine], cp=[x[4] for x in mine]))
    return out


def _doc_tensors(doc: int):
    g = torch.Generator().manual_seed(2660 + doc)
    return tuple(torch.randn(LENGTHS[doc], h, D, generator=g, dtype=torch.float64) for h in (HQ, HKV, HKV, HQ))


def _rank(rank: int, world: int, case: str, recompute: bool) -> dict:
    from types import SimpleNamespace

    from packloader.collate.cp_document_shards import plan_dynamic_cp
    from packloader.runtime.cp_chains import DynamicCPExecutor
    from packloader.runtime.groups import ProcessGroupCache, prepare_cp_pool_groups

    cache = ProcessGroupCache()
    prepare_cp_pool_groups(world, groups=cache)
    batches, rows = [], []
    for m, mb in enumerate(_micro_batches(case, rank)):
        shard = plan_dynamic_cp(mb, gpu=rank, pool=world)
        segs = [mb.segments[s] for s in np.repeat(shard.run_segment, np.diff(shard.cu_seqlens_q))]
        at = [(s.doc, s.attend_from + p) for s, p in zip(segs, shard.position_ids.tolist())]
        local = [torch.stack([_doc_tensors(d)[j][a] for d, a in at]) if at else
                 torch.zeros(0, HQ if j in (0, 3) else HKV, D, dtype=torch.float64) for j in range(4)]
        rows.append((at, [t.clone().requires_grad_(True) for t in local[:3]], local[3]))
        batches.append(SimpleNamespace(segments=mb.segments, cp=shard, step=0, index_in_step=m))
    outs: dict[int, torch.Tensor] = {}
    calls = [0] * len(batches)

    def step_fn(b, ctx):
        _, (q, k, v), w = rows[b.index_in_step]
        calls[b.index_in_step] += 1
        out = ctx.attention(q, k, v, backend="reference")
        outs[b.index_in_step] = out.detach()
        return (out * w).sum()

    DynamicCPExecutor(pool=world, groups=cache, backend="reference", recompute=recompute).run(batches, step_fn)
    ref = {d: dense_causal_reference(*_doc_tensors(d), D ** -0.5) for d in LENGTHS}
    err, seen = 0.0, []
    for m, (at, qkv, _) in enumerate(rows):
        seen += at
        for j, got in enumerate([outs[m]] + [t.grad for t in qkv]):
            if at:
                want = torch.stack([ref[d][j][a] for d, a in at])
                err = max(err, float((got - want).abs().max()))
    return {"err": err, "seen": seen, "calls": calls}


@pytest.mark.multiprocess
@pytest.mark.parametrize(("case", "recompute"), [("4", True), ("8", True), ("8", False), ("4-nested", False)])
def test_dynamic_cp_chains_run_over_gloo_and_match_the_whole_documents_reference(case, recompute):
    pool = int(case.split("-")[0])
    res = run_ranks(_rank, pool, case, recompute, timeout=240)
    assert max(r["err"] for r in res) < 1e-10
    seen = sorted(x for r in res for x in r["seen"])
    docs = {x[0] for slot in STEPS[case] for x in slot}
    assert seen == sorted((d, a) for d in docs for a in range(LENGTHS[d]))  # every token once over the pool
    if recompute:
        # the slots a chain continues from are recomputed on every GPU of the pool (collectives line up), others not
        want = {"4": [2, 1, 1], "8": [2, 2, 1]}[case]  # slot 0 (G = 4), slots 0 and 1 (G = 8): forward, recomputed
    else:
        want = [1] * len(STEPS[case])  # one forward per micro-batch: the kept ones keep their graphs
    assert all(r["calls"] == want for r in res)


# ------------------------------------------------------------------ single process: metadata and refusals


def test_dynamic_cp_slice_shard_counts_its_earlier_keys_first_hand_worked():
    from packloader.collate.cp_document_shards import plan_dynamic_cp

    # tokens 8..15 of document 5 attending from 0, on CP 2: chunks of 2 tokens (8, 9 | 10, 11 | 12, 13 | 14, 15),
    # GPU 0 takes chunks 0 and 3, GPU 1 chunks 1 and 2; beside it document 6 (4 tokens) at CP 1 on GPU 0
    mb = MicroBatch(segments=[Segment(5, 8, 16, 0), Segment(6, 0, 4, 0)], cp=[P(2, 0), P(1, 0)])
    s0 = plan_dynamic_cp(mb, gpu=0, pool=2)
    assert s0.position_ids.tolist() == [8, 9, 14, 15, 0, 1, 2, 3]  # the slice continues its piece's positions
    assert s0.run_prefix.tolist() == [8, 8, 0]
    # run keys: 8 earlier + its own up to its last query (2, then 8), then document 6's 4
    assert s0.cu_seqlens_k.tolist() == [0, 10, 26, 30] and s0.max_seqlen_k == 16
    s1 = plan_dynamic_cp(MicroBatch(segments=mb.segments[:1], cp=mb.cp[:1]), gpu=1, pool=2)
    assert s1.position_ids.tolist() == [10, 11, 12, 13] and s1.cu_seqlens_k.tolist() == [0, 14]


def test_dynamic_cp_chains_still_refused_where_the_earlier_slice_is_elsewhere_or_unkept():
    from types import SimpleNamespace

    from packloader.collate.cp_document_shards import check_chains, plan_dynamic_cp
    from packloader.runtime.cp_chains import DynamicCPExecutor
    from packloader.runtime.cp_document_attention import dynamic_cp_attention

    # a chain that changes subgroups: its earlier keys are gathered over GPUs 0..3, not the later slice's GPUs 0, 1
    moved = [MicroBatch(segments=[Segment(1, 0, 8, 0)], cp=[P(4, 0)]),
             MicroBatch(segments=[Segment(1, 8, 16, 0)], cp=[P(2, 0)])]
    with pytest.raises(ValueError, match=r"step 3, micro-batch 1 of pool GPU 0: segment 0 \(document 1, tokens "
                                         r"8\.\.15\) is a slice on GPUs 0\.\.1, but token 0 .*no earlier micro-batch"):
        check_chains(moved, gpu=0, step=3)
    # the earlier slice in the same micro-batch (the runtime keeps keys between micro-batches only)
    with pytest.raises(ValueError, match="token 0 of its document"):
        check_chains([MicroBatch(segments=[Segment(1, 0, 8, 0), Segment(1, 8, 16, 0)], cp=[P(1, 0)] * 2)], gpu=0)
    # the executor checks the same for hand-built shards
    batches = [SimpleNamespace(segments=mb.segments, cp=plan_dynamic_cp(mb, gpu=0, pool=4), step=3, index_in_step=m)
               for m, mb in enumerate(moved)]
    with pytest.raises(ValueError, match="is a slice on GPUs 0..1, but token 0 .*ran in no earlier micro-batch"):
        DynamicCPExecutor(pool=1).run(batches, lambda b, ctx: torch.zeros(()))
    # the stateless attention has no earlier keys to give a slice
    q = torch.zeros(4, HQ, D)
    with pytest.raises(ValueError, match=r"holds slices \(segments \[0\]\).*DynamicCPExecutor"):
        dynamic_cp_attention(q, q[:, :HKV], q[:, :HKV], plan_dynamic_cp(moved[1], gpu=0, pool=4))


# ------------------------------------------------------------------ end to end: planner, loader, executor


E2E_DP, E2E_CP, CONTEXT = 2, 2, 128


def _e2e_config():
    from packloader.contracts import ParallelConfig, PlanConfig

    # 32 tokens per GPU a slot; at TP 8 a CP 2 group's traffic crosses nodes, so the planner chains long pieces
    return PlanConfig(strategy="auto", parallel=ParallelConfig(dp=E2E_DP, cp=E2E_CP, tp=8), max_tokens=64,
                      context=CONTEXT, tokens_per_step=400, allow_slicing=True, cp_mode="dynamic")  # chains: default


def _e2e_rank(rank: int, world: int) -> dict:
    from helpers.docs import token_docs

    from packloader.loader.loader import PackedLoader
    from packloader.runtime.cp_chains import DynamicCPExecutor
    from packloader.runtime.groups import ProcessGroupCache, prepare_cp_pool_groups
    from packloader.sources.base import IterableSource

    groups = ProcessGroupCache()
    prepare_cp_pool_groups(world, groups=groups)
    loader = PackedLoader(IterableSource(token_docs(40, seed=3, max_len=200)), config=_e2e_config(),
                          dp_rank=rank // E2E_CP, cp_rank=rank % E2E_CP, num_threads=0)
    tokens = {d: loader.stream.read([d])[0] for d in range(loader.stream.num_docs)}
    refs: dict = {}

    def tensors(doc: int, piece: int):  # the piece of `doc` from token `piece` (cut every CONTEXT tokens)
        if (doc, piece) not in refs:
            g = torch.Generator().manual_seed(2680 + doc)
            full = [torch.randn(len(tokens[doc]), h, D, generator=g, dtype=torch.float64) for h in (HQ, HKV, HKV, HQ)]
            part = [t[piece:piece + CONTEXT] for t in full]
            refs[doc, piece] = (part, dense_causal_reference(*part, D ** -0.5))
        return refs[doc, piece]

    executor = DynamicCPExecutor(pool=world, groups=groups, backend="reference")
    err, seen, slices, wrong_ids, step = 0.0, [], 0, 0, []
    rows: dict = {}
    outs: dict = {}

    def step_fn(b, ctx):
        _, (q, k, v), w = rows[b.index_in_step]
        out = ctx.attention(q, k, v)
        outs[b.index_in_step] = out.detach()
        return (out * w).sum()

    def run(batches):
        nonlocal err
        rows.clear()
        for b in batches:
            segs = [b.segments[i] for i in np.repeat(b.cp.run_segment, np.diff(b.cu_seqlens.numpy()))]
            at = [(s.doc, s.attend_from, s.attend_from + p) for s, p in zip(segs, b.position_ids.tolist())]
            local = [torch.stack([tensors(d, a)[0][j][t - a] for d, a, t in at]) if at else
                     torch.zeros(0, HQ if j in (0, 3) else HKV, D, dtype=torch.float64) for j in range(4)]
            rows[b.index_in_step] = (at, [t.clone().requires_grad_(True) for t in local[:3]], local[3])
        executor.run(batches, step_fn)
        for b in batches:
            at, qkv, _ = rows[b.index_in_step]
            for j, got in enumerate([outs[b.index_in_step]] + [t.grad for t in qkv]):
                if at:
                    want = torch.stack([tensors(d, a)[1][j][t - a] for d, a, t in at])
                    err = max(err, float((got - want).abs().max()))

    for b in loader:
        slices += sum(int(s.attend_from < s.start) for s in b.segments)
        segs = [b.segments[i] for i in np.repeat(b.cp.run_segment, np.diff(b.cu_seqlens.numpy()))]
        at = [(s.doc, s.attend_from + p) for s, p in zip(segs, b.position_ids.tolist())]
        wrong_ids += sum(int(tokens[d][t] != i) for (d, t), i in zip(at, b.input_ids.tolist()))
        wrong_ids += sum(int((tokens[d][t + 1] if t + 1 < len(tokens[d]) else -100) != lab)  # next token, in-doc
                         for (d, t), lab in zip(at, b.labels.tolist()))
        seen += at
        step.append(b)
        if b.index_in_step == b.micro_batches_in_step - 1:
            run(step)
            step = []
    loader.close()
    return {"err": err, "seen": seen, "slices": slices, "wrong_ids": wrong_ids,
            "lengths": {d: len(t) for d, t in tokens.items()}}


@pytest.mark.multiprocess
def test_dynamic_cp_chains_end_to_end_planner_loader_executor_over_gloo():
    # the real dynamic-cp planner with chains, PackedLoader(cp_rank=...) on each of DP 2 x CP 2 processes, each step
    # through DynamicCPExecutor: q/k/v gradients equal dense attention over each whole piece, every token once
    res = run_ranks(_e2e_rank, E2E_DP * E2E_CP, timeout=300)
    assert sum(r["slices"] for r in res) > 0  # the planner chained some pieces
    assert all(r["wrong_ids"] == 0 for r in res)
    assert max(r["err"] for r in res) < 1e-10
    lengths = res[0]["lengths"]
    assert sorted(x for r in res for x in r["seen"]) == sorted((d, t) for d, n in lengths.items() for t in range(n))
