"""Per-document CP batches (collate.cp_document_shards): a hand-built slot of a 4-GPU pool with groups of sizes 1, 2 and 4.
Checked against the documents themselves: every token on exactly one GPU, the source's tokens, next-token labels and
document positions per GPU, runs of one document each whose key counts are their last query's offset + 1, loss
tokens that add up over the pool to the plan's normaliser; and placements that cannot be run are refused, naming
the segment."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from packloader.collate.collate import collate, loss_tokens_in_plan
from packloader.collate.cp_document_shards import check_chains, localize, plan_dynamic_cp
from packloader.contracts import CPPlacement, MicroBatch, RankPlan, Segment, StepPlan

P = CPPlacement
LENGTHS = {1: 37, 2: 10, 3: 5, 4: 9, 5: 3, 6: 2}
PLACED = {1: P(4, 0), 2: P(2, 0), 3: P(1, 2), 4: P(2, 2), 5: P(1, 3), 6: P(4, 0)}
DOCS = {d: np.random.default_rng(d).integers(0, 1000, n).astype(np.int32) for d, n in LENGTHS.items()}


def _mb(gpu: int) -> MicroBatch:
    docs = [d for d, p in PLACED.items() if p.first <= gpu < p.first + p.size]
    if gpu % 2:
        docs.reverse()  # the members of a group list its documents in different orders
    return MicroBatch(segments=[Segment(d, 0, LENGTHS[d], 0) for d in docs], cp=[PLACED[d] for d in docs])


def test_dynamic_cp_batches_cover_each_token_once_with_their_labels_and_positions():
    seen: Counter = Counter()
    loss = 0
    for gpu in range(4):
        mb = _mb(gpu)
        b = localize(collate(mb.segments, DOCS), mb, gpu=gpu, pool=4)
        runs = np.diff(b.cu_seqlens.numpy())
        docs = np.repeat(b.doc_ids.numpy(), runs)
        pos = b.position_ids.numpy()
        for d, p, t, lab in zip(docs.tolist(), pos.tolist(), b.input_ids.tolist(), b.labels.tolist()):
            assert t == DOCS[d][p] and lab == (DOCS[d][p + 1] if p + 1 < LENGTHS[d] else -100)
            seen[(d, p)] += 1
        at = np.concatenate([[0], np.cumsum(runs)])
        for r in range(runs.size):  # one document per run, consecutive positions, keys up to its last query
            p = pos[at[r]:at[r + 1]]
            assert np.array_equal(p, np.arange(p[0], p[0] + p.size))
            assert int(b.cu_seqlens_k[r + 1] - b.cu_seqlens_k[r]) == p[-1] + 1
        assert b.num_loss_tokens == int((b.labels != -100).sum())
        groups = {(g.size, g.first): sorted(mb.segments[i].doc for i in g.segments) for g in b.cp.groups}
        assert groups == {k: sorted(d for d in PLACED if (PLACED[d].size, PLACED[d].first) == k)
                          for k in {(p.size, p.first) for d, p in PLACED.items() if p.first <= gpu < p.first + p.size}}
        assert [g.size for g in b.cp.groups] == sorted((g.size for g in b.cp.groups), reverse=True)
        loss += b.num_loss_tokens
    assert set(seen) == {(d, p) for d, n in LENGTHS.items() for p in range(n)} and set(seen.values()) == {1}
    plan = StepPlan(step=0, ranks=[RankPlan(micro_batches=[_mb(g)]) for g in range(4)], cp_mode="dynamic")
    assert loss == loss_tokens_in_plan(plan, LENGTHS) == sum(n - 1 for n in LENGTHS.values())


def test_dynamic_cp_group_shards_split_documents_evenly_over_the_group():
    # document 1 (37 tokens) and 6 (2) on 4 GPUs: 39 tokens, each GPU 9 or 10 (the per-document layout, no padding)
    counts = [plan_dynamic_cp(_mb(g), gpu=g).groups[0].shard.num_tokens for g in range(4)]
    assert sum(counts) == 39 and max(counts) - min(counts) <= 1


@pytest.mark.parametrize("placement, gpu, message", [
    (P(3, 0), 0, "CP size 3 is not a power of two"),
    (P(2, 1), 1, "starts at GPU 1, not a multiple of its size 2"),
    (P(2, 2), 0, "placed on GPUs 2..3, which do not include pool GPU 0"),
    (P(8, 0), 0, "outside the pool of 4 GPUs"),
])
def test_dynamic_cp_refuses_placements_naming_the_segment(placement, gpu, message):
    mb = MicroBatch(segments=[Segment(2, 0, 10, 0), Segment(9, 4, 12, 4)], cp=[P(1, gpu), placement])
    with pytest.raises(ValueError, match=r"segment 1 \(document 9, tokens 4..11\).*" + message):
        plan_dynamic_cp(mb, gpu=gpu, pool=4)


def test_dynamic_cp_refuses_missing_placements_lone_slices_and_padding():
    seg = Segment(2, 0, 10, 0)
    with pytest.raises(ValueError, match="one CPPlacement per segment: 1 placements for 2 segments"):
        plan_dynamic_cp(MicroBatch(segments=[seg, seg], cp=[P(1, 0)]), gpu=0)
    with pytest.raises(ValueError, match="needs its placements"):
        plan_dynamic_cp(MicroBatch(segments=[seg]), gpu=0)
    with pytest.raises(ValueError, match=r"segment 0 \(document 2, tokens 4..9\) is a slice.*token 0 of its document"):
        check_chains([MicroBatch(segments=[Segment(2, 4, 10, 0)], cp=[P(2, 0)])], gpu=0)  # its earlier keys: nowhere
    mb = MicroBatch(segments=[seg], cp=[P(2, 0)])
    with pytest.raises(ValueError, match="unpadded micro-batch"):
        localize(collate(mb.segments, DOCS, pad_to_multiple=4), mb, gpu=0)
    with pytest.raises(ValueError, match="per-document CP micro-batch"):
        localize(collate(mb.segments, DOCS), mb, gpu=1).to_hf()
