"""A Hugging Face `IterableDataset` as a source, resumed through its own `state_dict`.

The loader owns order, sharding and exact resume by (shard, row), which needs the number of documents and random
access. So the source walks the dataset once when it opens (a full pass: the epoch's length is needed to train
every document exactly once), and every `block_rows` rows it keeps the dataset's `state_dict()`: each block is a
shard. Reading a block restores the dataset to the block's start with `load_state_dict` and iterates
`block_rows` rows; recently read blocks are cached (`cache_blocks`). The open pass records each block's row
count and a digest of its rows (and each row's length: token columns then plan without reading tokens), and a
block read later must match: a dataset that does not resume to the same rows through its `state_dict` (a
shuffle buffer, whose content datasets does not save; a generator that yields other rows) is an error naming the
block, never other documents trained silently.

The source reads from where iterating the dataset given would start (its start, or a state loaded into it), also
after the caller iterated it (whose `state_dict` then stands at the end of that pass, not at the next one's
start: block 0 is read by iterating a copy, never by restoring that state), and works on copies of it, so the
caller's dataset is never moved.

Columns: the rule of `arrow_table.choose_column` (text or tokens; both is an error asking for `column=`), from
the dataset's features, or its first row's values when it has none.
"""

from __future__ import annotations

import copy
import hashlib
import threading
from itertools import islice
from typing import Iterator

import numpy as np
import pyarrow as pa

from packloader.sources.arrow_table import choose_column
from packloader.sources.base import RawDocument
from packloader.sources.errors import SourceError
from packloader.sources.reader import LruCache, ShardedSource


def _value(example: dict, column: str, pretokenized: bool, where: str):
    v = example.get(column) if isinstance(example, dict) else None
    if pretokenized:
        if v is None or isinstance(v, (str, bytes)):
            raise SourceError(f"{where}: {type(v).__name__}, expected a list of token ids")
        a = np.asarray(v)
        if a.ndim == 1 and a.dtype == object and any(x is None for x in a):
            raise SourceError(f"{where}: a null token id at position {next(k for k, x in enumerate(a) if x is None)}, "
                              "expected an id in [0, 2^31)")
        if a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
            raise SourceError(f"{where}: {a.dtype} array of shape {a.shape}, expected a list of token ids")
        if a.size and (a.min() < 0 or a.max() > np.iinfo(np.int32).max):
            raise SourceError(f"{where}: token id {int(a[(a < 0) | (a > np.iinfo(np.int32).max)][0])}, expected an "
                              "id in [0, 2^31)")
        return a.astype(np.int32)
    if not isinstance(v, str):
        raise SourceError(f"{where}: {type(v).__name__}, expected text (str)")
    return v


def _digest_update(h, value) -> None:
    data = value.encode() if isinstance(value, str) else value.tobytes()
    h.update(len(data).to_bytes(8, "little"))
    h.update(data)


class IterableDatasetSource(ShardedSource):
    """Blocks of `block_rows` rows of an `IterableDataset` as shards (see the module docstring)."""

    def __init__(self, ds, *, column: str | None = None, block_rows: int = 4096, cache_blocks: int = 4,
                 empty: str = "error", name: str | None = None) -> None:
        super().__init__(empty=empty)
        if block_rows < 1:
            raise ValueError(f"block_rows must be >= 1, got {block_rows}")
        # copies: restoring block states must not move the caller's dataset (nor a second source built on it).
        # `_first` is never restored: iterated, it starts where the dataset given starts (block 0), even when the
        # caller iterated it before, which leaves its state_dict at the end of that pass, not where the next starts
        self._ds, self.block_rows, self.cache_blocks = copy.deepcopy(ds), int(block_rows), int(cache_blocks)
        self._first = copy.deepcopy(ds)
        info_name = getattr(getattr(ds, "info", None), "dataset_name", None)
        self.label = name or (f"datasets.IterableDataset({info_name})" if info_name else "datasets.IterableDataset")
        self.vocab_size = None
        self._lock = threading.Lock()
        self.column, self._pretokenized = None, False
        self._starts: list[dict | None] = []  # state_dict at each block's first row (block 0: None)
        self._digests: list[str] = []
        self._lengths: list[np.ndarray] = []
        self._scan(column)
        n = len(self._lengths)
        self.identities = [f"rows digest {d}" for d in self._digests]
        self._open_shards([f"{self.label}, rows {k * self.block_rows}..{k * self.block_rows + len(self._lengths[k]) - 1}"
                           for k in range(n)], [len(x) for x in self._lengths])

    def _pick_column(self, column: str | None, first: dict) -> None:
        features = getattr(self._ds, "features", None)
        schema = features.arrow_schema if features is not None else pa.Table.from_pylist([first]).schema
        self.column, self._pretokenized = choose_column(self.label, schema, column)

    def _scan(self, column: str | None) -> None:
        ds = self._ds
        start = None  # block 0: iterate `_first` from where it starts (see __init__)
        h, lengths = None, []
        for i, ex in enumerate(ds):
            if i == 0:
                self._pick_column(column, ex)
            if i % self.block_rows == 0:
                self._starts.append(start)
                h, lengths = hashlib.blake2b(digest_size=12), []
            v = _value(ex, self.column, self._pretokenized, self._where(i))
            _digest_update(h, v)
            lengths.append(len(v))
            if (i + 1) % self.block_rows == 0:
                self._close_block(h, lengths)
                start = copy.deepcopy(ds.state_dict())
        if len(self._digests) < len(self._starts):
            self._close_block(h, lengths)
        if not self._starts:
            raise SourceError(f"{self.label}: no documents (the dataset yielded no rows)")

    def _close_block(self, h, lengths: list[int]) -> None:
        self._digests.append(h.hexdigest())
        self._lengths.append(np.asarray(lengths, dtype=np.int64))

    def _where(self, row: int) -> str:
        return f"{self.label}, row {row}, column {self.column!r}"

    def _location(self, shard: int, raw_row: int) -> str:
        return self._where(shard * self.block_rows + raw_row)

    @property
    def pretokenized(self) -> bool:
        return self._pretokenized

    def _block(self, shard: int) -> list:
        cache = self._process_cache().setdefault("blocks", LruCache(max_items=self.cache_blocks))
        rows = cache.get(shard)
        if rows is not None:
            return rows
        with self._lock:  # one dataset object: restore and iterate one block at a time
            ds = self._first
            if self._starts[shard] is not None:
                ds = self._ds
                ds.load_state_dict(copy.deepcopy(self._starts[shard]))
            n, first = len(self._lengths[shard]), shard * self.block_rows
            rows = [_value(ex, self.column, self._pretokenized, self._where(first + k))
                    for k, ex in enumerate(islice(iter(ds), n))]
        h = hashlib.blake2b(digest_size=12)
        for v in rows:
            _digest_update(h, v)
        if len(rows) != n or h.hexdigest() != self._digests[shard]:
            raise SourceError(
                f"{self._names[shard]}: restored through the dataset's state_dict, it yielded {len(rows)} rows that "
                f"differ from the {n} it yielded when the source opened; the IterableDataset does not resume exactly "
                "(a shuffle buffer is not saved in its state_dict; a generator must yield the same rows each time). "
                "Shuffle with the loader (shuffle=True) instead of IterableDataset.shuffle"
            )
        return cache.put(shard, rows)

    def _read_raw(self, shard: int, raw_rows: np.ndarray) -> Iterator[RawDocument]:
        rows = self._block(shard)
        for r in raw_rows.tolist():
            yield rows[r]

    def _raw_lengths(self, shard: int) -> np.ndarray | None:
        return self._lengths[shard] if self._pretokenized else None

    def _empty_rows(self, shard: int) -> np.ndarray:
        return self._lengths[shard] == 0

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        del state["_lock"]
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._lock = threading.Lock()
