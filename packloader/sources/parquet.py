"""Parquet shards: one file per shard, a text column or a pre-tokenized integer-list column, optional length column.

Access is by row group: `read(shard, rows)` maps each requested row to its row group, decodes every row group the
request touches exactly once (in the order the request first needs it), takes all the requested rows of that group
in one Arrow `take`, and yields the documents in the requested order. Decoded row groups stay in a small
per-thread LRU cache (`cache_bytes`, always at least the current one), so consecutive requests into the same row
group decode nothing. A request that spans several row groups not yet cached decodes them concurrently first, in a
small per-process thread pool (`decode_threads`, default min(4, CPUs); 1 turns it off): Arrow releases the GIL
while decoding, and a training step's documents, spread by the shuffle, touch many row groups at once.
A local token shard with a length index beside it (`packloader tokenize` writes one) is decoded through the index
(`parquet_chunk.py`: pyarrow spends a zstd context on every page of tokenize's one document a page).
Files are read with plain reads, never memory-mapped (a mapped file truncated by another process kills the
reader with SIGBUS); each shard's identity (`identity.py`: size and footer hash) is taken when the source opens,
and every handle opened and every row group read is followed by a check that the file is still that one, so a
shard rewritten by another process is a `ShardChanged` error naming it.

Column choice: `column=None` picks the text column (`text`, `content`) or the token column (`tokens`,
`input_ids`); a file holding both kinds (Hugging Face datasets often keep the text beside its tokens) is an error
asking for `column=` (`PackedLoader(..., column="tokens")`), since reading either silently could train what the
user did not mean.

Tokenizer metadata: shards written by `packloader tokenize` record their tokenizer, vocabulary and EOS in the
schema metadata; shards that record different ones (bytes beside Tekken ids) are refused, naming both files and
both tokenizers. `source.metadata` is that common record.

Token columns may be `list`/`large_list` of any integer type; values are cast to int32 (an out-of-range value is an
error naming the file and column), and every id must lie in [0, vocab_size): `vocab_size` is the argument, else the
`packloader.vocab_size` that `packloader tokenize` records in the schema metadata; without either only negative ids
are refused. Page checksums (which `packloader tokenize` writes) are verified on every read, so a shard with
overwritten bytes in its page data fails with an error naming the file and row group instead of yielding changed
tokens; files written without checksums are read unverified (the id range check is then the only guard). A length column (`length_column`, by default a column named "length" next to a
token column) gives `lengths(shard)` without reading tokens, and is checked against the token lists it describes
whenever a row group is decoded.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from packloader.sources.base import RawDocument
from packloader.sources.errors import NonUtf8Error, SourceError
from packloader.sources.format_registry import DEFAULT_COLUMNS, default_column
from packloader.sources.identity import FileWatch, parquet_identity
from packloader.sources.length_index import find_local
from packloader.sources.parquet_chunk import check_range, indexed_block
from packloader.sources.parquet_footer import constant_lengths, parsed_footer
from packloader.sources.parquet_ranged import open_paged, prefetch
from packloader.sources.paths import refuse_duplicates
from packloader.sources.reader import LruCache, ShardedSource, group_positions
from packloader.sources.storage import RemoteWatch, open_shard, watch_shard

TOKENIZER_KEYS = ("packloader.tokenizer", "packloader.vocab_size", "packloader.eos_id", "packloader.eos_appended")
DEFAULT_LENGTH_COLUMN = "length"


_POOLS: dict[tuple[int, int], ThreadPoolExecutor] = {}
_POOLS_LOCK = threading.Lock()


def _decode_pool(threads: int) -> ThreadPoolExecutor:
    """One decoding pool per process and size (a forked worker makes its own: threads do not survive fork)."""
    key = (os.getpid(), threads)
    with _POOLS_LOCK:
        pool = _POOLS.get(key)
        if pool is None:
            pool = _POOLS[key] = ThreadPoolExecutor(threads, thread_name_prefix="packloader-parquet")
        return pool


def _identity(path: str) -> str:
    try:
        return parquet_identity(path)
    except SourceError:
        return "unreadable"  # a file that is not Parquet: opening it names the problem


def _is_text(t: pa.DataType) -> bool:
    is_view = getattr(pa.types, "is_string_view", lambda _: False)
    return pa.types.is_string(t) or pa.types.is_large_string(t) or is_view(t)


def _is_token_list(t: pa.DataType) -> bool:
    return (pa.types.is_list(t) or pa.types.is_large_list(t)) and pa.types.is_integer(t.value_type)


class ParquetSource(ShardedSource):
    """Parquet files as shards (sorted paths). `column=None` picks the first of text, content, tokens, input_ids."""

    def __init__(self, paths: str | Path | Sequence[str | Path], *, column: str | None = None,
                 length_column: str | None = "auto", empty: str = "error", cache_bytes: int = 256 << 20,
                 decode_threads: int | None = None, vocab_size: int | None = None, storage=None) -> None:
        super().__init__(empty=empty)
        self.storage = storage  # remote shards: `storage.Storage` (None: local files, or URLs by their scheme)
        if vocab_size is not None and int(vocab_size) < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        self.decode_threads = min(4, os.cpu_count() or 1) if decode_threads is None else int(decode_threads)
        self._group_bytes = 1  # the largest decoded row group so far (bounds decoding ahead by the cache size)
        paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
        if not paths:
            raise ValueError("ParquetSource needs at least one file")
        self._paths = sorted(str(p) for p in paths)
        refuse_duplicates(self._paths)
        self.cache_bytes = int(cache_bytes)
        self.column: str | None = column
        self.length_column: str | None = None
        self._pretokenized: bool | None = None
        self._rg_starts: list[np.ndarray] = []
        self.metadata: dict[str, str] = {}  # key-value metadata of the first file with a tokenizer record
        self._metadata_from: str | None = None
        self._watch: list[FileWatch] = []
        self._footers: list[pq.FileMetaData] = []  # remote shards: reopened without fetching the footer again
        for shard, path in enumerate(self._paths):
            self._watch.append(watch_shard(path, "parquet", _identity, storage, "Parquet shard not found"))
            parsed = parsed_footer(self._watch[shard])
            if parsed is not None:
                self._footers.append(parsed)
            pf = self._open(shard)
            if parsed is None:
                self._footers.append(pf.metadata)
            self._check_schema(path, pf.schema_arrow, length_column)
            sizes = [pf.metadata.row_group(g).num_rows for g in range(pf.metadata.num_row_groups)]
            self._rg_starts.append(np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)]))
            self._check_metadata(path, pf.schema_arrow.metadata or {})
        self.identities = [w.identity for w in self._watch]  # what a saved state and the other ranks compare
        recorded = self.metadata.get("packloader.vocab_size", "")
        self.vocab_size: int | None = int(vocab_size) if vocab_size is not None else (
            int(recorded) if recorded.isdigit() else None)
        # remote token shards with a length index (`length_index.py`) are read page by page
        self._paged = [open_paged(w, w.storage, m, self.column) if isinstance(w, RemoteWatch) and self.pretokenized
                       else None for w, m in zip(self._watch, self._footers)]
        # local token shards with one (`tokenize` writes it) are decoded a row group at a time through it
        self._local = [find_local(p, w.identity, m, self.column) if self.pretokenized and not isinstance(
            w, RemoteWatch) else None for p, w, m in zip(self._paths, self._watch, self._footers)]
        self._open_shards(self._paths, [int(s[-1]) for s in self._rg_starts])

    @property
    def pretokenized(self) -> bool:
        return bool(self._pretokenized)

    # --- opening and schema checks --------------------------------------------------------------------------------

    def _open(self, shard: int) -> pq.ParquetFile:
        path = self._paths[shard]
        remote = isinstance(self._watch[shard], RemoteWatch)
        if not remote and not Path(path).exists():
            raise FileNotFoundError(f"Parquet shard not found: {path}")
        try:
            source = open_shard(path, self._watch[shard], self.storage) if remote else path
            footer = self._footers[shard] if remote and shard < len(self._footers) else None  # reads carry the ETag
            return pq.ParquetFile(source, metadata=footer, memory_map=False, page_checksum_verification=True)
        except (pa.ArrowException, OSError) as e:
            raise SourceError(f"{path}: not a readable Parquet file ({e})") from e

    def _check_metadata(self, path: str, raw: dict) -> None:
        """Every shard that records a tokenizer records the same one (ids of one vocabulary are not another's)."""
        meta = {k.decode(errors="replace"): v.decode(errors="replace") for k, v in raw.items() if k != b"ARROW:schema"}
        record = {k: meta[k] for k in TOKENIZER_KEYS if k in meta}
        if not record:
            return
        if self._metadata_from is None:
            self.metadata, self._metadata_from = meta, path
            return
        first = {k: self.metadata[k] for k in TOKENIZER_KEYS if k in self.metadata}
        if record != first:
            def desc(r: dict) -> str:
                return (f"tokenizer {r.get('packloader.tokenizer', '?')!r}, vocabulary {r.get('packloader.vocab_size', '?')}, "
                        f"EOS id {r.get('packloader.eos_id', '?')!r}, EOS appended {r.get('packloader.eos_appended', '?')}")
            raise SourceError(
                f"{self._metadata_from} and {path} were tokenized differently ({self._metadata_from}: {desc(first)}; "
                f"{path}: {desc(record)}); token ids of one vocabulary are not another's, so they are not read "
                "together. Tokenize every shard with one tokenizer (`packloader tokenize --tokenizer ...`)"
            )

    def _check_schema(self, path: str, schema: pa.Schema, length_column: str | None) -> None:
        names = schema.names
        if self.column is None:
            def kind_of(c: str) -> str:
                t = schema.field(c).type
                return "text" if _is_text(t) else "tokens" if _is_token_list(t) else ""

            self.column = default_column(
                path, names, kind_of,
                none_found=f"{path}: no text or token column found among {names}; expected one of "
                           f"{list(DEFAULT_COLUMNS)} or pass column=... (--column on the command line)",
                both_tail=" (PackedLoader(..., column=...), open_source(..., column=...), --column)")
        if self.column not in names:
            raise SourceError(f"{path}: no column {self.column!r}; the file has columns {names}")
        t = schema.field(self.column).type
        if _is_text(t):
            kind = False
        elif _is_token_list(t):
            kind = True
        else:
            raise SourceError(
                f"{path}, column {self.column!r}: type {t}, expected string/large_string (text) or "
                "list<int32>/large_list<int32> (tokens)"
            )
        if self._pretokenized is None:
            self._pretokenized = kind
            if length_column == "auto":
                length_column = DEFAULT_LENGTH_COLUMN if kind and DEFAULT_LENGTH_COLUMN in names else None
            elif length_column is not None and not kind:
                raise SourceError(f"{path}: a length column only describes token columns; {self.column!r} is text")
            self.length_column = length_column
        elif kind != self._pretokenized:
            raise SourceError(
                f"{path}, column {self.column!r}: type {t}, but {self._paths[0]} holds "
                f"{'tokens' if self._pretokenized else 'text'} in that column; all shards must agree"
            )
        if self.length_column is not None:
            if self.length_column not in names:
                raise SourceError(f"{path}: no length column {self.length_column!r}; the file has columns {names}")
            lt = schema.field(self.length_column).type
            if not pa.types.is_integer(lt):
                raise SourceError(f"{path}, column {self.length_column!r}: type {lt}, expected an integer length")

    # --- decoding ------------------------------------------------------------------------------------------------

    def _file(self, shard: int) -> pq.ParquetFile:
        files = self._cache().setdefault("files", LruCache(max_items=16))
        pf = files.get(shard)
        if pf is None:
            try:
                pf = self._open(shard)
            except (SourceError, FileNotFoundError):
                self._watch[shard].check()  # a file changed since the source opened says so
                raise
            self._watch[shard].check()  # the file opened is the one indexed
            files.put(shard, pf)
        return pf

    def _blocks(self) -> LruCache:
        return self._cache().setdefault("blocks", LruCache(max_bytes=self.cache_bytes))

    def _block(self, shard: int, group: int):
        """A decoded, checked row group: a text array, or (offsets, int32 values)."""
        blocks = self._blocks()
        hit = blocks.get((shard, group))
        if hit is not None:
            return hit
        return blocks.put((shard, group), *self._decode(shard, group))

    def _decode_ahead(self, groups: list[tuple[int, int]]) -> None:
        """Decode these (shard, row group)s (those not cached yet), several at once in a small thread pool, into
        this thread's cache. Arrow and zstd decode one row group's column on one core and release the GIL, so a
        request that spans many row groups (a step's documents, spread by the shuffle over row groups and shards)
        decodes up to `decode_threads` times faster."""
        if self.decode_threads < 2:
            return
        blocks = self._blocks()
        todo = [k for k in groups if blocks.get(k) is None]
        todo = todo[:max(1, int(self.cache_bytes // max(1, self._group_bytes)))]  # never decode what is evicted
        if len(todo) < 2:
            return
        futures = [_decode_pool(self.decode_threads).submit(self._decode, *k) for k in todo]
        for k, f in zip(todo, futures):
            blocks.put(k, *f.result())

    def _decode(self, shard: int, group: int) -> tuple[Any, int]:
        """A row group read, decoded and checked: (block, bytes). Thread-safe (files are per thread)."""
        path = self._paths[shard]
        start = int(self._rg_starts[shard][group])
        if self._local[shard] is not None:
            block = indexed_block(path, self._local[shard], group, start)
            self._watch[shard].check()  # the bytes just read are the indexed file's
            if block is not None:
                check_range(path, self.column, start, *block, self.vocab_size)
                self._group_bytes = max(self._group_bytes, block[0].nbytes + block[1].nbytes)
                return block, block[0].nbytes + block[1].nbytes
        columns = [self.column] + ([self.length_column] if self.length_column else [])
        try:
            table = self._file(shard).read_row_group(group, columns=columns)
        except (pa.ArrowException, OSError) as e:
            self._watch[shard].check()  # a file changed meanwhile says so, rather than "corrupt"
            a, b = int(self._rg_starts[shard][group]), int(self._rg_starts[shard][group + 1])
            raise SourceError(
                f"{path}: row group {group} (rows {a}..{b - 1}), column {self.column!r}: cannot be read, the file is "
                f"corrupt or truncated ({e})"
            ) from e
        self._watch[shard].check()  # the bytes just read are the indexed file's
        arr = table.column(self.column).combine_chunks()
        if arr.null_count:
            row = start + int(pc.index(arr.is_null(), True).as_py())
            raise SourceError(f"{path}, row {row}, column {self.column!r}: null, expected a value")
        block = self._token_block(path, start, arr, table) if self.pretokenized else arr
        if self.length_column:
            self._check_stated(shard, group, block[0])
        self._group_bytes = max(self._group_bytes, table.nbytes)
        return block, table.nbytes

    def _token_block(self, path: str, start: int, arr: pa.Array, table: pa.Table):
        values = arr.flatten()  # respects slicing, unlike .values
        if values.null_count:
            pos = int(pc.index(values.is_null(), True).as_py())
            row = start + int(np.searchsorted(arr.offsets.to_numpy(), pos + arr.offsets[0].as_py(), side="right")) - 1
            raise SourceError(f"{path}, row {row}, column {self.column!r}: null token id")
        if values.type != pa.int32():
            try:
                values = values.cast(pa.int32())  # safe cast: overflow raises
            except pa.ArrowInvalid as e:
                raise SourceError(f"{path}, column {self.column!r}: token ids do not fit int32 ({e})") from e
        offsets = arr.offsets.to_numpy().astype(np.int64)
        offsets -= offsets[0]
        tokens = values.to_numpy(zero_copy_only=False)
        check_range(path, self.column, start, offsets, tokens, self.vocab_size)
        if self.length_column:
            declared = table.column(self.length_column).combine_chunks()
            if declared.null_count:
                row = start + int(pc.index(declared.is_null(), True).as_py())
                raise SourceError(f"{path}, row {row}, column {self.length_column!r}: null, expected a length")
            actual = np.diff(offsets)
            bad = np.flatnonzero(declared.to_numpy(zero_copy_only=False) != actual)
            if bad.size:
                j = int(bad[0])
                raise SourceError(
                    f"{path}, row {start + j}, column {self.length_column!r}: says {declared[j].as_py()} tokens, "
                    f"but column {self.column!r} holds {int(actual[j])}"
                )
        return offsets, tokens

    def _check_stated(self, shard: int, group: int, offsets: np.ndarray) -> None:
        """The lengths the footer's statistics gave (planned from) are the tokens' lengths."""
        n = constant_lengths(self._footers[shard], self.length_column, group)[0]
        bad = np.flatnonzero(np.diff(offsets) != n) if n is not None else ()
        if len(bad):
            raise SourceError(
                f"{self._paths[shard]}, row {int(self._rg_starts[shard][group]) + int(bad[0])}, column "
                f"{self.length_column!r}: the row group's statistics say every length is {n}, but column "
                f"{self.column!r} holds {int(np.diff(offsets)[bad[0]])} tokens"
            )

    def prefetch(self, requests: dict[int, np.ndarray]) -> None:
        """For the `read`s that follow: fetch the pages of several shards' rows at once (remote shards with an
        index), and decode the other shards' row groups these rows need concurrently."""
        raw = {s: self._raw_rows(s, r) for s, r in requests.items()}
        if any(p is not None for p in self._paged):
            prefetch(self._paged, raw, self._blocks())
        self._decode_ahead([(s, g) for s, r in raw.items() if self._paged[s] is None for g in dict.fromkeys(
            (np.searchsorted(self._rg_starts[s], r, side="right") - 1).tolist())])

    def _read_raw(self, shard: int, raw_rows: np.ndarray) -> Iterator[RawDocument]:
        if self._paged[shard] is not None:  # only the pages of these rows
            yield from self._paged[shard].read(raw_rows, self._blocks(), shard, self.vocab_size)
            return
        starts = self._rg_starts[shard]
        groups = np.searchsorted(starts, raw_rows, side="right") - 1
        by_group = group_positions(groups)
        if len(by_group) > 1:
            self._decode_ahead([(shard, g) for g in dict.fromkeys(groups.tolist())])  # in the order needed
        pending: dict[int, RawDocument] = {}
        for i, g in enumerate(groups.tolist()):
            doc = pending.pop(i, None)
            if doc is None:  # the first position of group g in this request: take all of them now
                positions = by_group[g]
                local = raw_rows[positions] - starts[g]
                docs = self._take(shard, g, local)
                doc = docs[0]
                pending.update(zip(positions[1:].tolist(), docs[1:]))
            yield doc

    def _take(self, shard: int, group: int, local: np.ndarray) -> list[RawDocument]:
        block = self._block(shard, group)
        if self.pretokenized:
            offsets, tokens = block
            return [tokens[a:b].copy() for a, b in zip(offsets[local].tolist(), offsets[local + 1].tolist())]
        try:
            return block.take(pa.array(local)).to_pylist()
        except UnicodeDecodeError:
            for j in local.tolist():
                try:
                    block[j].as_py()
                except UnicodeDecodeError as e:
                    row = int(self._rg_starts[shard][group]) + j
                    raise NonUtf8Error(
                        f"{self._paths[shard]}, row {row}, column {self.column!r}: text is not valid UTF-8 ({e})"
                    ) from e
            raise

    # --- lengths and empty rows, from the cheapest column that tells -------------------------------------------------

    def _raw_lengths(self, shard: int) -> np.ndarray | None:
        """The length column, from the footer where it can tell: a row group whose length statistics have min ==
        max and no nulls holds rows of that one length (every row group of one document, as `packloader tokenize
        --row-group-tokens 1` writes, is told whole), so only the other row groups' length chunks are fetched. A
        rank with its own reads then plans without touching the token pages; the lengths stay checked against the
        tokens whenever a row group is decoded. A length index gives them all without a read."""
        if self._paged[shard] is not None:
            return self._paged[shard].lengths.copy()
        if self._local[shard] is not None:
            return self._local[shard].length_array().astype(np.int64)
        if self.length_column is None:
            return None
        path = self._paths[shard]
        pf = self._file(shard)
        starts = self._rg_starts[shard]
        out = np.empty(int(starts[-1]), dtype=np.int64)
        stated = constant_lengths(self._footers[shard], self.length_column)
        unknown = [g for g, n in enumerate(stated) if n is None]
        for g, n in enumerate(stated):
            if n is not None:
                out[starts[g]:starts[g + 1]] = n
        if not unknown:
            return out
        try:
            col = pf.read_row_groups(unknown, columns=[self.length_column]).column(0).combine_chunks()
        except (pa.ArrowException, OSError) as e:
            self._watch[shard].check()
            raise SourceError(
                f"{path}, column {self.length_column!r}: cannot be read, the file is corrupt or truncated ({e})"
            ) from e
        self._watch[shard].check()
        rows = np.concatenate([np.arange(starts[g], starts[g + 1]) for g in unknown])
        if col.null_count:
            row = int(rows[int(pc.index(col.is_null(), True).as_py())])
            raise SourceError(f"{path}, row {row}, column {self.length_column!r}: null, expected a length")
        out[rows] = col.to_numpy(zero_copy_only=False).astype(np.int64)
        return out

    def _empty_rows(self, shard: int) -> np.ndarray:
        lengths = self._raw_lengths(shard)
        if lengths is not None:
            return lengths == 0
        try:
            col = self._file(shard).read(columns=[self.column]).column(0)
        except (pa.ArrowException, OSError) as e:
            self._watch[shard].check()
            raise SourceError(
                f"{self._paths[shard]}, column {self.column!r}: cannot be read, the file is corrupt or truncated ({e})"
            ) from e
        measure = pc.list_value_length if self.pretokenized else pc.binary_length
        n = measure(col).fill_null(1)  # nulls are not "empty": reading them is an error of its own
        return n.to_numpy() == 0
