"""Exactly once and exact resume for any source given to PackedLoader: the checks the new sources share."""

from __future__ import annotations

import hashlib
import pickle
from typing import Callable

import numpy as np
import pytest

from packloader.contracts import PlanConfig
from packloader.loader.loader import PackedLoader
from tests.helpers.ledger import TokenLedger


def small_config(tokens_per_step: int = 600) -> PlanConfig:
    return PlanConfig(strategy="fixed", max_tokens=256, context=256, tokens_per_step=tokens_per_step)


def batch_digest(b) -> tuple:
    h = hashlib.blake2b(digest_size=8)
    for t in (b.input_ids, b.labels, b.position_ids, b.cu_seqlens, b.doc_ids):
        h.update(t.numpy().tobytes())
    return (b.step, b.index_in_step, b.epoch, h.hexdigest())


def check_exactly_once(loader: PackedLoader, expected_tokens: list[np.ndarray]) -> None:
    """One epoch covers every token of every document once, and the documents' tokens are `expected_tokens` (as a
    multiset: the loader's order is shuffled), an independent reference written by the test."""
    ledger = TokenLedger(loader.stream)
    pieces: dict[int, dict[int, list[int]]] = {}
    for b in loader:
        ledger.add([b])
        ids, cu = b.input_ids.numpy().reshape(-1), b.cu_seqlens.numpy()
        for s, a, e in zip(b.segments, cu[:-1].tolist(), cu[1:].tolist()):
            pieces.setdefault(int(s.doc), {})[int(s.start)] = ids[a:e].tolist()
    ledger.check_epoch(0)
    got = sorted(tuple(t for _, p in sorted(doc.items()) for t in p) for doc in pieces.values())
    want = sorted(tuple(np.asarray(t).tolist()) for t in expected_tokens)
    assert got == want


def check_exact_resume(make: Callable[[], PackedLoader], stop: int) -> None:
    """Stop after `stop` batches, pickle the state, resume in a fresh loader: the rest equals an uninterrupted run."""
    whole = [batch_digest(b) for b in make()]
    assert 0 < stop < len(whole), (stop, len(whole))
    first = make()
    it = iter(first)
    head = [batch_digest(next(it)) for _ in range(stop)]
    state = pickle.loads(pickle.dumps(first.state_dict()))
    second = make()
    second.load_state_dict(state)
    tail = [batch_digest(b) for b in second]
    assert head + tail == whole


def check_replaced_shard_refused(url: str, replace: Callable[[], None], name: str) -> None:
    """A state saved mid-epoch is refused, naming the shard `name`, once `replace()` rewrites it under the state."""
    loader = PackedLoader(url, config=small_config(), tokenizer=None, num_threads=1)
    it = iter(loader)
    next(it)
    state = pickle.loads(pickle.dumps(loader.state_dict()))
    replace()
    fresh = PackedLoader(url, config=small_config(), tokenizer=None, num_threads=1)
    with pytest.raises(ValueError, match=name):
        fresh.load_state_dict(state)
