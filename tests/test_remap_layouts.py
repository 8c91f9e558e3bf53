"""Layouts of a micro-batch for the linear layers and for attention (no process group needed)."""

import numpy as np
import pytest

from packloader.contracts import Segment
from packloader.runtime.remap import Layout, linear_layout, micro_batch_layouts


class Pairs:
    """A cost estimate in causal (query, key) pairs, no tile: the balance the attention layout aims at."""

    def segment_times(self, q, p):
        q, p = np.asarray(q, dtype=np.float64), np.asarray(p, dtype=np.float64)
        f = q * p + q * (q + 1) / 2
        return f, 2.5 * f


def _segments(lengths):
    return [Segment(doc=i, start=0, end=n, attend_from=0) for i, n in enumerate(lengths)]


def _pairs_per_rank(layout, lengths):
    starts = np.concatenate([[0], np.cumsum(lengths)])
    doc_of = np.repeat(np.arange(len(lengths)), lengths)
    pos_in_doc = np.arange(starts[-1]) - starts[doc_of]
    return np.array([float(np.sum(pos_in_doc[i] + 1)) for i in layout.indices])


def test_linear_layout_is_contiguous_and_equal():
    lay = linear_layout(10, 3)
    assert [i.tolist() for i in lay.indices] == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]
    lay.validate()


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize(
    "lengths",
    [[1000], [37, 1, 1, 200, 5, 64, 3, 900], [1] * 7, [5, 3]],
    ids=["one-long", "mixed", "single-tokens", "fewer-docs-than-ranks"],
)
def test_both_layouts_are_permutations(lengths, world):
    lin, att = micro_batch_layouts(_segments(lengths), world)
    assert lin.num_tokens == att.num_tokens == sum(lengths)
    lin.validate()
    att.validate()
    assert lin.counts.max() - lin.counts.min() <= 1
    for r in range(world):
        assert np.all(np.diff(att.indices[r]) > 0)  # global order within a rank
        assert att.shards[r].token_index.tolist() == att.indices[r].tolist()


def test_long_document_is_sharded_short_ones_kept_whole():
    lengths = [4000] + [50] * 40
    lin, att = micro_batch_layouts(_segments(lengths), 4, cost_model=Pairs())
    assert att.shards.sharded_segments.tolist() == [0]
    for r in range(4):
        sh = att.shards[r]
        chunks = list(range(r * 500, r * 500 + 500)) + list(range((7 - r) * 500, (8 - r) * 500))
        assert att.indices[r][att.indices[r] < 4000].tolist() == chunks  # chunks r and 2W-1-r of the long one
        assert np.all(sh.run_lengths()[sh.run_segment != 0] == 50)  # short documents whole
    pairs = _pairs_per_rank(att, lengths)
    assert pairs.max() - pairs.min() <= 50 * 51 / 2  # within one short document's cost


def test_attention_cost_balance_beats_the_linear_layout():
    rng = np.random.default_rng(0)
    lengths = list(rng.integers(1, 600, size=30)) + [3000, 2500]
    lin, att = micro_batch_layouts(_segments(lengths), 4, cost_model=Pairs())
    a, l = _pairs_per_rank(att, lengths), _pairs_per_rank(lin, lengths)
    assert a.max() / a.mean() < 1.05 < l.max() / l.mean()


def test_plain_lengths_and_pieces():
    lin, att = micro_batch_layouts([10, 10, 10, 10], 2)
    assert sorted(len(i) for i in att.indices) == [20, 20]
    # a context-window piece is a sequence of its own: positions from 0, as the collate gives them
    _, att = micro_batch_layouts([Segment(3, 8192, 8200, 8192)], 1)
    assert att.shards[0].position_ids.tolist() == list(range(8))


def test_slices_are_refused():
    with pytest.raises(NotImplementedError, match="document 3 is sliced"):
        micro_batch_layouts([Segment(3, 100, 200, 0)], 2)


def test_invalid_layouts_are_refused():
    with pytest.raises(ValueError, match="held by no rank"):
        Layout((np.array([0, 1]), np.array([3])), 4).validate()
    with pytest.raises(ValueError, match="already holds"):
        Layout((np.array([0, 1]), np.array([1, 2])), 3).validate()
    with pytest.raises(ValueError, match="outside"):
        Layout((np.array([0, 5]),), 2).validate()
    with pytest.raises(ValueError, match="world_size"):
        micro_batch_layouts([3], 0)
