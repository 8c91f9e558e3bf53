"""Checks on what a loader yielded: every token of every document exactly once per epoch, tokens equal to the
source's, and batch fields consistent: the tests' independent reference (kept out of the package)."""

from __future__ import annotations

from collections import defaultdict
from typing import Iterable

import numpy as np

from packloader.collate.batch import IGNORE_INDEX, PackedBatch
from packloader.sources.stream import DocumentStream


class CoverageError(AssertionError):
    pass


class TokenLedger:
    """Records (doc, start, end) of yielded segments; `check_epoch` proves exactly-once coverage of an epoch."""

    def __init__(self, stream: DocumentStream) -> None:
        self.stream = stream
        self.segments: dict[int, list[tuple[int, int]]] = defaultdict(list)  # doc id -> [(start, end)]

    def add(self, batches: Iterable[PackedBatch | dict]) -> None:
        for b in batches:
            segs = b.segments if isinstance(b, PackedBatch) else b["segments"]
            for s in segs:
                self.segments[int(s.doc) if not isinstance(s, tuple) else s[0]].append(
                    (s.start, s.end) if not isinstance(s, tuple) else (s[1], s[2]))

    def check_epoch(self, epoch: int, lengths: np.ndarray | None = None, span: tuple[int, int] | None = None) -> int:
        """Raise CoverageError unless every token of every document of `epoch` (positions `span`, default all)
        was yielded exactly once; returns the number of tokens. `lengths` by position, else read from the stream."""
        n = self.stream.num_docs
        lo, hi = span or (0, n)
        ids = self.stream.doc_ids(epoch, np.arange(lo, hi))
        if lengths is None:
            lengths = np.array([len(t) for t in self.stream.read(ids)], dtype=np.int64)
        total = 0
        for doc, length in zip(ids.tolist(), np.asarray(lengths).tolist()):
            spans = sorted(self.segments.get(doc, []))
            at = 0
            for a, b in spans:
                if a != at:
                    what = "doubled" if a < at else "lost"
                    raise CoverageError(f"epoch {epoch}, document {doc}: tokens {min(a, at)}..{max(a, at) - 1} {what}; "
                                        f"segments {spans}, length {length}")
                at = b
            if at != length:
                raise CoverageError(f"epoch {epoch}, document {doc}: covered up to {at} of {length} tokens; {spans}")
            total += length
        extra = [d for d in self.segments if d // n == epoch and not lo <= d % n < hi]
        if extra:
            raise CoverageError(f"epoch {epoch}: documents outside the span were yielded: {extra[:5]}")
        return total


def check_batch_tokens(batch: PackedBatch, stream: DocumentStream, cache: dict | None = None) -> None:
    """The batch's input_ids, labels and positions against the documents read straight from the stream."""
    cache = {} if cache is None else cache
    ids = batch.input_ids.reshape(-1).numpy()
    labels = batch.labels.reshape(-1).numpy()
    pos = batch.position_ids.reshape(-1).numpy()
    offsets = (batch.cu_seqlens_padded if batch.cu_seqlens_padded is not None else batch.cu_seqlens).numpy()
    need = [s.doc for s in batch.segments if s.doc not in cache]
    if need:
        cache.update(zip(need, stream.read(need)))
    for i, s in enumerate(batch.segments):
        doc = cache[s.doc]
        o = int(offsets[i])
        q = s.end - s.start
        if not np.array_equal(ids[o : o + q], doc[s.start : s.end]):
            raise CoverageError(f"step {batch.step}: segment {s}: input_ids differ from the source")
        want = np.append(doc[s.start + 1 : s.end + 1], [] if s.end < len(doc) else [IGNORE_INDEX])
        if not np.array_equal(labels[o : o + q], want):
            raise CoverageError(f"step {batch.step}: segment {s}: labels differ from the next tokens")
        if not np.array_equal(pos[o : o + q], np.arange(s.start, s.end) - s.attend_from):
            raise CoverageError(f"step {batch.step}: segment {s}: position_ids are not the offsets from "
                                f"attend_from (0 at a document's or piece's start)")
