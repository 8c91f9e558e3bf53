"""Issue 25's third speed round: how a step's plan and queue are built at DP 1024, against references written
out by hand (QueuedDoc and Segment objects made one by one from the arrays)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.planners import ATTENTION_HEAVY, wlb_reference

from packloader.balancers.planners.auto_step import queued_arrays
from packloader.balancers.planners.packing import Packing, Pieces, QueuedPieces
from packloader.contracts import QueuedDoc


def _pieces(n: int, seed: int) -> Pieces:
    rng = np.random.default_rng(seed)
    return Pieces(rng.integers(0, 10**9, n), rng.integers(0, 10**6, n), rng.integers(1, 70_000, n),
                  rng.integers(0, 5, n))


def test_held_pieces_read_as_the_queue_written_out():
    p = _pieces(500, 0)
    idx = np.random.default_rng(1).permutation(500)[:137]
    held = p.held(idx)
    ref = [QueuedDoc(int(p.doc[i]), int(p.offset[i]), int(p.length[i]), int(p.drawn[i])) for i in idx]
    assert len(held) == 137 and bool(held)
    assert list(held) == ref and held == ref
    assert held[5] == ref[5] and held[-1] == ref[-1]
    assert held.length.tolist() == [q.length for q in ref]
    assert held.drawn.tolist() == [q.drawn_step for q in ref]
    assert not p.held(np.zeros(0, np.int64))


def test_held_pieces_score_and_state_as_a_list_does():
    p = _pieces(300, 2)
    idx = np.arange(0, 300, 7)
    ref = [QueuedDoc(int(p.doc[i]), int(p.offset[i]), int(p.length[i]), int(p.drawn[i])) for i in idx]
    empty = np.zeros(0, np.int64)
    lazy = Packing(empty, empty, empty, empty, empty, np.zeros((1, 1), np.int64), queued=p.held(idx))
    plain = Packing(empty, empty, empty, empty, empty, np.zeros((1, 1), np.int64), queued=list(ref))
    for a, b in zip(queued_arrays(lazy), queued_arrays(plain)):
        assert a.tolist() == b.tolist()
    state = lazy.state()
    assert type(state.queued) is list and state.queued == ref
    assert not isinstance(plain.queued, QueuedPieces)


@pytest.mark.parametrize("short", [15_460, 15_475, 15_500])
def test_wlb_pack_with_few_misses_matches_the_loop(short):
    """Until the least loaded bin has lacked room SCAN_MISSES times wlb_pack's load heap keeps no positions: the
    bin that took a piece is its top, or (after a miss) the fewest tokens' bin, found by a scan. A step with
    fewer misses than that takes only this path (10 and 25 misses here; 50 switch to the positions kept); its bins
    equal WLB-LLM's loop written out."""
    from packloader.balancers.cost.model import CostModel
    from packloader.balancers.planners.bins import HEAP_MIN_BINS
    from packloader.balancers.planners.wlb import wlb_pack

    prof = ATTENTION_HEAVY
    nbins, cap = HEAP_MIN_BINS + 4, 4096
    lengths = [1000] * 150 + [10] * short
    ref, to_fewest = wlb_reference(prof, lengths, nbins, cap)
    assert 0 < to_fewest  # the scan path chose bins (at 15,500 short pieces also the heap's, from the 32nd miss)
    got, _, _ = wlb_pack(CostModel(prof).coeffs, np.array(lengths, np.int64), nbins, cap)
    assert got.tolist() == ref


@pytest.mark.parametrize("chunk", [None, 7])
@pytest.mark.parametrize("whole", [True, False])
@pytest.mark.parametrize("grouped", [True, False])
def test_step_plan_segments_made_in_chunks_equal_those_made_one_by_one(monkeypatch, chunk, whole, grouped):
    """to_step_plan makes the segments chunk by chunk (SEGMENT_CHUNK a chunk): over several chunks, with the
    segments in micro-batch order or not, whole or attending from earlier, each micro-batch holds exactly the
    Segments written out one by one from its rows, in their order, and each rank its listed micro-batches."""
    from packloader.balancers.planners import packing
    from packloader.contracts import Segment

    if chunk:
        monkeypatch.setattr(packing, "SEGMENT_CHUNK", chunk)
    n = 2 * packing.SEGMENT_CHUNK + 123 if chunk is None else 60
    rng = np.random.default_rng(chunk or 3)
    dp, v = 4, 5
    mb = rng.integers(0, dp * v, n)
    if grouped:
        mb = np.sort(mb)
    doc = rng.integers(0, 10**9, n)
    start = rng.integers(0, 200_000, n)
    end = start + rng.integers(1, 70_000, n)
    af = start if whole else start - rng.integers(0, 3, n) * (start > 2)
    rank_mbs = rng.permutation(dp * v).reshape(dp, v)
    plan = Packing(doc, start, end, af, mb, rank_mbs).to_step_plan(3)
    by_mb = {m: [Segment(int(doc[i]), int(start[i]), int(end[i]), int(af[i])) for i in range(n) if mb[i] == m]
             for m in range(dp * v)}
    for r in range(dp):
        got = [b.segments for b in plan.ranks[r].micro_batches]
        assert got == [by_mb[int(m)] for m in rank_mbs[r]]
    segs = [s for rank in plan.ranks for b in rank.micro_batches for s in b.segments]
    assert all(type(x) is int for s in segs for x in (s.doc, s.start, s.end, s.attend_from))  # not numpy ints
