"""The batch contract, checked against a reference built token by token from the raw documents."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from packloader.collate.batch import IGNORE_INDEX, SlicesNotSupported
from packloader.collate.collate import collate, collate_padded, collate_step, loss_tokens_in_plan
from packloader.contracts import MicroBatch, RankPlan, Segment, StepPlan


def reference(segments, docs):
    """Plain Python lists, one token at a time, straight from the definitions in DESIGN.md."""
    ids, labels, pos, cu, cu_k = [], [], [], [0], [0]
    for s in segments:
        doc = [int(x) for x in docs[s.doc]]
        for t in range(s.start, s.end):
            ids.append(doc[t])
            labels.append(doc[t + 1] if t + 1 < len(doc) else IGNORE_INDEX)
            pos.append(t - s.attend_from)  # offset in its attention span: 0 at a document's or piece's start
        cu.append(cu[-1] + s.end - s.start)
        cu_k.append(cu_k[-1] + s.end - s.attend_from)
    return ids, labels, pos, cu, cu_k


@st.composite
def micro_batches(draw):
    n_docs = draw(st.integers(1, 5))
    docs = {100 + i: np.array(draw(st.lists(st.integers(0, 50_000), min_size=1, max_size=40)), dtype=np.int32)
            for i in range(n_docs)}
    segments = []
    for d, toks in docs.items():
        # cut each document into pieces, keep some of them, some as slices attending to earlier tokens
        cuts = sorted(set(draw(st.lists(st.integers(1, max(1, len(toks) - 1)), max_size=3))) - {len(toks)})
        bounds = [0] + [c for c in cuts if 0 < c < len(toks)] + [len(toks)]
        for a, b in zip(bounds, bounds[1:]):
            if draw(st.booleans()) or a == 0:
                attend = draw(st.integers(0, a)) if draw(st.booleans()) else a
                segments.append(Segment(d, a, b, attend))
    order = draw(st.permutations(range(len(segments))))
    return [segments[i] for i in order], docs


@settings(max_examples=150, deadline=None)
@given(micro_batches())
def test_collate_matches_reference(mb):
    segments, docs = mb
    b = collate(segments, docs, step=3, index_in_step=1, micro_batches_in_step=2, loss_tokens_in_step=999)
    ids, labels, pos, cu, cu_k = reference(segments, docs)
    assert b.input_ids.dtype == torch.int64 and b.labels.dtype == torch.int64 and b.position_ids.dtype == torch.int64
    assert b.input_ids.tolist() == ids
    assert b.labels.tolist() == labels
    assert b.position_ids.tolist() == pos
    assert b.cu_seqlens.dtype == torch.int32 and b.cu_seqlens.tolist() == cu
    assert b.cu_seqlens_k.dtype == torch.int32 and b.cu_seqlens_k.tolist() == cu_k
    assert type(b.max_seqlen) is int and b.max_seqlen == max(s.end - s.start for s in segments)
    assert type(b.max_seqlen_k) is int and b.max_seqlen_k == max(s.end - s.attend_from for s in segments)
    assert b.doc_ids.tolist() == [s.doc for s in segments]
    assert b.num_loss_tokens == sum(l != IGNORE_INDEX for l in labels)
    assert (b.step, b.index_in_step, b.micro_batches_in_step, b.loss_tokens_in_step) == (3, 1, 2, 999)
    assert b.cu_seqlens_padded is None and b.cp is None
    if all(s.attend_from == s.start for s in segments):
        hf = b.to_hf()
        assert hf["input_ids"].shape == (1, len(ids)) and hf["max_length_q"] == b.max_seqlen
    else:
        with pytest.raises(SlicesNotSupported, match="to_hf"):
            b.to_hf()


def test_to_hf_refuses_a_slice_whose_keys_the_row_does_not_hold():
    """A slice of tokens 4..10 attending from 0: the row holds 6 of its tokens, while its keys are 10, so
    cu_seq_lens_k would end at 10 + 2 for a row of 8 tokens (hand-worked); refused, naming step, micro-batch and
    document. The same micro-batch without the slice converts."""
    docs = {7: np.arange(100, 110), 8: np.array([1, 2])}
    b = collate([Segment(8, 0, 2, 0), Segment(7, 4, 10, 0)], docs, step=5, index_in_step=2)
    assert b.cu_seqlens_k.tolist() == [0, 2, 12] and b.input_ids.numel() == 8
    with pytest.raises(SlicesNotSupported, match=r"step 5, micro-batch 2 holds a slice of document 7 \(tokens 4..10, "
                       r"attending from 0\)"):
        b.to_hf()
    whole = collate([Segment(8, 0, 2, 0), Segment(7, 4, 10, 4)], docs, step=5, index_in_step=2)
    assert whole.to_hf()["cu_seq_lens_k"].tolist() == [0, 2, 8]


def test_labels_never_cross_a_document_and_positions_restart():
    docs = {0: np.array([10, 11, 12]), 1: np.array([20, 21])}
    b = collate([Segment(0, 0, 3, 0), Segment(1, 0, 2, 0)], docs)
    assert b.input_ids.tolist() == [10, 11, 12, 20, 21]
    assert b.labels.tolist() == [11, 12, -100, 21, -100]
    assert b.position_ids.tolist() == [0, 1, 2, 0, 1]
    assert b.cu_seqlens.tolist() == [0, 3, 5] and b.max_seqlen == 3 and b.num_loss_tokens == 3


def test_pieces_restart_positions_and_predict_the_next_piece():
    docs = {7: np.arange(100, 110)}
    first = collate([Segment(7, 0, 4, 0)], docs)
    second = collate([Segment(7, 4, 10, 4)], docs)
    assert first.labels.tolist() == [101, 102, 103, 104]  # the piece's last token predicts the next piece's first
    assert second.position_ids.tolist() == list(range(6))  # an independent piece is a sequence of its own
    assert second.labels.tolist()[-1] == -100
    sl = collate([Segment(7, 4, 10, 0)], docs)  # a slice: keys include the 4 earlier tokens
    assert sl.cu_seqlens.tolist() == [0, 6] and sl.cu_seqlens_k.tolist() == [0, 10] and sl.max_seqlen_k == 10
    assert sl.position_ids.tolist() == list(range(4, 10))  # and its positions continue them


def test_hand_worked_pieces_and_slices_in_one_micro_batch():
    """Document 5 (12 tokens 500..511) at context 5 is three pieces [0,5) [5,10) [10,12); the second one sliced
    into [5,7) and [7,10) (attend_from 5). Document 6 (3 tokens) is whole. Worked out by hand."""
    docs = {5: np.arange(500, 512), 6: np.array([60, 61, 62])}
    segs = [Segment(5, 0, 5, 0), Segment(5, 5, 7, 5), Segment(6, 0, 3, 0), Segment(5, 7, 10, 5),
            Segment(5, 10, 12, 10)]
    b = collate(segs, docs)
    assert b.input_ids.tolist() == [500, 501, 502, 503, 504, 505, 506, 60, 61, 62, 507, 508, 509, 510, 511]
    assert b.position_ids.tolist() == [0, 1, 2, 3, 4, 0, 1, 0, 1, 2, 2, 3, 4, 0, 1]
    assert b.labels.tolist() == [501, 502, 503, 504, 505, 506, 507, 61, 62, -100, 508, 509, 510, 511, -100]
    assert b.cu_seqlens.tolist() == [0, 5, 7, 10, 13, 15] and b.cu_seqlens_k.tolist() == [0, 5, 7, 10, 15, 17]
    assert b.num_loss_tokens == 13  # 15 tokens, two documents end here


@settings(max_examples=80, deadline=None)
@given(micro_batches(), st.integers(1, 8), st.integers(0, 20), st.sampled_from(["flat", "hf"]))
def test_padded_variant(mb, multiple, extra_tokens, layout):
    segments, docs = mb
    ids, labels, pos, cu, cu_k = reference(segments, docs)
    padded_lens = [-(-(s.end - s.start) // multiple) * multiple for s in segments]
    total = sum(padded_lens) + extra_tokens
    b = collate_padded(segments, docs, pad_to_multiple=multiple, pad_to_tokens=total, pad_id=7, layout=layout)
    flat = lambda t: t.reshape(-1).tolist()  # noqa: E731
    assert b.input_ids.shape == ((1, total) if layout == "hf" else (total,))
    assert b.cu_seqlens.tolist() == cu and b.cu_seqlens_k.tolist() == cu_k  # true lengths
    offs = b.cu_seqlens_padded.tolist()
    assert b.cu_seqlens_padded.dtype == torch.int32 and offs[0] == 0 and offs[-1] == total
    padded_lens[-1] += extra_tokens
    assert np.diff(offs).tolist() == padded_lens
    got_ids, got_labels, got_pos = flat(b.input_ids), flat(b.labels), flat(b.position_ids)
    at = 0
    for i, s in enumerate(segments):
        q = s.end - s.start
        o = offs[i]
        assert got_ids[o : o + q] == ids[at : at + q]
        assert got_labels[o : o + q] == labels[at : at + q]
        assert got_pos[o : o + q] == pos[at : at + q]
        assert set(got_ids[o + q : offs[i + 1]]) <= {7}
        assert set(got_labels[o + q : offs[i + 1]]) <= {IGNORE_INDEX}
        at += q
    assert b.num_loss_tokens == sum(l != IGNORE_INDEX for l in labels)
    assert b.max_seqlen == max(np.diff(offs).tolist())


@settings(max_examples=60, deadline=None)
@given(st.lists(micro_batches(), min_size=1, max_size=4), st.booleans(), st.sampled_from(["flat", "hf"]))
def test_step_of_micro_batches_matches_reference(mbs, padded, layout):
    """collate_step fills all micro-batches of a step in one call (documents shared between micro-batches, an
    empty micro-batch among them): each must equal the token-by-token reference of its own segments."""
    docs = {}
    steps = []
    for k, (segments, d) in enumerate(mbs):  # renumber so micro-batches' documents do not collide
        docs.update({1000 * k + i: t for i, t in d.items()})
        steps.append([Segment(1000 * k + s.doc, s.start, s.end, s.attend_from) for s in segments])
    steps.insert(1, [])  # an empty micro-batch
    steps.append(steps[0][:1])  # a document of an earlier micro-batch again
    kw = dict(pad_to_multiple=4, pad_to_tokens=4 * 41 * 10) if padded else {}
    groups = [[0, 1] if i % 2 else None for i in range(len(steps))]
    out = collate_step(steps, docs, step=5, loss_tokens_in_step=77, layout=layout, extra=[{"i": i} for i in range(len(steps))],
                       common_extra={"common": 1}, dp_groups=groups, epoch=3, last_in_epoch=True, **kw)
    assert len(out) == len(steps)
    for i, (b, segments) in enumerate(zip(out, steps)):
        ids, labels, pos, cu, cu_k = reference(segments, docs)
        assert (b.step, b.index_in_step, b.micro_batches_in_step, b.loss_tokens_in_step) == (5, i, len(steps), 77)
        assert b.extra == {"i": i, "common": 1} and b.layout == layout and b.dp_group == groups[i]
        assert b.epoch == 3 and b.last_in_epoch == (i == len(steps) - 1) and b.plan is None and b.stats is None
        assert b.doc_ids.tolist()[: len(segments)] == [s.doc for s in segments]
        assert b.cu_seqlens.tolist()[: len(cu)] == cu and b.cu_seqlens_k.tolist()[: len(cu_k)] == cu_k
        got = [t.reshape(-1).tolist() for t in (b.input_ids, b.labels, b.position_ids)]
        if not padded:
            assert got == [ids, labels, pos]
            continue
        offs = b.cu_seqlens_padded.tolist()
        assert offs[-1] == 4 * 41 * 10
        at = 0
        for j, s in enumerate(segments):
            q = s.end - s.start
            assert got[0][offs[j] : offs[j] + q] == ids[at : at + q]
            assert got[1][offs[j] : offs[j] + q] == labels[at : at + q]
            assert got[2][offs[j] : offs[j] + q] == pos[at : at + q]
            assert set(got[0][offs[j] + q : offs[j + 1]]) <= {0}
            assert set(got[1][offs[j] + q : offs[j + 1]]) <= {IGNORE_INDEX}
            at += q
        if not segments:
            assert got[2] == list(range(4 * 41 * 10)) and set(got[1]) == {IGNORE_INDEX}


def test_empty_micro_batch_flat_and_padded():
    b = collate([], {})
    assert b.num_tokens == 0 and b.cu_seqlens.tolist() == [0] and b.max_seqlen == 0
    p = collate_padded([], {}, pad_to_tokens=16)
    assert p.num_tokens == 16 and p.cu_seqlens.tolist() == [0, 0] and p.cu_seqlens_padded.tolist() == [0, 16]
    assert p.doc_ids.tolist() == [-1] and p.num_loss_tokens == 0


def test_bad_segments_and_options_are_errors():
    docs = {0: np.arange(5)}
    with pytest.raises(ValueError, match="document 0"):
        collate([Segment(0, 3, 9, 3)], docs)
    with pytest.raises(KeyError, match="no tokens for document 4"):
        collate([Segment(4, 0, 1, 0)], docs)
    with pytest.raises(ValueError, match="pad_to_tokens=4"):
        collate_padded([Segment(0, 0, 5, 0)], docs, pad_to_multiple=1, pad_to_tokens=4)
    with pytest.raises(ValueError, match="layout"):
        collate([], {}, layout="bshd")


def test_loss_tokens_of_a_step_count_each_document_end_once():
    plan = StepPlan(step=0, ranks=[
        RankPlan(micro_batches=[MicroBatch(segments=[Segment(0, 0, 4, 0)]), MicroBatch(segments=[Segment(1, 0, 3, 0)])]),
        RankPlan(micro_batches=[MicroBatch(segments=[Segment(0, 4, 6, 4), Segment(2, 0, 1, 0)]),
                                MicroBatch(segments=[Segment(1, 0, 3, 0)], dp_group=[0, 1])]),  # DP-Merge duplicate
    ])
    # doc 0: 6 tokens -> 5 targets; doc 1: 3 -> 2 (counted once); doc 2: 1 -> 0
    assert loss_tokens_in_plan(plan, {0: 6, 1: 3, 2: 1}) == 7


def test_a_collated_step_holds_few_objects_for_the_garbage_collector():
    """Steps wait in the prefetch queue: built eagerly, ~12 GC-tracked objects per micro-batch (tensors, dicts,
    the batch) survived into the old generations and set off full collections. collate_step keeps a step as
    arrays and builds each batch when it is taken."""
    import gc

    docs = {d: np.arange(d * 100, d * 100 + 50, dtype=np.int32) for d in range(400)}
    mbs = [[Segment(2 * k, 0, 50, 0), Segment(2 * k + 1, 0, 50, 0)] for k in range(200)]
    collate_step(mbs[:2], docs)[0]  # first call: numba loads its kernels (objects of its own)
    gc.collect()
    gc.disable()
    try:
        before = len(gc.get_objects())
        step = collate_step(mbs, docs, common_extra={"user": 0}, epoch=2)
        held = len(gc.get_objects()) - before
    finally:
        gc.enable()
    assert held <= 2 * len(mbs) + 20, held
    ref = reference(mbs[7], docs)
    assert step[7].input_ids.tolist() == ref[0] and step[-1].index_in_step == 199 and step[7].extra == {"user": 0}
    assert step[7].layout == "flat" and step[7].epoch == 2
