"""Documents of a source in epoch order (`order.py`), with ids, lengths and tokens, and a resumable cursor.

`DocumentStream` is what the loader reads through. It knows, for any document id (`epoch * N + position`):
its `DocKey` (shard, row), its tokens (read from the source, tokenized when the source holds text, EOS appended
when configured), and, when the source has a length column, its length without reading tokens.

EOS: for text sources the tokenizer's EOS id is appended to every document when `append_eos` (the default). Rows
of a pre-tokenized source are used as stored, except for shards written by `packloader tokenize` with
`eos_appended=false` in their metadata, which get the EOS id recorded there (or the tokenizer's) when `append_eos`.

Token ids: a source that knows its vocabulary (Parquet shards from `packloader tokenize` record it) checks ids
itself; for token rows that record none, every id is checked against the vocabulary of the tokenizer the user
named (the default, "tekken", included): an id outside it is an error naming the shard, row and position, since
it would train as another vocabulary's token. `tokenizer=None` reads such ids unchecked.

Thread-safe: the loader reads from several threads at once (sources keep per-thread handles). Picklable: spawned
dataloader workers rebuild their caches.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Iterator, Sequence

import msgspec
import numpy as np

from packloader.sources.base import DocKey, Source
from packloader.sources.errors import SourceError
from packloader.sources.loss_mask import append_token, as_int32
from packloader.sources.order import EpochOrder
from packloader.sources.worker_copy import RebuildsCachesWhenPickled


class Cursor(msgspec.Struct, frozen=True, array_like=True):
    """Where a stream stands: the next document to read is `position` of epoch `epoch`."""

    epoch: int
    position: int


def resolve_tokenizer(tokenizer, num_threads: int | None = None):
    """A Tokenizer object as given, or one built by name with `get_tokenizer`."""
    if tokenizer is None or not isinstance(tokenizer, str):
        return tokenizer
    from packloader.sources.tokenizers import get_tokenizer

    return get_tokenizer(tokenizer, num_threads=num_threads)


class DocumentStream(RebuildsCachesWhenPickled):
    """A source read in epoch order. `tokenizer` may be a name ("tekken", "cl100k", "bytes", "hf:PATH") or an object
    with the `Tokenizer` protocol; it is only built when the source holds text (or a pre-tokenized shard needs an EOS id).
    """

    def __init__(self, source: Source, tokenizer="tekken", *, seed: int = 0, shuffle: bool = True,
                 append_eos: bool = True, tokenizer_threads: int | None = None) -> None:
        self.source = source
        self.sizes = np.array([s.num_rows for s in source.shards], dtype=np.int64)
        self.num_docs = int(self.sizes.sum())
        if self.num_docs == 0:
            names = [s.name for s in source.shards][:3]
            raise ValueError(f"the source has no documents (shards {names}{'...' if len(source.shards) > 3 else ''})")
        self.seed, self.shuffle, self.append_eos = int(seed), bool(shuffle), bool(append_eos)
        self.pretokenized = bool(source.pretokenized)
        if isinstance(tokenizer, str):
            from packloader.sources.tokenizers import check_tokenizer_spec

            check_tokenizer_spec(tokenizer)  # a name that names nothing is an error, whether or not it is used
        self._tokenizer_spec = tokenizer
        self._tokenizer_threads = tokenizer_threads
        self._init_caches()
        self._eos_id: int | None = None
        self.eos_appended = False  # whether read() appends an EOS id
        if self.pretokenized:
            meta = getattr(source, "metadata", None) or {}
            if append_eos and meta.get("packloader.eos_appended") == "false":
                eos = meta.get("packloader.eos_id", "")
                self._eos_id = int(eos) if eos else self.tokenizer.eos_id
                self.eos_appended = self._eos_id is not None
        elif append_eos:
            self._eos_id = self.tokenizer.eos_id
            if self._eos_id is None:
                raise ValueError(f"append_eos=True but tokenizer {self.tokenizer!r} has no EOS id; pass append_eos=False")
            self.eos_appended = True
        self._has_column: bool | None = None
        self.vocab_size: int | None = None  # checked here: token rows whose source records no vocabulary
        self.vocab_of: str | None = None
        if self.pretokenized and getattr(source, "vocab_size", None) is None and tokenizer is not None:
            self.vocab_size = int(self.tokenizer.vocab_size)
            self.vocab_of = getattr(self.tokenizer, "name", str(tokenizer))

    _caches = ("_lock", "_orders", "_col", "_tok")

    def _init_caches(self) -> None:
        self._lock = threading.Lock()
        self._orders: OrderedDict[int, EpochOrder] = OrderedDict()
        self._col: dict[int, np.ndarray] = {}
        self._tok = None


    # --- tokenizer ---------------------------------------------------------------------------------------------

    @property
    def tokenizer(self):
        if self._tok is None:
            with self._lock:
                if self._tok is None:
                    if self._tokenizer_spec is None:
                        raise ValueError("this source holds text: pass tokenizer=...")
                    self._tok = resolve_tokenizer(self._tokenizer_spec, self._tokenizer_threads)
        return self._tok

    @property
    def eos_id(self) -> int | None:
        return self._eos_id

    # --- ids and order -----------------------------------------------------------------------------------------

    def order(self, epoch: int) -> EpochOrder:
        with self._lock:
            o = self._orders.get(epoch)
            if o is None:
                o = EpochOrder(self.sizes, self.seed, epoch, shuffle=self.shuffle)
                self._orders[epoch] = o
                while len(self._orders) > 3:
                    self._orders.popitem(last=False)
            return o

    def doc_ids(self, epoch: int, positions) -> np.ndarray:
        return np.asarray(positions, dtype=np.int64) + np.int64(epoch) * self.num_docs

    def split_ids(self, ids) -> tuple[np.ndarray, np.ndarray]:
        ids = np.asarray(ids, dtype=np.int64)
        return ids // self.num_docs, ids % self.num_docs

    def locate(self, ids) -> tuple[np.ndarray, np.ndarray]:
        """(shard, row) of each document id."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        epochs, pos = self.split_ids(ids)
        shards, rows = np.empty_like(ids), np.empty_like(ids)
        for e in np.unique(epochs).tolist():
            sel = epochs == e
            shards[sel], rows[sel] = self.order(int(e)).locate(pos[sel])
        return shards, rows

    def keys(self, ids) -> list[DocKey]:
        shards, rows = self.locate(ids)
        return [DocKey(int(s), int(r)) for s, r in zip(shards.tolist(), rows.tolist())]

    # --- lengths -----------------------------------------------------------------------------------------------

    @property
    def has_column_lengths(self) -> bool:
        """True when every document's length is known without reading its tokens (a length column)."""
        if self._has_column is None:
            self._has_column = self.pretokenized and self._shard_lengths(0) is not None
        return self._has_column

    def _shard_lengths(self, shard: int) -> np.ndarray | None:
        got = self._col.get(shard)
        if got is None:
            raw = self.source.lengths(shard)
            if raw is None:
                return None
            got = np.asarray(raw, dtype=np.int64) + (1 if self.eos_appended else 0)
            if len(got) != self.sizes[shard]:
                raise ValueError(f"{self.source.shards[shard].name}: {len(got)} lengths for {self.sizes[shard]} rows")
            with self._lock:
                self._col[shard] = got
        return got

    def column_lengths(self, ids) -> np.ndarray:
        """Token counts (EOS included when appended) of documents, from the source's length column."""
        shards, rows = self.locate(ids)
        out = np.empty(len(shards), dtype=np.int64)
        for s in np.unique(shards).tolist():
            lengths = self._shard_lengths(int(s))
            if lengths is None:
                raise ValueError(f"{self.source.shards[s].name}: no length column; lengths need the tokens")
            sel = shards == s
            out[sel] = lengths[rows[sel]]
        return out

    # --- tokens ------------------------------------------------------------------------------------------------

    def read(self, ids: Sequence[int]) -> list[np.ndarray]:
        """Tokens (int32, EOS appended when configured) of each document id, in the order given."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        out: list[np.ndarray | None] = [None] * len(ids)
        if not len(ids):
            return []
        shards, rows = self.locate(ids)
        prefetch = getattr(self.source, "prefetch", None)  # remote pages of every shard at once
        if prefetch is not None and len(np.unique(shards)) > 1:
            prefetch({int(s): rows[shards == s] for s in np.unique(shards).tolist()})
        for s in np.unique(shards).tolist():
            where = np.flatnonzero(shards == s)
            raw = list(self.source.read(int(s), rows[where]))
            if self.vocab_size is not None:
                self._check_ids(int(s), rows[where], raw)
            for i, doc in zip(where.tolist(), self._finish(raw)):
                out[i] = doc
        return out  # type: ignore[return-value]

    def _check_ids(self, shard: int, rows: np.ndarray, docs: list) -> None:
        for row, d in zip(rows.tolist(), docs):
            d = np.asarray(d)
            if d.size and (int(d.min()) < 0 or int(d.max()) >= self.vocab_size):
                pos = int(np.flatnonzero((d < 0) | (d >= self.vocab_size))[0])
                where = getattr(self.source, "location", None)
                place = where(shard, row) if where is not None else f"{self.source.shards[shard].name}, row {row}"
                raise SourceError(
                    f"{place}: token id {int(d[pos])} at position {pos}, expected an id in [0, {self.vocab_size}), "
                    f"the vocabulary of tokenizer {self.vocab_of!r}, the tokenizer named (the shard records none): "
                    "pass the tokenizer the shard was written with, or tokenizer=None to read its ids unchecked"
                )

    def _finish(self, raw: list) -> list[np.ndarray]:
        if not self.pretokenized:
            raw = self.tokenizer.encode_batch(raw)
        eos = self._eos_id if self.eos_appended else None
        if eos is None:
            return [as_int32(d) for d in raw]
        return [append_token(d, eos) for d in raw]  # a masked document's EOS trains

    def documents(self, start: Cursor | None = None, stop_epoch: int | None = None,
                  batch: int = 256) -> Iterator[tuple[Cursor, int, np.ndarray]]:
        """(cursor after the document, document id, tokens) in epoch order from `start`, epochs up to `stop_epoch`
        (exclusive; None: forever). Resume by passing the last cursor seen."""
        epoch, pos = (start.epoch, start.position) if start is not None else (0, 0)
        while stop_epoch is None or epoch < stop_epoch:
            while pos < self.num_docs:
                end = min(self.num_docs, pos + batch)
                ids = self.doc_ids(epoch, np.arange(pos, end))
                for i, (doc_id, toks) in enumerate(zip(ids.tolist(), self.read(ids))):
                    nxt = pos + i + 1
                    cur = Cursor(epoch + 1, 0) if nxt == self.num_docs else Cursor(epoch, nxt)
                    yield cur, doc_id, toks
                pos = end
            epoch, pos = epoch + 1, 0
