"""Arrow tables as shards: Arrow IPC files (`.arrow`, file or stream format, memory-mapped) and the tables behind
a Hugging Face `datasets.Dataset` (`hf_datasets.py`).

Column choice is the Parquet rule: `column=None` picks the text column (`text`, `content`) or the token column
(`input_ids`, `tokens`); a table holding both kinds is an error asking for `column=`, since training either
silently could train what the user did not mean. Token columns (list / large_list / fixed-size list of integers)
are used as stored, cast to int32 (ids outside [0, 2^31) are an error naming the row); their list lengths give
`lengths()` without reading tokens. A null row is an error naming it. A shard may carry an index mapping (a
shuffled or selected `Dataset`): row r of the shard is row `indices[r]` of its table.
"""

from __future__ import annotations

import os
from typing import Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from packloader.sources.base import RawDocument
from packloader.sources.errors import SourceError
from packloader.sources.reader import ShardedSource

TEXT_COLUMNS = ("text", "content")
TOKEN_COLUMNS = ("input_ids", "tokens")
_I32 = np.iinfo(np.int32).max


def _is_text(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t)


def _is_tokens(t: pa.DataType) -> bool:
    lists = pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)
    return lists and pa.types.is_integer(t.value_type)


def choose_column(name: str, schema: pa.Schema, column: str | None) -> tuple[str, bool]:
    """(column, pretokenized) by the rule above; errors name `name` and the columns found."""
    names = schema.names
    if column is None:
        text = [c for c in TEXT_COLUMNS if c in names and _is_text(schema.field(c).type)]
        tokens = [c for c in TOKEN_COLUMNS if c in names and _is_tokens(schema.field(c).type)]
        if text and tokens:
            raise SourceError(
                f"{name}: holds text ({', '.join(map(repr, text))}) and tokens ({', '.join(map(repr, tokens))}); "
                f"which to train is not guessed: pass column={tokens[0]!r} to read the tokens as stored, or "
                f"column={text[0]!r} to tokenize the text (PackedLoader(..., column=...), open_source(..., column=...))"
            )
        found = text or tokens
        if not found:
            raise SourceError(f"{name}: no text or token column found among {names}; expected one of "
                              f"{list(TEXT_COLUMNS + TOKEN_COLUMNS)} (string or list of integers) or pass column=...")
        column = found[0]
    if column not in names:
        raise SourceError(f"{name}: no column {column!r}; it has columns {names}")
    t = schema.field(column).type
    if not (_is_text(t) or _is_tokens(t)):
        raise SourceError(f"{name}, column {column!r}: type {t}, expected string (text) or a list of integers (tokens)")
    return column, _is_tokens(t)


class ArrowTableSource(ShardedSource):
    """Shards given as (name, table, indices or None); every table must hold the chosen column with one kind."""

    def __init__(self, shards: Sequence[tuple[str, pa.Table, np.ndarray | None]], *, column: str | None = None,
                 empty: str = "error") -> None:
        super().__init__(empty=empty)
        if not shards:
            raise ValueError("ArrowTableSource needs at least one table")
        self.vocab_size = None  # no vocabulary recorded
        self.column, self._pretokenized = choose_column(shards[0][0], shards[0][1].schema, column)
        self._columns: list[pa.ChunkedArray] = []
        self._indices: list[np.ndarray | None] = []
        for name, table, indices in shards:
            col, tok = choose_column(name, table.schema, self.column)
            if tok != self._pretokenized:
                raise SourceError(f"{name}, column {col!r}: {'tokens' if tok else 'text'} where {shards[0][0]} holds "
                                  f"{'tokens' if self._pretokenized else 'text'}; expected one kind in every shard")
            self._columns.append(table.column(col))
            self._indices.append(None if indices is None else np.asarray(indices, dtype=np.int64))
        counts = [len(c) if i is None else len(i) for c, i in zip(self._columns, self._indices)]
        self._open_shards([s[0] for s in shards], counts)

    @property
    def pretokenized(self) -> bool:
        return self._pretokenized

    def _table_rows(self, shard: int, raw_rows: np.ndarray) -> np.ndarray:
        idx = self._indices[shard]
        return raw_rows if idx is None else idx[raw_rows]

    def _location(self, shard: int, raw_row: int) -> str:
        return f"{self._names[shard]}, row {raw_row}, column {self.column!r}"

    def _null_error(self, shard: int, raw_rows: np.ndarray, values: pa.Array) -> SourceError:
        bad = int(raw_rows[np.flatnonzero(values.is_null().to_numpy(zero_copy_only=False))[0]])
        return SourceError(f"{self._location(shard, bad)}: null, expected {'tokens' if self.pretokenized else 'text'}")

    def _null_id_error(self, shard: int, raw_rows: np.ndarray, offsets: np.ndarray, ids: pa.Array) -> SourceError:
        at = int(np.flatnonzero(ids.is_null().to_numpy(zero_copy_only=False))[0])
        k = int(np.searchsorted(offsets, at, side="right")) - 1
        return SourceError(f"{self._location(shard, int(raw_rows[k]))}: a null token id at position "
                           f"{at - int(offsets[k])}, expected an id in [0, 2^31)")

    def _read_raw(self, shard: int, raw_rows: np.ndarray) -> Iterator[RawDocument]:
        if not len(raw_rows):
            return
        values = self._columns[shard].take(pa.array(self._table_rows(shard, raw_rows))).combine_chunks()
        if values.null_count:
            raise self._null_error(shard, raw_rows, values)
        if not self.pretokenized:
            yield from values.to_pylist()
            return
        if pa.types.is_fixed_size_list(values.type):
            flat_ids = values.flatten()
            width = values.type.list_size
            offsets = np.arange(len(values) + 1, dtype=np.int64) * width
            if flat_ids.null_count:
                raise self._null_id_error(shard, raw_rows, offsets, flat_ids)
            flat = flat_ids.to_numpy(zero_copy_only=False)
        else:
            offsets = values.offsets.to_numpy(zero_copy_only=False).astype(np.int64)
            flat_ids = values.values.slice(int(offsets[0]), int(offsets[-1] - offsets[0]))
            offsets -= offsets[0]
            if flat_ids.null_count:  # a null inside a row: its value slot holds anything (0 or -2^31 once cast)
                raise self._null_id_error(shard, raw_rows, offsets, flat_ids)
            flat = flat_ids.to_numpy(zero_copy_only=False)
        for k, r in enumerate(raw_rows.tolist()):
            doc = flat[offsets[k] : offsets[k + 1]]
            if doc.size and (doc.min() < 0 or doc.max() > _I32):
                pos = int(np.flatnonzero((doc < 0) | (doc > _I32))[0])
                raise SourceError(f"{self._location(shard, r)}: token id {int(doc[pos])} at position {pos}, "
                                  "expected an id in [0, 2^31)")
            yield np.asarray(doc, dtype=np.int32)

    def _column_lengths(self, shard: int) -> np.ndarray:
        col = self._columns[shard]
        if self.pretokenized:
            lengths = pc.list_value_length(col)
        else:
            lengths = pc.binary_length(col)  # bytes: zero exactly where the text is empty
        idx = self._indices[shard]
        if lengths.null_count:
            nulls = lengths.is_null().to_numpy(zero_copy_only=False)
            bad = np.flatnonzero(nulls if idx is None else nulls[idx])
            if bad.size:
                raise SourceError(f"{self._location(shard, int(bad[0]))}: null, expected "
                                  f"{'tokens' if self.pretokenized else 'text'}")
            lengths = pc.fill_null(lengths, 0)  # null rows outside the index mapping are not rows of this shard
        out = lengths.to_numpy().astype(np.int64)
        return out if idx is None else out[idx]

    def _raw_lengths(self, shard: int) -> np.ndarray | None:
        return self._column_lengths(shard) if self.pretokenized else None

    def _empty_rows(self, shard: int) -> np.ndarray:
        return self._column_lengths(shard) == 0


def read_arrow_file(path: str, file=None) -> pa.Table:
    """An Arrow IPC file: the random-access file format, else the stream format (which `datasets` writes); anything
    else is an error naming `path`. Read by memory map, or from `file` (a seekable file-like object or pyarrow
    NativeFile) when given: the seam for storage other than local files."""
    try:
        source = pa.memory_map(path, "r") if file is None else file
    except OSError as e:
        raise SourceError(f"{path}: cannot be opened ({e})") from e
    try:
        return pa.ipc.open_file(source).read_all()
    except pa.ArrowInvalid:
        source.seek(0)
    try:
        return pa.ipc.open_stream(source).read_all()
    except (pa.ArrowInvalid, OSError) as e:
        raise SourceError(f"{path}: not a readable Arrow IPC file or stream ({e}); expected what pyarrow.ipc or "
                          "datasets writes") from e


def arrow_files_source(paths: Sequence[str], *, column: str | None = None, empty: str = "error") -> ArrowTableSource:
    """Arrow files as shards, one per file, in the order given."""
    shards = []
    for p in paths:
        if os.path.getsize(p) == 0:
            raise SourceError(f"{p}: an empty file (0 bytes), expected an Arrow IPC file or stream")
        shards.append((p, read_arrow_file(p), None))
    return ArrowTableSource(shards, column=column, empty=empty)
