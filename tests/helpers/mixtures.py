"""Mixture entries whose documents say what they are: every token of document k of entry e is `TAG * e + k`, so
what trained is read off the batches themselves (the mixture tests' independent reference)."""

from __future__ import annotations

import numpy as np

from packloader.sources.base import IterableSource
from packloader.sources.mixture import MixtureEntry

TAG = 100_000


def tagged_entry(e: int, n: int, seed: int, max_len: int, **weight) -> MixtureEntry:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, max_len + 1, n)
    docs = [np.full(int(k), TAG * e + i, np.int32) for i, k in enumerate(lengths)]
    return MixtureEntry(name=f"src{e}", source=IterableSource(docs, name=f"src{e}"), **weight)


def trained(batches):
    """(entry, doc) tag -> tokens trained, per step: from the input ids (one tag per document)."""
    steps: dict[int, dict[int, int]] = {}
    for b in batches:
        ids = b.input_ids.reshape(-1).numpy()
        vals, counts = np.unique(ids, return_counts=True)
        per = steps.setdefault(b.step, {})
        for v, c in zip(vals.tolist(), counts.tolist()):
            per[v] = per.get(v, 0) + c
    return steps
