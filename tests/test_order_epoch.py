"""The epoch order as pure functions: permutations, determinism, per-epoch reshuffles, splits that lose nothing."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from packloader.sources.order import EpochOrder, epoch_stream, row_order, shard_order, split_range


def test_orders_are_permutations_and_deterministic():
    for n in (0, 1, 7, 100):
        a = shard_order(n, seed=3, epoch=1)
        assert sorted(a.tolist()) == list(range(n))
        assert np.array_equal(a, shard_order(n, seed=3, epoch=1))
        assert sorted(row_order(n, 3, 1, shard=2).tolist()) == list(range(n))
    assert not np.array_equal(row_order(1000, 0, 0, 0), row_order(1000, 0, 1, 0)), "a new order each epoch"
    assert not np.array_equal(row_order(1000, 0, 0, 0), row_order(1000, 1, 0, 0)), "seed matters"
    assert not np.array_equal(row_order(1000, 0, 0, 0), row_order(1000, 0, 0, 1)), "shards shuffle independently"
    assert np.array_equal(shard_order(5, 0, 0, shuffle=False), np.arange(5))


def test_stream_visits_shards_whole_and_rows_shuffled():
    sizes = [5, 0, 3, 8]
    shards, rows = epoch_stream(sizes, seed=1, epoch=0)
    assert len(shards) == 16
    # every (shard, row) exactly once
    assert sorted(zip(shards.tolist(), rows.tolist())) == [(s, r) for s, n in enumerate(sizes) for r in range(n)]
    # a shard's rows are contiguous in the stream (shard order, then row order)
    changes = np.flatnonzero(np.diff(shards)) + 1
    assert len(changes) == 2
    ordered = epoch_stream(sizes, seed=1, epoch=0, shuffle=False)
    assert ordered[0].tolist() == [0] * 5 + [2] * 3 + [3] * 8
    assert ordered[1].tolist() == list(range(5)) + list(range(3)) + list(range(8))


def test_locate_and_spans_agree_with_the_stream():
    sizes = [4, 6, 1, 9]
    order = EpochOrder(sizes, seed=7, epoch=2, cache_shards=1)  # a tiny cache: permutations are rebuilt
    shards, rows = epoch_stream(sizes, 7, 2)
    pos = np.array([19, 0, 5, 11, 3, 3])
    s, r = order.locate(pos)
    assert s.tolist() == shards[pos].tolist() and r.tolist() == rows[pos].tolist()
    covered = []
    for shard, a, b in order.spans(2, 17):
        assert set(shards[a:b].tolist()) == {shard}
        covered.extend(range(a, b))
    assert covered == list(range(2, 17))
    with pytest.raises(IndexError, match="outside"):
        order.locate([20])


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 200), st.integers(1, 9), st.integers(-5, 5))
def test_split_range_covers_once(n, parts, lo):
    pieces = [split_range(lo, lo + n, parts, p) for p in range(parts)]
    got = [i for a, b in pieces for i in range(a, b)]
    assert got == list(range(lo, lo + n))
    sizes = [b - a for a, b in pieces]
    assert max(sizes) - min(sizes) <= 1


def test_split_range_rejects_bad_parts():
    with pytest.raises(ValueError):
        split_range(0, 10, 0, 0)
    with pytest.raises(ValueError):
        split_range(0, 10, 2, 2)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 30), min_size=1, max_size=6), st.integers(0, 3), st.integers(1, 4))
def test_worker_splits_of_an_epoch_lose_and_double_nothing(sizes, epoch, workers):
    shards, rows = epoch_stream(sizes, seed=11, epoch=epoch)
    n = len(shards)
    seen = []
    for w in range(workers):
        a, b = split_range(0, n, workers, w)
        seen.extend(zip(shards[a:b].tolist(), rows[a:b].tolist()))
    assert sorted(seen) == sorted((s, r) for s, k in enumerate(sizes) for r in range(k))
