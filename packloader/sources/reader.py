"""What every file reader shares: shard bookkeeping, empty-document policy, per-process handles, pickling.

A subclass describes its shards (names and raw row counts) and knows how to read raw rows; this base turns that
into the `Source` protocol of `base.py`:

- rows are checked against the shard's row count, and an empty document is an error naming the file and row,
  unless the source was opened with `empty="skip"`; the rule is the same whether the emptiness shows in the
  tokens (`read`) or in a length column (`lengths`), so a loader never drops an empty document silently. Skipping is decided once, when the source opens: the reader
  scans every shard for empty rows (a subclass does it as cheaply as its format allows) and the skipped rows leave
  the row space, so `read(shard, rows)` still yields exactly one document per requested row and `DocKey`s stay
  stable for a given set of options. `source.skipped` counts what was left out, with the first few places.
- open file handles and decoded blocks live in a per-thread, per-process cache: a forked dataloader worker or a
  second thread never shares a handle with another, and pickling (spawned workers) drops the cache.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from typing import Any, Hashable, Iterator, Sequence

import numpy as np

from packloader.sources.base import RawDocument, ShardInfo
from packloader.sources.errors import SkipCounter, check_policy, empty_error


class ShardedSource:
    """Base class of the file sources. Subclasses call `_open_shards(names, raw_counts)` at the end of `__init__`."""

    def __init__(self, *, empty: str = "error") -> None:
        check_policy("empty", empty)
        self.empty = empty
        self.skipped = SkipCounter()
        self._tls = threading.local()
        self._pcache: dict = {}
        self._pcache_pid = os.getpid()

    # --- what subclasses implement -------------------------------------------------------------------------------

    @property
    def pretokenized(self) -> bool:
        raise NotImplementedError

    def _read_raw(self, shard: int, raw_rows: np.ndarray) -> Iterator[RawDocument]:
        """Yield the documents of these raw rows, in the order given, checked for type and encoding."""
        raise NotImplementedError

    def _empty_rows(self, shard: int) -> np.ndarray:
        """Boolean mask over the shard's raw rows: True where the document is empty (only used with empty='skip')."""
        raise NotImplementedError

    def _raw_lengths(self, shard: int) -> np.ndarray | None:
        return None

    def _location(self, shard: int, raw_row: int) -> str:
        return f"{self._names[shard]}, row {raw_row}"

    # --- the Source protocol --------------------------------------------------------------------------------------

    def _open_shards(self, names: Sequence[str], raw_counts: Sequence[int]) -> None:
        self._names = list(names)
        self._keep: list[np.ndarray | None] = [None] * len(self._names)
        counts = list(raw_counts)
        if self.empty == "skip":
            for i in range(len(self._names)):
                empty = np.asarray(self._empty_rows(i), dtype=bool)
                if empty.any():
                    self._keep[i] = np.flatnonzero(~empty)
                    first = int(np.flatnonzero(empty)[0])
                    self.skipped.add("empty documents", self._location(i, first), int(empty.sum()))
                    counts[i] = len(self._keep[i])
        self._shards = [ShardInfo(n, int(c)) for n, c in zip(self._names, counts)]

    @property
    def shards(self) -> Sequence[ShardInfo]:
        return self._shards

    def read(self, shard: int, rows: np.ndarray) -> Iterator[RawDocument]:
        raw = self._raw_rows(shard, rows)
        for raw_row, doc in zip(raw.tolist(), self._read_raw(shard, raw)):
            if len(doc) == 0:  # with empty="skip" the row space holds none, so this is always an error
                raise empty_error(self._location(shard, raw_row), "tokens" if self.pretokenized else "text")
            yield doc

    def lengths(self, shard: int) -> np.ndarray | None:
        self._check_shard(shard)
        raw = self._raw_lengths(shard)
        if raw is None:
            return None
        keep = self._keep[shard]
        if keep is None and self.empty == "error" and len(raw) and not raw.all():
            # the same rule as read(): an empty document is refused, whether its length or its tokens tell
            raise empty_error(self._location(shard, int(np.flatnonzero(raw == 0)[0])), "tokens")
        return np.asarray(raw if keep is None else raw[keep], dtype=np.int64)

    def location(self, shard: int, row: int) -> str:
        """Where a row of the row space sits in its file, as errors name it (file and row, or line)."""
        return self._location(shard, self.raw_row(shard, row))

    def raw_row(self, shard: int, row: int) -> int:
        """The row a `DocKey` row stands for in the file (they differ only where empty rows were skipped)."""
        return int(self._raw_rows(shard, np.array([row]))[0])

    def __len__(self) -> int:
        return sum(s.num_rows for s in self._shards)

    # --- helpers ------------------------------------------------------------------------------------------------

    def _check_shard(self, shard: int) -> None:
        if not 0 <= shard < len(self._shards):
            raise IndexError(f"shard {shard} does not exist: the source has {len(self._shards)} shards")

    def _raw_rows(self, shard: int, rows) -> np.ndarray:
        self._check_shard(shard)
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        n = self._shards[shard].num_rows
        if rows.size and (rows.min() < 0 or rows.max() >= n):
            bad = int(rows[(rows < 0) | (rows >= n)][0])
            raise IndexError(f"{self._names[shard]}: row {bad} out of range; the shard has {n} rows")
        keep = self._keep[shard]
        return rows if keep is None else keep[rows]

    def _cache(self) -> dict:
        """A dict private to this thread in this process, for open handles and decoded blocks."""
        tls = self._tls
        pid = os.getpid()
        if getattr(tls, "pid", None) != pid:
            tls.pid = pid
            tls.cache = {}
        return tls.cache

    def _process_cache(self) -> dict:
        """A dict shared by this process's threads, for immutable things (open files, decompressed bytes)."""
        if self._pcache_pid != os.getpid():
            self._pcache = {}
            self._pcache_pid = os.getpid()
        return self._pcache

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        del state["_tls"]
        state["_pcache"], state["_pcache_pid"] = {}, None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._tls = threading.local()

    def __repr__(self) -> str:
        kind = "tokens" if self.pretokenized else "text"
        return f"{type(self).__name__}({len(self._shards)} shards, {len(self)} rows of {kind})"


def group_positions(group_of_row: np.ndarray) -> dict[int, np.ndarray]:
    """Positions of a request grouped by block (row group, shard file): each block is visited once per request."""
    order = np.argsort(group_of_row, kind="stable")
    sorted_groups = group_of_row[order]
    cuts = np.flatnonzero(np.diff(sorted_groups)) + 1
    # the filter runs before the key, so an empty request gives {} instead of indexing an empty group
    return {int(g[0]): pos for g, pos in zip(np.split(sorted_groups, cuts), np.split(order, cuts)) if len(pos)}


class LruCache:
    """The most recently used entries, up to `max_bytes` and `max_items` (always keeping the newest); thread-safe."""

    def __init__(self, max_bytes: float = float("inf"), max_items: float = float("inf")) -> None:
        self.max_bytes = max_bytes
        self.max_items = max_items
        self._entries: OrderedDict = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: Hashable) -> Any | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
            return entry[0]

    def put(self, key: Hashable, value: Any, nbytes: int = 0) -> Any:
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old[1]
            self._entries[key] = (value, nbytes)
            self._bytes += nbytes
            while len(self._entries) > 1 and (self._bytes > self.max_bytes or len(self._entries) > self.max_items):
                _, (_, size) = self._entries.popitem(last=False)
                self._bytes -= size
        return value
