"""A mixture read as one stream: `MixedStream` offers what `DocumentStream` offers the loader (ids, keys, lengths,
tokens), so the loader's exactly-once machinery (draw cursor, planner queue, resume, elastic, workers) runs on a
mixture unchanged.

Mixture epoch e is positions 0..N-1 (N = `epoch_docs`, or the absolute quotas added up); its document at position
p is the blend's p-th draw of that epoch (`mixture.blend`), continuing from where epoch e-1's blend left every
entry (its cursor) and, for weights, the token counts. An entry's documents are its own `DocumentStream`'s ids in
order (pass * docs + position, its pass order seeded with the seed and the entry's name), so no document repeats
inside one pass of its entry and every document is drawn once per pass.

The blend needs every entry's lengths: from a length column where the entry has one (`packloader tokenize`
writes it), else by tokenizing the entry once when the stream opens (its tokens are read again when trained).
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections import OrderedDict
from typing import Iterator, Sequence

import msgspec
import numpy as np

from packloader.sources.base import DocKey, ShardInfo
from packloader.sources.mixture import BlendState, Mixture, MixtureError, as_mixture, blend, quotas, shares
from packloader.sources.stream import DocumentStream
from packloader.sources.upsample import UpsampledEntry
from packloader.sources.worker_copy import RebuildsCachesWhenPickled

_LENGTH_BATCH = 1024


def entry_seed(seed: int, name: str) -> int:
    """The seed of an entry's pass order: the loader's seed and the entry's name, so adding or removing another
    entry leaves this entry's order as it was."""
    h = hashlib.blake2b(f"{int(seed)}\x00{name}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 63) - 1)


class MixtureSource:
    """Every entry's shards as one `Source` (shard names prefixed `entry:`), for fingerprints and reading."""

    def __init__(self, names: list[str], sources: list) -> None:
        self.names, self.sources = names, sources
        self.offsets = np.cumsum([0] + [len(s.shards) for s in sources]).astype(np.int64)
        self._shards = [ShardInfo(f"{n}:{s.name}", s.num_rows) for n, src in zip(names, sources) for s in src.shards]
        ids = [getattr(src, "identities", None) for src in sources]
        self.identities = None if all(i is None for i in ids) else [
            x for i, src in zip(ids, sources) for x in (i if i is not None else [None] * len(src.shards))]

        self.description: dict = {}  # set by MixedStream: what the loader's fingerprint compares

    def describe(self) -> dict:
        return self.description

    @property
    def shards(self) -> Sequence[ShardInfo]:
        return self._shards

    @property
    def pretokenized(self) -> bool:
        return all(s.pretokenized for s in self.sources)

    def _split(self, shard: int) -> tuple[int, int]:
        e = int(np.searchsorted(self.offsets, shard, side="right")) - 1
        return e, shard - int(self.offsets[e])

    def read(self, shard: int, rows: np.ndarray) -> Iterator:
        e, s = self._split(shard)
        return self.sources[e].read(s, rows)

    def lengths(self, shard: int) -> np.ndarray | None:
        e, s = self._split(shard)
        return self.sources[e].lengths(s)


def _named(err: BaseException, name: str) -> BaseException:
    """The same error with the entry's name in front (a MixtureError where its type takes other arguments)."""
    try:
        return type(err)(f"mixture entry {name!r}: {err}")
    except Exception:  # noqa: BLE001 - an exception type with its own constructor
        return MixtureError(f"mixture entry {name!r}: {err}")


def _shard_paths(source) -> list[str]:
    """The real paths of a source's shard files (for the same-file check); labels that are not files are left out."""
    out = []
    for s in source.shards:
        name = str(s.name).split("#", 1)[0]
        if os.path.exists(name):
            out.append(os.path.realpath(name))
    return out


def _tokenizer_id(stream: DocumentStream, spec) -> str | None:
    """What an entry's token ids mean: the tokenizer its shards record, else the tokenizer it reads text with or
    checks ids against; None for token rows read unchecked."""
    meta = getattr(stream.source, "metadata", None) or {}
    if meta.get("packloader.tokenizer"):
        return str(meta["packloader.tokenizer"])
    if stream.pretokenized and stream.vocab_of is None:
        return None
    if spec is None:
        return None
    return spec if isinstance(spec, str) else getattr(spec, "name", type(spec).__name__)


class MixedStream(RebuildsCachesWhenPickled):
    """A mixture in blend order, with the `DocumentStream` interface the loader reads through (see module doc)."""

    def __init__(self, mixture, tokenizer="tekken", *, seed: int = 0, shuffle: bool = True, append_eos: bool = True,
                 tokenizer_threads: int | None = None) -> None:
        from packloader.sources.dispatch import open_any
        from packloader.sources.open import open_source

        self.mixture: Mixture = as_mixture(mixture)
        self.seed, self.shuffle, self.append_eos = int(seed), bool(shuffle), bool(append_eos)
        self.names = self.mixture.names
        self.entries: list[DocumentStream] = []
        sources = []
        for e in self.mixture.entries:
            try:
                src = (open_source(e.source, column=e.column, format=e.format) if e.format is not None
                       else open_any(e.source, column=e.column))
            except (OSError, ValueError) as err:
                raise _named(err, e.name) from err
            if sum(s.num_rows for s in src.shards) == 0:
                raise MixtureError(f"mixture entry {e.name!r} has no documents (shards "
                                   f"{[s.name for s in src.shards][:3]}); expected at least one")
            spec = e.tokenizer if e.tokenizer is not None else tokenizer
            stream = DocumentStream(src, spec, seed=entry_seed(seed, e.name), shuffle=shuffle and not e.upsample,
                                    append_eos=append_eos, tokenizer_threads=tokenizer_threads)
            if e.upsample:  # its passes shuffled by the upsampling, over documents and copies
                stream = UpsampledEntry(stream, e.upsample, seed=entry_seed(seed, e.name), shuffle=shuffle)
            self.entries.append(stream)
            sources.append(src)
        self._check_files(sources)
        self._check_tokenizers([e.tokenizer if e.tokenizer is not None else tokenizer for e in self.mixture.entries])
        self.source = MixtureSource(self.names, sources)
        self.entry_docs = [s.num_docs for s in self.entries]
        self.relative = self.mixture.relative
        if self.relative:
            self.weights = shares(self.mixture)
            self.num_docs = int(self.mixture.epoch_docs or sum(self.entry_docs))
        else:
            self.quota = quotas(self.mixture, self.entry_docs)
            self.num_docs = int(self.quota.sum())
        self.source.description = self.describe()
        self.pretokenized = all(s.pretokenized for s in self.entries)
        self.eos_appended = any(s.eos_appended for s in self.entries)
        eos = [s.eos_id for s in self.entries if s.eos_id is not None]
        self._eos_id = eos[0] if eos else None
        self.has_column_lengths = True  # the blend knows every length (module doc)
        # tokens of an entry read ahead of the documents asked for (`read`; at most 1,024 documents, at least 16); the
        # loader sets 0 at dp > 1, where a rank reads only its own documents
        self.readahead = 1 << 20
        self._base: list[np.ndarray | None] = [None] * len(self.entries)
        self._unit: int | None = None
        self.set_origin(0, 0, BlendState(cursors=[0] * len(self.entries), tokens=[0.0] * len(self.entries)))

    # --- checks --------------------------------------------------------------------------------------------------

    def _check_files(self, sources) -> None:
        owner: dict[str, str] = {}
        for name, src in zip(self.names, sources):
            for p in set(_shard_paths(src)):
                if p in owner:
                    raise MixtureError(f"mixture entries {owner[p]!r} and {name!r} both read {p}: a file belongs to "
                                       "one entry (its documents would train at two weights)")
                owner[p] = name

    def _check_tokenizers(self, specs) -> None:
        seen: tuple[str, str] | None = None
        for name, stream, spec in zip(self.names, self.entries, specs):
            tid = _tokenizer_id(stream, spec)
            if tid is None:
                continue
            if seen is not None and tid != seen[1]:
                raise MixtureError(f"mixture entry {name!r} has tokenizer {tid!r}, entry {seen[0]!r} {seen[1]!r}: "
                                   "expected one tokenizer for every entry (a model trains one vocabulary)")
            seen = seen or (name, tid)

    # --- pickling (DataLoader workers) ---------------------------------------------------------------------------

    _caches = ("_lock", "_blends", "_ahead", "_lengths")

    def _init_caches(self) -> None:
        self._lock = threading.RLock()
        self._blends: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()
        self._ahead: dict[int, dict[int, np.ndarray]] = {}  # entry -> its documents read ahead, by entry id
        self._lengths: dict[int, np.ndarray] = {}  # epoch -> its lengths in blend order


    # --- what DocumentStream offers ------------------------------------------------------------------------------

    @property
    def eos_id(self) -> int | None:
        return self._eos_id

    @property
    def tokenizer(self):
        for s in self.entries:
            if s._tokenizer_spec is not None:
                return s.tokenizer
        raise ValueError("no mixture entry names a tokenizer")

    def doc_ids(self, epoch: int, positions) -> np.ndarray:
        return np.asarray(positions, dtype=np.int64) + np.int64(epoch) * self.num_docs

    def split_ids(self, ids) -> tuple[np.ndarray, np.ndarray]:
        ids = np.asarray(ids, dtype=np.int64)
        return ids // self.num_docs, ids % self.num_docs

    def route(self, ids) -> tuple[np.ndarray, np.ndarray]:
        """(entry index, the entry stream's document id) of each mixed document id."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        epochs, pos = self.split_ids(ids)
        ent, idx = np.empty(len(ids), np.int32), np.empty(len(ids), np.int64)
        for e in np.unique(epochs).tolist():
            sel = epochs == e
            if e < self.origin[0]:
                ent[sel] = -1
                continue
            be, bi = self.epoch_blend(int(e))
            ent[sel], idx[sel] = be[pos[sel]], bi[pos[sel]]
        for i in np.flatnonzero(ent < 0).tolist():
            got = self.pending.get(int(ids[i]))
            if got is None:
                raise MixtureError(f"mixture document {int(ids[i])} was drawn before the mixture changed (epoch "
                                   f"{self.origin[0]}, position {self.origin[1]}) and is not among the documents "
                                   "the saved state holds to train")
            ent[i], idx[i] = got
        return ent, idx

    def entry_of(self, ids) -> np.ndarray:
        """Each document's entry index (into `names`)."""
        return self.route(ids)[0]

    def locate(self, ids) -> tuple[np.ndarray, np.ndarray]:
        ent, idx = self.route(ids)
        shards, rows = np.empty_like(idx), np.empty_like(idx)
        for e in np.unique(ent).tolist():
            sel = ent == e
            s, r = self.entries[e].locate(idx[sel])
            shards[sel], rows[sel] = s + self.source.offsets[e], r
        return shards, rows

    def keys(self, ids) -> list[DocKey]:
        shards, rows = self.locate(ids)
        return [DocKey(int(s), int(r)) for s, r in zip(shards.tolist(), rows.tolist())]

    def column_lengths(self, ids) -> np.ndarray:
        """Each document's length: from its epoch's lengths in blend order, or (a document drawn before a change
        of the mixture) from its entry."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        epochs, pos = self.split_ids(ids)
        out = np.full(len(ids), -1, np.int64)
        for e in np.unique(epochs).tolist():
            if e >= self.origin[0]:
                sel = epochs == e
                out[sel] = self._epoch_lengths(int(e))[pos[sel]]
        rest = np.flatnonzero(out < 0)
        if len(rest):
            ent, idx = self.route(ids[rest])
            for e in np.unique(ent).tolist():
                sel = ent == e
                out[rest[sel]] = self.entry_lengths(int(e), idx[sel])
        return out

    def _epoch_lengths(self, epoch: int) -> np.ndarray:
        """Lengths of epoch `epoch` in blend order (-1 before the origin), computed once per epoch."""
        with self._lock:
            got = self._lengths.get(epoch)
            if got is None:
                ent, idx = self.epoch_blend(epoch)
                got = np.full(len(ent), -1, np.int64)
                for e in range(len(self.entries)):
                    sel = ent == e
                    if sel.any():
                        got[sel] = self.entry_lengths(e, idx[sel])
                self._lengths[epoch] = got
                while len(self._lengths) > 3:
                    self._lengths.pop(min(self._lengths))
            return got

    def read(self, ids: Sequence[int]) -> list[np.ndarray]:
        """Tokens of each document. With `readahead` > 0 an entry's next documents (that many tokens) are read with
        the ones asked for and kept until asked: a step takes a few documents of every entry, and an entry's documents are drawn
        in its own order, so one larger read replaces a small one per entry and step."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if not len(ids):
            return []
        ent, idx = self.route(ids)
        out: list[np.ndarray | None] = [None] * len(ids)
        for e in np.unique(ent).tolist():
            where = np.flatnonzero(ent == e)
            for i, toks in zip(where.tolist(), self._entry_read(e, idx[where])):
                out[i] = toks
        return out  # type: ignore[return-value]

    def _ahead_docs(self, e: int) -> int:
        """Documents of entry e read ahead: `readahead` tokens at its mean length, 16..1,024."""
        lens = self._base_lengths(e)
        return int(np.clip(self.readahead // max(1.0, float(lens.mean())), 16, 1024))

    def _entry_read(self, e: int, idx: np.ndarray) -> list[np.ndarray]:
        if self.readahead <= 0:
            return self.entries[e].read(idx)
        ahead = self._ahead_docs(e)
        with self._lock:
            cache = self._ahead.setdefault(e, {})
            got = {int(i): cache.pop(int(i)) for i in idx.tolist() if int(i) in cache}
        missing = np.array(sorted(set(idx.tolist()) - set(got)), np.int64)
        if len(missing):
            lo = int(missing.min())
            span = np.union1d(missing, np.arange(lo, lo + ahead, dtype=np.int64))
            toks = self.entries[e].read(span)
            keep = {int(i): t for i, t in zip(span.tolist(), toks)}
            got.update({int(i): keep.pop(int(i)) for i in missing.tolist()})
            with self._lock:
                cache.update(keep)
                while len(cache) > 2 * ahead:  # documents asked for long ago go first
                    cache.pop(min(cache))
        return [got[int(i)] for i in idx.tolist()]

    # --- lengths and the blend -----------------------------------------------------------------------------------

    def _base_lengths(self, e: int) -> np.ndarray:
        """Entry e's lengths by (its shard offset + row), EOS included as read."""
        got = self._base[e]
        if got is None and isinstance(self.entries[e], UpsampledEntry):
            got = self._base[e] = self.entries[e].base_lengths
        if got is None:
            s = self.entries[e]
            ids = np.arange(s.num_docs, dtype=np.int64)  # pass 0 covers every document once
            shards, rows = s.locate(ids)
            if s.has_column_lengths:
                lens = s.column_lengths(ids)
            else:
                lens = np.concatenate([[len(t) for t in s.read(ids[i:i + _LENGTH_BATCH])]
                                       for i in range(0, len(ids), _LENGTH_BATCH)]).astype(np.int64)
            offsets = np.concatenate([[0], np.cumsum(s.sizes)]).astype(np.int64)
            got = np.empty(s.num_docs, np.int64)
            got[offsets[shards] + rows] = lens
            self._base[e] = got
        return got

    def entry_lengths(self, e: int, entry_ids) -> np.ndarray:
        s = self.entries[e]
        shards, rows = s.locate(np.asarray(entry_ids, np.int64))
        offsets = np.concatenate([[0], np.cumsum(s.sizes)]).astype(np.int64)
        return self._base_lengths(e)[offsets[shards] + rows]

    def _range_lengths(self, e: int, first: int, n: int) -> np.ndarray:
        return self.entry_lengths(e, np.arange(first, first + n, dtype=np.int64))

    @property
    def unit(self) -> int:
        """The blend's token unit: the mean document length over every entry, rounded (`blend_kernel`)."""
        if self._unit is None:
            base = [self._base_lengths(e) for e in range(len(self.entries))]
            self._unit = max(1, round(sum(int(b.sum()) for b in base) / sum(len(b) for b in base)))
        return self._unit

    def set_origin(self, epoch: int, pos: int, state: BlendState, pending: dict | None = None) -> None:
        """Where this stream's blend starts: position `pos` of epoch `epoch` from `state` (0, 0 and nothing drawn
        for a new run; where a changed mixture takes over at resume). Earlier positions route only through
        `pending` ({document id: (entry index, entry document id)}: what the saved state still holds to train)."""
        self.origin = (int(epoch), int(pos))
        self.pending = dict(pending or {})
        self._starts: dict[int, BlendState] = {int(epoch): state}
        self._init_caches()

    def blend_at(self, epoch: int, pos: int) -> BlendState:
        """The blend state after the first `pos` draws of epoch `epoch` (cursors; token counts as at the epoch's
        start, which a changed mixture does not take over)."""
        ent, idx = self.epoch_blend(epoch)
        cursors = list(self.blend_state(epoch).cursors)
        for e in range(len(self.entries)):
            drawn = idx[:pos][ent[:pos] == e]
            if len(drawn):
                cursors[e] = int(drawn.max()) + 1
        return BlendState(cursors=cursors, tokens=[0.0] * len(self.entries))

    def blend_state(self, epoch: int) -> BlendState:
        """The blend where mixture epoch `epoch` starts (each entry's cursor, the token counts)."""
        with self._lock:
            while max(self._starts) < epoch:
                self.epoch_blend(max(self._starts))
            return self._starts[epoch]

    def epoch_blend(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(entry, entry document id) of every position of mixture epoch `epoch`."""
        with self._lock:
            got = self._blends.get(epoch)
            if got is not None:
                return got
            start = self.blend_state(epoch)
            skip = self.origin[1] if epoch == self.origin[0] else 0  # positions before the origin: not this blend's
            if self.relative:
                ent, idx, after = blend(self.weights, None, start, self.num_docs - skip, self._range_lengths,
                                        self.unit)
                ent, idx = np.concatenate([np.full(skip, -1, np.int32), ent]), np.concatenate([np.zeros(skip, np.int64), idx])
            else:
                quota_tokens = np.array([self._range_lengths(e, c, int(q)).sum() if q else 0
                                         for e, (c, q) in enumerate(zip(start.cursors, self.quota))], np.float64)
                fresh = BlendState(cursors=start.cursors, tokens=[0.0] * len(self.entries))
                ent, idx, after = blend(quota_tokens, self.quota, fresh, self.num_docs, self._range_lengths, self.unit)
            self._starts.setdefault(epoch + 1, after)
            self._blends[epoch] = (ent, idx)
            while len(self._blends) > 3:
                self._blends.popitem(last=False)
            return ent, idx

    def epoch_summary(self, epoch: int) -> dict:
        """Per entry: documents and tokens drawn in mixture epoch `epoch`, and passes completed by its end."""
        ent, idx = self.epoch_blend(epoch)
        after = self.blend_state(epoch + 1)
        out = {}
        for e, name in enumerate(self.names):
            sel = ent == e
            out[name] = {"documents": int(sel.sum()), "tokens": int(self.entry_lengths(e, idx[sel]).sum()),
                         "passes_done": int(after.cursors[e] // self.entry_docs[e])}
        return out

    def describe(self) -> dict:
        """The mixture as the fingerprint compares it: entry names, weights or quotas, epoch size."""
        return {"entries": [{k: v for k, v in msgspec.structs.asdict(e).items() if k != "source"}
                            for e in self.mixture.entries], "epoch_docs": self.num_docs}
