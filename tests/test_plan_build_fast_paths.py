"""Issue 25's third speed round: how a step's plan and queue are built at DP 1024, against references written
out by hand (QueuedDoc and Segment objects made one by one from the arrays)."""

from __future__ import annotations

import numpy as np

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
