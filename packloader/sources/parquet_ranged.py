"""Documents of a remote Parquet shard read page by page, through its length index: a request fetches only the
data pages that hold its documents' ids (adjacent pages in one ranged read), so a rank that trains a quarter of
the documents fetches about a quarter of the token bytes, however many documents a row group holds. Every page
is checked against the index as it is decoded (its ids, the rows that start in it and their lengths): a shard
whose pages disagree with its index is an error naming the file, row group and page, never shifted documents.

The ranged reads of one request run concurrently with exact ranges (`Storage(block_size=0, fetch_threads=...)`,
default 8, each thread fetching and decoding its pages; at most `read_ahead_bytes` in flight), so a step's pages
cost a few round trips' latency rather than one per run of pages; `prefetch` does the same for the rows of several
shards at once (`DocumentStream.read` calls it, since a step's documents come from many shards). The loader reads
a step's documents in a thread of their own, `prefetch` steps ahead of the trainer, so these reads overlap
training.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from packloader.sources.errors import SourceError
from packloader.sources.length_index import LengthIndex, find
from packloader.sources.parquet_pages import ColumnLayout, PageError, Unpageable, page_values, rows_agree

_INT32_LIMIT = 2**31
MERGE_SHARE = 0.1  # bytes spanned by merged reads: at most this share of the bytes a request wants (the 10 %
# slack of the byte target, at most 1/dp + 10 % of the corpus a rank, that exact reads leave at any dp)
_POOLS: dict[tuple[int, int], ThreadPoolExecutor] = {}
_POOLS_LOCK = threading.Lock()


def _fetch_pool(threads: int) -> ThreadPoolExecutor:
    """One pool per process and size (a forked worker makes its own)."""
    key = (os.getpid(), threads)
    with _POOLS_LOCK:
        if key not in _POOLS:
            _POOLS[key] = ThreadPoolExecutor(threads, thread_name_prefix="packloader-pages")
        return _POOLS[key]


class PagedShard:
    """One shard's index, ready to map rows to pages."""

    def __init__(self, index: LengthIndex, watch, storage) -> None:
        self.watch, self.storage, self.path, self.column = watch, storage, watch.path, index.column
        self.lengths = index.length_array().astype(np.int64)
        self.group_starts = np.concatenate(([0], np.cumsum(index.group_rows, dtype=np.int64)))
        self.layouts = [ColumnLayout(*k) for k in index.layouts]
        self.pages = [index.page_array(g) for g in range(len(index.group_rows))]
        self.page_starts = [np.concatenate(([0], np.cumsum(p[:, 2]))) for p in self.pages]
        # each row's first id within its row group's column chunk
        self.value_starts = np.zeros(len(self.lengths), dtype=np.int64)
        for g in range(len(self.pages)):
            a, b = self.group_starts[g], self.group_starts[g + 1]
            self.value_starts[a:b] = np.concatenate(([0], np.cumsum(self.lengths[a:b])[:-1])) if b > a else []

    def _spans(self, rows: np.ndarray) -> tuple[list, dict[int, set[int]]]:
        """Per row (row group, its first and end id in the chunk, its first and last page), and the pages needed."""
        groups = np.searchsorted(self.group_starts, rows, side="right") - 1
        need: dict[int, set[int]] = {}
        spans = []
        for r, g in zip(rows.tolist(), groups.tolist()):
            a = int(self.value_starts[r])
            b = a + int(self.lengths[r])
            ps = self.page_starts[g]
            first, last = (int(np.searchsorted(ps, a, "right")) - 1, int(np.searchsorted(ps, b - 1, "right")) - 1)
            spans.append((g, a, b, first, last))
            if b > a:
                need.setdefault(g, set()).update(range(first, last + 1))
        return spans, need

    def tasks(self, rows: np.ndarray, cache, shard: int, got: dict) -> list[tuple]:
        """The runs of pages `rows` need that the cache lacks, as (shard's reader, shard, group, pages): pages
        at most `merge_gap_bytes` apart share a run (one read spans the gap between them: fewer requests for a few
        more bytes, see `_runs`); the pages the cache holds go into `got`."""
        gap = int(getattr(self.storage, "merge_gap_bytes", 0))
        out = []
        for g, wanted in self._spans(rows)[1].items():
            missing = []
            for p in sorted(wanted):
                hit = cache.get(("page", shard, g, p))
                if hit is None:
                    missing.append(p)
                else:
                    got[shard, g, p] = hit
            out += [(self, shard, g, run) for run in self._runs(g, missing, gap)]
        return out

    def _runs(self, g: int, pages: list[int], gap: int) -> list[np.ndarray]:
        """`pages` (ascending) cut into runs, one read each. Adjacent pages share a run; of the gaps between the
        others, those of at most `gap` bytes are spanned smallest first (each saves a request for its bytes)
        while the bytes spanned stay within MERGE_SHARE of the wanted pages' bytes, so merging never costs a
        request more than that share above exact ranges, whatever the documents' sizes."""
        at = np.asarray(pages, np.int64)
        starts = self.pages[g][at, 0]
        ends = starts + self.pages[g][at, 1]
        between = starts[1:] - ends[:-1]
        order = np.argsort(between, kind="stable")
        spanned = (between[order] <= gap) & (np.cumsum(between[order]) <= MERGE_SHARE * int((ends - starts).sum()))
        cut = np.ones(len(between), dtype=bool)
        cut[order[spanned]] = False
        return [run for run in np.split(at, np.flatnonzero(cut) + 1) if len(run)]

    def read(self, rows: np.ndarray, cache, shard: int, vocab_size: int | None) -> list[np.ndarray]:
        """The token ids of `rows` (shard rows), in the order given."""
        got: dict = {}
        got.update(fetch_runs(self.tasks(rows, cache, shard, got), cache))
        out = []
        for r, (g, a, b, first, last) in zip(rows.tolist(), self._spans(rows)[0]):
            ps = self.page_starts[g]
            parts = [got[shard, g, p][max(a, ps[p]) - ps[p]:min(b, ps[p + 1]) - ps[p]] for p in range(first, last + 1)
                     if b > a]
            tokens = np.concatenate(parts) if parts else np.zeros(0, np.int32)
            out.append(self._checked(tokens, r, vocab_size))
        return out

    def _checked(self, tokens: np.ndarray, row: int, vocab_size: int | None) -> np.ndarray:
        hi = vocab_size if vocab_size is not None else _INT32_LIMIT
        if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) >= hi):
            pos = int(np.flatnonzero((tokens < 0) | (tokens >= hi))[0])
            vocab = f"in [0, {vocab_size}), the vocabulary" if vocab_size is not None else ">= 0"
            raise SourceError(f"{self.path}, row {row}, column {self.column!r}: token id {int(tokens[pos])} at "
                              f"position {pos}, expected an id {vocab}")
        return tokens.astype(np.int32)

    def run(self, g: int, run: np.ndarray) -> list[tuple[int, np.ndarray]]:
        """The pages of one run of adjacent pages: one ranged read, then each page decoded and checked."""
        f = self.storage.open(self.watch.info)
        table = self.pages[g]
        start = int(table[run[0], 0])
        end = int(table[run[-1], 0] + table[run[-1], 1])
        buf = memoryview(f.pread(end - start, start))
        out = []
        for p in run.tolist():
            o = int(table[p, 0]) - start
            out.append((p, self._decode(buf[o:o + int(table[p, 1])], g, p)))
        return out

    def _decode(self, buf, g: int, p: int) -> np.ndarray:
        table, where = self.pages[g], f"{self.path}, row group {g}, page at byte {int(self.pages[g][p, 0])}"
        try:
            page = page_values(buf, self.layouts[g])
        except (PageError, Unpageable) as e:
            raise SourceError(f"{where}: cannot be read ({e}); the shard is corrupt or not the one indexed") from e
        if page is None:
            raise SourceError(f"{where}: the length index names a page without ids; the index is not this shard's")
        ids, head, rows = page
        first = int(table[p, 3])
        end = int(table[p + 1, 3]) if p + 1 < len(table) else int(self.group_starts[g + 1])
        want = self.lengths[first:end]
        g0 = int(self.group_starts[g])
        at = int(self.value_starts[first]) if first < self.group_starts[g + 1] else int(self.page_starts[g][-1])
        if len(ids) != int(table[p, 2]) or not rows_agree(head, rows, want, at - int(self.page_starts[g][p])):
            raise SourceError(f"{where} (rows {first}..{end - 1}, row group rows from {g0}): its ids and rows "
                              "disagree with the length index; the index is not this shard's")
        return ids


def fetch_runs(tasks: list[tuple], cache) -> dict:
    """{(shard, group, page): ids} of every run of `tasks` (`PagedShard.tasks`), fetched `fetch_threads` at a time
    where the storage reads exact ranges (runs in one block would each fetch that block), in batches of at most
    `read_ahead_bytes`, and kept in `cache`."""
    if not tasks:
        return {}
    storage = tasks[0][0].storage
    threads = int(getattr(storage, "fetch_threads", 8)) if storage.block_size == 0 else 1
    bound = int(getattr(storage, "read_ahead_bytes", 64 << 20))
    got: dict = {}
    batch: list[tuple] = []
    size = 0
    for k, (paged, shard, g, run) in enumerate(tasks):
        batch.append((paged, shard, g, run))
        table = paged.pages[g]
        size += int(table[run[-1], 0] + table[run[-1], 1] - table[run[0], 0])
        if k + 1 < len(tasks) and size < bound:
            continue
        if threads > 1 and len(batch) > 1:
            done = list(_fetch_pool(threads).map(lambda t: t[0].run(t[2], t[3]), batch))
        else:
            done = [t[0].run(t[2], t[3]) for t in batch]
        for (_, shard_, g_, _), pages in zip(batch, done):
            for p, ids in pages:
                got[shard_, g_, p] = cache.put(("page", shard_, g_, p), ids, ids.nbytes)
        batch, size = [], 0
    return got


def prefetch(paged: list, requests, cache) -> None:
    """Fetch the pages of several shards' rows at once ({shard: rows}), into `cache`: a step's documents spread
    over many shards cost one round of concurrent reads rather than one per shard."""
    tasks: list[tuple] = []
    for shard, rows in requests.items():
        if paged[shard] is not None:
            tasks += paged[shard].tasks(rows, cache, shard, {})
    fetch_runs(tasks, cache)


def open_paged(watch, storage, meta, column: str) -> PagedShard | None:
    """The paged reader of a remote shard where a length index is found or built (see `length_index.find`)."""
    mode = getattr(storage, "index", "use")
    index = find(watch, storage, meta, column, mode)
    return None if index is None else PagedShard(index, watch, storage)
