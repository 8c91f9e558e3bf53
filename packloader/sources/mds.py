"""MDS directories written by mosaicml-streaming's `MDSWriter` (optional extra `mds`), local or in object storage.

The shards are read through streaming's own `MDSReader` (built from `index.json` by `reader_from_json`) for the
shard metadata and its `mds_decode` for the column encoding, but not through `StreamingDataset`: no shared memory
in /dev/shm (nothing left behind by a crashed run), no `RANK`/`WORLD_SIZE` environment variables read, no process
group created, and order, sharding and resume stay with packloader's loader.

Each `index.json` shard is one packloader shard. An uncompressed shard file is read whole into memory (never
memory-mapped: a mapped file truncated by another process kills the reader with SIGBUS); a compressed one
(`compression="zstd"` etc., only the `.zstd` file present) is decompressed whole into memory; either is read when
first needed and the most recent ones are kept up to `cache_bytes`. Only the chosen column of a sample is decoded, so a `pkl` column next
to it is never unpickled. The text column must have the `str` encoding; a token column an integer `ndarray`
encoding such as `ndarray:int32`.

An MDS directory in object storage (`s3://bucket/mds/`, gs://, Azure, `Storage(filesystem=fs).paths(...)`) is read
through packloader's own ranged reads and block caches, not streaming's `remote=`/`local=` download: that copies
whole shards into a local directory shared through /dev/shm by a `StreamingDataset`, which would take over order,
sharding and resume (the loader's job), and it neither pins a shard to the version indexed nor bounds its retries
in time. Here index.json and each shard are fetched when first needed, every request tied to the ETag (or
generation) seen when the source opened, retried within `RetryPolicy`, and kept in the optional disk cache
bounded in bytes (`Storage(cache_dir=..., cache_bytes=...)`), so later epochs and restarts read it from disk.

`import streaming` costs a few seconds (it imports torchvision and transformers); it happens when an MdsSource is
built, never at `import packloader`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterator

import numpy as np

from packloader.sources.base import RawDocument
from packloader.sources.errors import NonUtf8Error, SourceError
from packloader.sources.format_registry import default_column
from packloader.sources.identity import file_identity
from packloader.sources.reader import LruCache, ShardedSource
from packloader.sources.storage import RemoteWatch, resolve


def _streaming():
    try:
        from streaming.base.compression import decompress
        from streaming.base.format import reader_from_json
        from streaming.base.format.mds.encodings import mds_decode
    except ImportError as e:
        raise ImportError(
            "reading MDS shards needs mosaicml-streaming: pip install 'packloader[mds]' "
            f"(import failed: {e})"
        ) from e
    return reader_from_json, mds_decode, decompress


class MdsSource(ShardedSource):
    """A local MDS directory (the one holding index.json). `column=None` picks text, content, tokens, input_ids."""

    def __init__(
        self,
        directory: str | Path,
        *,
        column: str | None = None,
        empty: str = "error",
        cache_bytes: int = 1 << 30,
        storage=None,
    ) -> None:
        super().__init__(empty=empty)
        self.directory = str(directory).rstrip("/") if "://" in str(directory) else str(directory)
        self.cache_bytes = int(cache_bytes)
        self._where = resolve(self.directory, storage)  # None: a local directory
        self._objects: set[str] = set()
        index_path = self._join("index.json")
        try:
            index = json.loads(self._index_bytes(index_path))
            shard_objs = index["shards"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
            raise SourceError(f"{index_path}: not an MDS index ({e!r})") from e
        if not shard_objs:
            raise SourceError(f"{index_path}: the index lists no shards")
        reader_from_json, self._mds_decode, self._decompress = _streaming()
        self._readers = []
        self.column = column
        self._pretokenized: bool | None = None
        for k, obj in enumerate(shard_objs):
            if obj.get("format") != "mds":
                raise SourceError(f"{index_path}: shard {k} has format {obj.get('format')!r}, expected 'mds'")
            try:
                reader = reader_from_json(self.directory, None, obj)
            except Exception as e:  # noqa: BLE001 - streaming raises AssertionError/ValueError/TypeError
                raise SourceError(f"{index_path}: shard {k} cannot be described ({e!r})") from e
            self._readers.append(reader)
            self._check_column(k, reader)
        self._col = [r.column_names.index(self.column) for r in self._readers]
        names = [self._display_name(k) for k in range(len(self._readers))]
        # content identities (sources/identity.py) for the saved state and the ranks' start-up check; a remote
        # shard's watch also pins every read to the object version opened (ETag / generation)
        self._watches = {n: RemoteWatch(n, "mds", self._where) for n in names if self._exists(n)} if self._where else {}
        self.identities = ([self._watches[n].identity if n in self._watches else None for n in names] if self._where
                           else [file_identity(n) if os.path.exists(n) else None for n in names])
        self._open_shards(names, [r.samples for r in self._readers])

    def _join(self, name: str) -> str:
        return f"{self.directory}/{name}" if self._where is not None else os.path.join(self.directory, name)

    def _exists(self, path: str) -> bool:
        return path in self._objects if self._where is not None else os.path.exists(path)

    def _index_bytes(self, index_path: str) -> bytes:
        """index.json's bytes; for a remote directory, the listing of its objects is taken once here."""
        if self._where is None:
            if not os.path.exists(index_path):
                raise FileNotFoundError(f"MDS index not found: {index_path}")
            return Path(index_path).read_bytes()
        self._objects = set(self._where.listing(self.directory + "/"))
        if index_path not in self._objects:
            raise FileNotFoundError(f"MDS index not found: {index_path} (no such object)")
        return self._where.open(self._where.head(index_path)).readall()

    def _read_bytes(self, path: str) -> bytes:
        """A whole shard file: a local read, or the object by ranged reads through the storage's block caches."""
        if self._where is None:
            return Path(path).read_bytes()  # never a memory map: a mapped file truncated by a writer is SIGBUS
        watch = self._watches[path]
        return self._where.open(watch.info).readall()

    @property
    def pretokenized(self) -> bool:
        return bool(self._pretokenized)

    def _shard_path(self, k: int) -> str:
        return self._join(self._readers[k].raw_data.basename)

    def _display_name(self, k: int) -> str:
        """The file that holds shard k: the raw .mds file, or the compressed one when only that exists."""
        raw, zipped = self._shard_path(k), self._readers[k].zip_data
        if self._exists(raw) or zipped is None:
            return raw
        return self._join(zipped.basename)

    def _check_column(self, k: int, reader) -> None:
        where = self._join(reader.raw_data.basename)
        names = list(reader.column_names)
        if self.column is None:
            encodings = dict(zip(names, reader.column_encodings))
            self.column = default_column(
                where, names,
                lambda c: "text" if encodings[c] == "str" else "tokens" if encodings[c].startswith("ndarray") else "",
                none_found=f"{where}: no text or token column among {names}; pass column=...")
        if self.column not in names:
            raise SourceError(f"{where}: no column {self.column!r}; the shard has columns {names}")
        encoding = reader.column_encodings[names.index(self.column)]
        if encoding == "str":
            kind = False
        elif encoding.split(":")[0] == "ndarray" and (":" not in encoding or "int" in encoding.split(":")[1]):
            kind = True
        else:
            raise SourceError(
                f"{where}, column {self.column!r}: encoding {encoding!r}, expected 'str' (text) or an integer "
                "ndarray such as 'ndarray:int32' (tokens)"
            )
        if self._pretokenized is None:
            self._pretokenized = kind
        elif kind != self._pretokenized:
            raise SourceError(f"{where}, column {self.column!r}: encoding {encoding!r} disagrees with earlier shards")

    # --- bytes of a shard ------------------------------------------------------------------------------------------

    def _data(self, k: int):
        """(buffer, offsets) of shard k: the sample offsets table sits at the start of every MDS shard file."""
        held = self._process_cache().setdefault("shards", LruCache(max_bytes=self.cache_bytes, max_items=64))
        hit = held.get(k)
        if hit is not None:
            return hit
        reader = self._readers[k]
        raw = self._shard_path(k)
        if self._exists(raw):
            buf = self._read_bytes(raw)
        elif reader.zip_data is not None and self._exists(self._join(reader.zip_data.basename)):
            zpath = self._join(reader.zip_data.basename)
            try:
                buf = self._decompress(reader.compression, self._read_bytes(zpath))
            except Exception as e:  # noqa: BLE001 - any codec error means a corrupt shard
                raise SourceError(f"{zpath}: cannot be decompressed as {reader.compression} ({e!r})") from e
        else:
            raise FileNotFoundError(f"MDS shard not found: {raw}")
        n = reader.samples
        if len(buf) < 4 * (n + 2):
            raise SourceError(f"{raw}: truncated MDS shard ({len(buf)} bytes for {n} samples)")
        offsets = np.frombuffer(buf, np.uint32, count=n + 1, offset=4).astype(np.int64)
        if np.frombuffer(buf, np.uint32, count=1)[0] != n or offsets[-1] > len(buf) or np.any(np.diff(offsets) < 0):
            raise SourceError(f"{raw}: corrupt MDS shard (its offset table does not match {n} samples)")
        return held.put(k, (buf, offsets), len(buf))

    def _decode(self, k: int, raw_row: int, buf, offsets) -> RawDocument:
        reader = self._readers[k]
        data = buf[int(offsets[raw_row]) : int(offsets[raw_row + 1])]
        # The sample layout (streaming's MDSReader.decode_sample): a uint32 size for each variable-size column,
        # then the columns' bytes in order. Only the chosen column is decoded.
        col = self._col[k]
        sizes, pos = [], 0
        for size in reader.column_sizes:
            if size is None:
                size = int(np.frombuffer(data, np.uint32, count=1, offset=pos)[0])
                pos += 4
            sizes.append(size)
        start = pos + sum(sizes[:col])
        where = f"{self._location(k, raw_row)}, column {self.column!r}"
        if start + sizes[col] > len(data):
            raise SourceError(f"{where}: corrupt sample (the column runs past the sample's end)")
        encoding = reader.column_encodings[col]
        try:
            value = self._mds_decode(encoding, data[start : start + sizes[col]])
        except UnicodeDecodeError as e:
            raise NonUtf8Error(f"{where}: text is not valid UTF-8 ({e})") from e
        except Exception as e:  # noqa: BLE001
            raise SourceError(f"{where}: cannot decode {encoding!r} ({e!r})") from e
        if not self._pretokenized:
            return value
        value = np.asarray(value).reshape(-1)
        if value.dtype.kind not in "iu":
            raise SourceError(f"{where}: dtype {value.dtype}, expected integers")
        if value.dtype != np.int32 and value.size and (value.min() < 0 or value.max() > np.iinfo(np.int32).max):
            raise SourceError(f"{where}: token ids do not fit int32")
        return np.array(value, dtype=np.int32)  # a writable copy, like every other source's

    def _read_raw(self, shard: int, raw_rows: np.ndarray) -> Iterator[RawDocument]:
        buf, offsets = self._data(shard)
        for r in raw_rows.tolist():
            yield self._decode(shard, r, buf, offsets)

    def _empty_rows(self, shard: int) -> np.ndarray:
        buf, offsets = self._data(shard)
        return np.array([len(self._decode(shard, r, buf, offsets)) == 0 for r in range(len(offsets) - 1)], dtype=bool)
