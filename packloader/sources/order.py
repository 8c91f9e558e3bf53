"""The epoch order of a source's documents, as pure numpy functions (no I/O, so they are tested on their own).

An epoch's stream is every document of the source exactly once: the shards in a per-epoch shuffled order, and
inside each shard its rows in a per-epoch shuffled order. A document's place in that stream (its *position*,
0..N-1) is what the loader draws by; its id is `epoch * N + position`, unique across epochs.

Randomness: one `numpy.random.Generator(PCG64)` per (seed, epoch, shard) from a `SeedSequence`, so an order depends
only on those numbers and the shard sizes, never on how many workers or ranks read it, or on what was read before.

Splitting: `split_range(lo, hi, parts, part)` cuts a range of positions into `parts` contiguous pieces whose sizes
differ by at most one. Every position lands in exactly one part, whatever `parts` is. Contiguous pieces of the
stream keep a worker on few shards (so it decodes few row groups); the loader uses it for dataloader workers
(each worker plans its own piece of each epoch) and for sharing tokenization among ranks (each rank tokenizes its
piece of a chunk and the lengths are exchanged).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Sequence

import numpy as np

# Tags that keep the shard-order and row-order streams of one (seed, epoch) independent.
_SHARD_TAG = 0x5348  # "SH"
_ROW_TAG = 0x524F  # "RO"


def _rng(*words: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(w) for w in words])))


def shard_order(num_shards: int, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """The order in which an epoch visits the shards (a permutation of range(num_shards), int64)."""
    if not shuffle:
        return np.arange(num_shards, dtype=np.int64)
    return _rng(seed, epoch, _SHARD_TAG).permutation(num_shards).astype(np.int64)


def row_order(num_rows: int, seed: int, epoch: int, shard: int, shuffle: bool = True) -> np.ndarray:
    """The order in which an epoch visits the rows of one shard (a permutation of range(num_rows), int64)."""
    if not shuffle:
        return np.arange(num_rows, dtype=np.int64)
    return _rng(seed, epoch, _ROW_TAG, shard).permutation(num_rows).astype(np.int64)


def split_range(lo: int, hi: int, parts: int, part: int) -> tuple[int, int]:
    """Part `part` of `parts` contiguous pieces of [lo, hi); sizes differ by at most one, earlier parts larger."""
    if parts < 1 or not 0 <= part < parts:
        raise ValueError(f"part {part} of {parts} parts: need parts >= 1 and 0 <= part < parts")
    n = hi - lo
    base, extra = divmod(n, parts)
    start = lo + part * base + min(part, extra)
    return start, start + base + (1 if part < extra else 0)


class EpochOrder:
    """One epoch's stream over shards of the given sizes: position -> (shard, row), vectorised.

    Shard row permutations are made on first use and the most recent `cache_shards` kept, so a source with many
    large shards costs memory only for the shards being read.
    """

    def __init__(self, shard_sizes: Sequence[int], seed: int, epoch: int, *, shuffle: bool = True,
                 cache_shards: int = 8) -> None:
        self.sizes = np.asarray(shard_sizes, dtype=np.int64)
        if self.sizes.ndim != 1 or (self.sizes < 0).any():
            raise ValueError(f"shard sizes must be a 1-D list of non-negative counts, got {shard_sizes!r}")
        self.seed, self.epoch, self.shuffle = int(seed), int(epoch), bool(shuffle)
        self.shards = shard_order(len(self.sizes), self.seed, self.epoch, self.shuffle)
        # starts[i]: the position of the first row of the i-th shard visited
        self.starts = np.concatenate([[0], np.cumsum(self.sizes[self.shards])]).astype(np.int64)
        self._perms: OrderedDict[int, np.ndarray] = OrderedDict()
        self._cache_shards = max(1, int(cache_shards))
        self._lock = threading.Lock()  # readers in several threads share one order

    @property
    def size(self) -> int:
        return int(self.starts[-1])

    def rows_of(self, shard: int) -> np.ndarray:
        """The row order of one shard in this epoch."""
        with self._lock:
            perm = self._perms.get(shard)
            if perm is not None:
                self._perms.move_to_end(shard)
                return perm
        perm = row_order(int(self.sizes[shard]), self.seed, self.epoch, shard, self.shuffle)
        with self._lock:
            self._perms[shard] = perm
            while len(self._perms) > self._cache_shards:
                self._perms.popitem(last=False)
        return perm

    def locate(self, positions) -> tuple[np.ndarray, np.ndarray]:
        """(shard, row) of each position, int64 arrays of the same length."""
        pos = np.asarray(positions, dtype=np.int64).reshape(-1)
        if pos.size and (pos.min() < 0 or pos.max() >= self.size):
            bad = int(pos[(pos < 0) | (pos >= self.size)][0])
            raise IndexError(f"position {bad} is outside the epoch's {self.size} documents")
        slot = np.searchsorted(self.starts, pos, side="right") - 1
        shards = self.shards[slot]
        rows = np.empty_like(pos)
        for s in np.unique(slot).tolist():
            sel = slot == s
            rows[sel] = self.rows_of(int(self.shards[s]))[pos[sel] - self.starts[s]]
        return shards, rows

    def spans(self, lo: int, hi: int) -> list[tuple[int, int, int]]:
        """The positions [lo, hi) cut at shard boundaries: (shard, first position, end position) in stream order."""
        out = []
        if hi <= lo:
            return out
        first = int(np.searchsorted(self.starts, lo, side="right")) - 1
        for s in range(first, len(self.shards)):
            a, b = max(lo, int(self.starts[s])), min(hi, int(self.starts[s + 1]))
            if a >= hi:
                break
            if b > a:
                out.append((int(self.shards[s]), a, b))
        return out


def epoch_stream(shard_sizes: Sequence[int], seed: int, epoch: int, shuffle: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """The whole epoch as (shard, row) arrays (for tests and small sources)."""
    order = EpochOrder(shard_sizes, seed, epoch, shuffle=shuffle)
    return order.locate(np.arange(order.size, dtype=np.int64))
