"""Whole rows (dicts of fields) from every kind of input packloader reads, for the SFT source (`sft.py`).

Conversations and prompt/completion pairs are structured rows, not one text or token column, so the SFT source
reads rows whole: JSONL files (1-based line numbers in errors, compressed files too), Parquet files (0-based
rows, one row group decoded at a time), Arrow files, MDS directories and Megatron pairs, object-storage URLs of
JSONL, Parquet or MDS (`sft_stored_rows.py`), `datasets` `Dataset`s and `save_to_disk` folders, a
`pyarrow.Table`, and Python lists of dicts. A `datasets.IterableDataset` or a generator of dicts is read to its
end once, when the source opens, and kept in memory (the loader needs the epoch's length and random access for
exact resume), as packloader's other sources do with generators. Paths may be files, directories or globs
(`open.py`'s rules for which files). Every reader gives shards with random access by row, as `base.Source` does,
so order, resume and sharding stay the loader's.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Iterator, Sequence

import msgspec
import numpy as np
import pyarrow as pa

from packloader.sources.base import ShardInfo
from packloader.sources.errors import NonUtf8Error, SourceError
from packloader.sources.formats import format_of
from packloader.sources.sft_row_reader import RowReader


class ListRows(RowReader):
    def __init__(self, items: Sequence[Any], name: str) -> None:
        self._items = list(items)
        bad = next((i for i, r in enumerate(self._items) if not isinstance(r, dict)), None)
        if bad is not None:
            raise SourceError(f"{name}, row {bad}: {type(self._items[bad]).__name__}, expected a dict (a row)")
        self.shards = [ShardInfo(name, len(self._items))]

    def rows(self, shard, rows):
        return [self._items[int(r)] for r in rows]


class TableRows(RowReader):
    """Arrow tables as shards (a `pyarrow.Table`, Arrow files, a `Dataset` with its index mapping)."""

    def __init__(self, tables: list[tuple[str, pa.Table, np.ndarray | None]]) -> None:
        self._tables = tables
        self.shards = [ShardInfo(name, len(t) if m is None else len(m)) for name, t, m in tables]

    def rows(self, shard, rows):
        _, table, mapping = self._tables[shard]
        idx = np.asarray(rows, dtype=np.int64)
        return table.take(pa.array(idx if mapping is None else mapping[idx])).to_pylist()


class ParquetRows(RowReader):
    """Parquet files, one shard each; a call decodes only the row groups its rows are in."""

    def __init__(self, paths: list[str], raws: list[bytes] | None = None) -> None:
        import pyarrow.parquet as pq

        self._paths = paths
        self._raws = raws  # objects' bytes, fetched whole (remote files)
        self._local = threading.local()
        self._starts = []
        infos = []
        for i, p in enumerate(paths):
            try:
                meta = pq.ParquetFile(self._input(i)).metadata
            except Exception as e:  # noqa: BLE001 - pyarrow raises several kinds; the message names the file
                raise SourceError(f"{p}: not a readable Parquet file ({e})") from e
            sizes = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
            self._starts.append(np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64))
            infos.append(ShardInfo(p, int(meta.num_rows)))
        self.shards = infos

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k != "_local"}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._local = threading.local()

    def _input(self, shard: int):
        return self._paths[shard] if self._raws is None else pa.BufferReader(self._raws[shard])

    def _file(self, shard: int):
        import pyarrow.parquet as pq

        files = self._local.__dict__.setdefault("files", {})
        if shard not in files:
            files[shard] = pq.ParquetFile(self._input(shard))
        return files[shard]

    def rows(self, shard, rows):
        starts = self._starts[shard]
        idx = np.asarray(rows, dtype=np.int64)
        groups = np.searchsorted(starts, idx, side="right") - 1
        out: list = [None] * len(idx)
        for g in np.unique(groups).tolist():
            sel = np.flatnonzero(groups == g)
            table = self._file(shard).read_row_group(g)
            for i, row in zip(sel.tolist(), table.take(pa.array(idx[sel] - starts[g])).to_pylist()):
                out[i] = row
        return out


class JsonlRows(RowReader):
    """JSONL files, one shard each, indexed by line (blank lines skipped); errors give the 1-based line."""

    def __init__(self, paths: list[str], raws: list[bytes] | None = None) -> None:
        from packloader.sources.jsonl import line_index, load_bytes

        self._paths = paths
        self._data = [load_bytes(p, None if raws is None else raws[i]) for i, p in enumerate(paths)]
        self._index = [line_index(b) for b in self._data]
        self.shards = [ShardInfo(p, len(ix[0])) for p, ix in zip(paths, self._index)]

    def location(self, shard, row):
        return f"{self._paths[shard]}, line {int(self._index[shard][2][row])}"

    def rows(self, shard, rows):
        starts, ends, _ = self._index[shard]
        out = []
        for r in rows:
            r = int(r)
            line = self._data[shard][int(starts[r]) : int(ends[r])]
            try:
                line.decode("utf-8")  # told apart from bad JSON here: msgspec reports both as DecodeError
            except UnicodeDecodeError as e:
                raise NonUtf8Error(f"{self.location(shard, r)}: text is not valid UTF-8 ({e})") from e
            try:
                obj = msgspec.json.decode(line)
            except msgspec.DecodeError as e:
                raise SourceError(f"{self.location(shard, r)}: not valid JSON ({e})") from e
            if not isinstance(obj, dict):
                raise SourceError(f"{self.location(shard, r)}: {type(obj).__name__}, expected a JSON object (a row)")
            out.append(obj)
        return out


def remote_rows(data) -> RowReader | None:
    """Rows from object storage, or None when `data` names no remote object."""
    from packloader.sources.remote_open import _expand, _format, _mds_directory
    from packloader.sources.storage import StoragePaths, default_storage, is_remote

    if isinstance(data, StoragePaths):
        storage, paths = data.storage, data.paths
    elif isinstance(data, str) and is_remote(data):
        storage, paths = default_storage(), [data]
    elif isinstance(data, (list, tuple)) and data and all(isinstance(p, str) and is_remote(p) for p in data):
        storage, paths = default_storage(), list(data)
    else:
        return None
    mds = _mds_directory(paths, storage, None)
    if mds is not None:
        from packloader.sources.sft_stored_rows import MdsRows

        return MdsRows(mds, storage=storage)
    files = sorted(_expand(paths, storage))
    kinds = {_format(f) for f in files}
    if kinds not in ({"jsonl"}, {"parquet"}):
        raise SourceError(f"{files[:3]}: expected JSONL or Parquet objects of one kind (or one MDS prefix), found "
                          f"{sorted(map(str, kinds))}")
    raws = [storage.open(storage.head(f)).readall() for f in files]
    return JsonlRows(files, raws) if kinds == {"jsonl"} else ParquetRows(files, raws)


def _paths_of(spec) -> list[str]:
    from packloader.sources.open import _expand, _files_under

    paths = [str(spec)] if isinstance(spec, (str, os.PathLike)) else [str(p) for p in spec]
    out = []
    for p in _expand(paths):
        out.extend(sorted(f for f in _files_under(p) if format_of(f) or f.endswith(".arrow")) if os.path.isdir(p)
                   else [p])
    return sorted(out)


def open_rows(data, *, name: str | None = None) -> RowReader:
    """A RowReader for `data`: paths (files, directories, globs, MDS folders, Megatron prefixes), object-storage URLs
    or `StoragePaths`, a datasets Dataset (or a one-split DatasetDict, or a save_to_disk folder), a pyarrow.Table,
    or a list of dicts."""
    from packloader.sources.hf_datasets import dataset_name, is_datasets_object, is_disk_folder

    if isinstance(data, RowReader):
        return data
    if isinstance(data, pa.Table):
        return TableRows([(name or f"<pyarrow.Table of {len(data)} rows>", data, None)])
    if is_datasets_object(data):
        import datasets

        if isinstance(data, datasets.DatasetDict):
            if len(data) != 1:
                raise SourceError(f"a DatasetDict with splits {list(data)}: pass one split, e.g. dd[{list(data)[0]!r}]")
            data = data[list(data)[0]]
        if isinstance(data, datasets.IterableDataset):  # read to its end once, kept in memory (as generators)
            rows = list(data)
            return ListRows(rows, name or f"<datasets.IterableDataset of {len(rows)} rows>")
        if not isinstance(data, datasets.Dataset):
            raise SourceError(f"{type(data).__name__}: expected a datasets.Dataset, IterableDataset or DatasetDict")
        idx = data._indices
        mapping = None if idx is None else np.asarray(idx.column(0).to_numpy(), dtype=np.int64)
        return TableRows([(name or dataset_name(data), data.data.table, mapping)])
    if isinstance(data, Iterator):  # a generator of rows: read to its end once, kept in memory
        data = list(data)
        name = name or f"<generator of {len(data)} rows>"
    if isinstance(data, (list, tuple)) and data and all(isinstance(r, dict) for r in data):
        return ListRows(data, name or f"<list of {len(data)} rows>")
    if isinstance(data, (str, os.PathLike)) and is_disk_folder(str(data)):
        import datasets

        return open_rows(datasets.load_from_disk(str(data)), name=str(data))
    from packloader.sources.sft_stored_rows import MdsRows, MegatronRows, is_megatron_spec

    if isinstance(data, (str, os.PathLike)) and os.path.isfile(os.path.join(str(data), "index.json")):
        return MdsRows(str(data))
    remote = remote_rows(data)
    if remote is not None:
        return remote
    if is_megatron_spec(data):
        return MegatronRows([str(data)] if isinstance(data, (str, os.PathLike)) else list(data))
    if isinstance(data, (str, os.PathLike, list, tuple)) and data:
        paths = _paths_of(data)
        kinds = {format_of(p) or ("arrow" if p.endswith(".arrow") else None) for p in paths}
        if kinds == {"jsonl"}:
            return JsonlRows(paths)
        if kinds == {"parquet"}:
            return ParquetRows(paths)
        if kinds == {"arrow"}:
            from packloader.sources.arrow_table import read_arrow_file

            return TableRows([(p, read_arrow_file(p), None) for p in paths])
        raise SourceError(f"{paths[:3]}: expected JSONL, Parquet or Arrow files of one kind, found {sorted(map(str, kinds))}")
    raise SourceError(f"{type(data).__name__}: expected paths, a datasets.Dataset, a pyarrow.Table or a list of dicts")
