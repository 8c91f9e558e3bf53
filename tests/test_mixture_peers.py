"""A mixture's blend against the peers' own functions, on the same inputs: megatron-core's blending indices
(documents of one length: the same entry and the same document, draw by draw) and mosaicml-streaming's per-stream
sample counts for `proportion`, `repeat` and `choose` (samples of one length: the same counts per epoch)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from packloader.sources.base import IterableSource
from packloader.sources.mixed_stream import MixedStream
from packloader.sources.mixture import Mixture, MixtureEntry


def _entries(sizes, length, **weights):
    """Entries of `sizes` documents of `length` tokens each; `weights` maps a field (weight/repeat/choose) to one
    value per entry."""
    (field, values), = weights.items()
    return [MixtureEntry(name=f"e{i}", source=IterableSource([np.full(length, i, np.int32)] * n, name=f"e{i}"),
                         **{field: v}) for i, (n, v) in enumerate(zip(sizes, values))]


def _megatron(weights, size):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets import helpers_cpp
    w = np.asarray(weights, np.float64)
    w = w / w.sum()  # BlendedDataset normalises the weights it is given
    entry, sample = np.zeros(size, np.int16), np.zeros(size, np.int64)
    helpers_cpp.build_blending_indices(entry, sample, w, len(w), size, False)
    return entry, sample


@pytest.mark.parametrize("weights", [[0.3, 0.5, 0.2], [0.7, 0.3], [1, 1, 1], [0.1, 0.2, 0.3, 0.4],
                                     [5, 1, 1, 1, 1, 1, 1, 1], [0.05, 0.15, 0.25, 0.35, 0.2]])
@pytest.mark.parametrize("length", [1, 137, 4096])
def test_equal_length_order_is_megatron_blending_index(weights, length):
    size = 2000
    sizes = [400 + 37 * i for i in range(len(weights))]  # small entries: several passes, the index keeps counting
    stream = MixedStream(Mixture(entries=_entries(sizes, length, weight=weights), epoch_docs=size), None)
    want_entry, want_sample = _megatron(weights, size)
    entry, index = stream.route(stream.doc_ids(0, np.arange(size)))
    assert entry.tolist() == want_entry.tolist()
    # the entry's document id counts its draws (pass * documents + position): megatron's sample index
    assert index.tolist() == want_sample.tolist()
    # and it goes on across mixture epochs as megatron's longer index does
    longer_entry, longer_sample = _megatron(weights, 3 * size)
    e2, i2 = stream.route(stream.doc_ids(2, np.arange(size)))
    assert e2.tolist() == longer_entry[2 * size:].tolist()
    assert i2.tolist() == longer_sample[2 * size:].tolist()


def _streaming_counts(sizes, epoch_size=None, **weights):
    from streaming.base.stream import Stream

    (field, values), = weights.items()
    streams = [Stream(local=f"/nonexistent/{i}", **{field: v}) for i, v in enumerate(values)]
    total = Stream.apply_weights(streams, np.asarray(sizes, np.int64), epoch_size, 0)
    return total, [int(s.choose) for s in streams]


def _counts(stream: MixedStream, epoch: int) -> list[int]:
    entry = stream.entry_of(stream.doc_ids(epoch, np.arange(stream.num_docs)))
    return np.bincount(entry, minlength=len(stream.names)).tolist()


@pytest.mark.parametrize("sizes,repeat", [([100, 30, 200], [0.5, 2.5, 1.0]), ([7, 50], [3.0, 0.1]),
                                          ([64, 64, 64], [1.0, 0.0, 1.75])])
def test_repeat_counts_equal_streaming(sizes, repeat):
    total, want = _streaming_counts(sizes, repeat=repeat)
    stream = MixedStream(Mixture(entries=_entries(sizes, 9, repeat=repeat)), None)
    assert stream.num_docs == total
    for epoch in range(3):
        assert _counts(stream, epoch) == want


@pytest.mark.parametrize("sizes,choose", [([100, 30, 200], [10, 300, 7]), ([5, 5], [0, 12])])
def test_choose_counts_equal_streaming(sizes, choose):
    total, want = _streaming_counts(sizes, choose=choose)
    stream = MixedStream(Mixture(entries=_entries(sizes, 33, choose=choose)), None)
    assert stream.num_docs == total
    for epoch in range(3):
        assert _counts(stream, epoch) == want


@pytest.mark.parametrize("sizes,proportion,epoch_size", [([100, 30, 200], [0.5, 0.3, 0.2], None),
                                                         ([40, 40, 20, 100], [0.25, 0.25, 0.25, 0.25], 400),
                                                         ([100, 30, 200], [0.6, 0.3, 0.1], 1000)])
def test_proportion_counts_equal_streaming(sizes, proportion, epoch_size):
    """Shares whose documents per epoch are whole numbers: the counts equal streaming's."""
    total, want = _streaming_counts(sizes, epoch_size, proportion=proportion)
    stream = MixedStream(Mixture(entries=_entries(sizes, 64, weight=proportion), epoch_docs=epoch_size), None)
    assert stream.num_docs == total
    assert _counts(stream, 0) == want


def test_proportion_fractional_counts_within_one_of_streaming():
    """Where shares x epoch size are fractions, streaming gives the spare samples to streams drawn at random; the
    blend gives them by deficit: each count differs by at most one, and the totals agree."""
    sizes, proportion = [101, 33, 207, 58], [0.37, 0.21, 0.29, 0.13]
    total, want = _streaming_counts(sizes, proportion=proportion)
    stream = MixedStream(Mixture(entries=_entries(sizes, 64, weight=proportion)), None)
    got = _counts(stream, 0)
    assert sum(got) == total
    assert max(abs(a - b) for a, b in zip(got, want)) <= 1
