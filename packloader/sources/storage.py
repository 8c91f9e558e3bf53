"""The storage seam of the file readers: a shard path is a local file or an object URL, and the readers (Parquet,
JSONL) open, identify and watch it through these functions, taking a file-like object rather than a local path.

`Storage` names where objects live: s3:// URLs through boto3 and the AWS settings by default, gs:// and Azure
(az://, abfs://) through the vendors' clients and settings (`remote_cloud.py`), http(s):// shard URLs by ranged
GETs (`remote_http.py`), another scheme (hf:// through huggingface_hub's HfFileSystem) through the fsspec
filesystem installed for it, or a filesystem object the caller passes
(`Storage(filesystem=...)`: pyarrow.fs or fsspec). Options: block size of the ranged reads, an optional local
block cache bounded in bytes (also from `PACKLOADER_CACHE_DIR` and `PACKLOADER_CACHE_BYTES`) behind a small in-memory one, the retry
policy; whether shards' length indexes are used, also built where missing, or ignored (`index`, `index_dir`:
`length_index.py`); how many ranged reads of pages run at once, and how many bytes (`fetch_threads`,
`read_ahead_bytes`: `parquet_ranged.py`), and below what gap between two runs of wanted pages one read spans
both (`merge_gap_bytes`).
"""

from __future__ import annotations

import hashlib
import os
import struct

from packloader.sources.errors import SourceError
from packloader.sources.identity import FileWatch, sampled_digest
from packloader.sources.remote import FsStore, ObjectInfo, RemoteFile, RetryPolicy, S3Store
from packloader.sources.remote_cache import BlockCache, MemoryBlocks
from packloader.sources.remote_cloud import AZURE_SCHEMES, GCS_SCHEMES, AzureStore, GcsStore
from packloader.sources.remote_http import HTTP_SCHEMES, HttpStore
from packloader.sources.storage_options import cache_from_env, check_storage_options
from packloader.sources.unsupported import UnsupportedSourceError, url_scheme

S3_SCHEMES = ("s3", "s3a")
MERGE_GAP_BYTES = 1 << 20  # gaps up to 1 MiB spanned, within parquet_ranged.MERGE_SHARE (docs/object-storage.md)


class StoragePaths:
    """Paths (objects, prefixes or globs) inside one `Storage`: what `open_source` and `PackedLoader` take for a
    filesystem object, e.g. `Storage(filesystem=pyarrow.fs.S3FileSystem(...)).paths("bucket/shards/*.parquet")`."""

    def __init__(self, storage: Storage, paths: list[str]) -> None:
        self.storage, self.paths = storage, [str(p) for p in paths]

    def __repr__(self) -> str:
        return f"StoragePaths({self.paths!r})"



class Storage:
    """Where remote shards are read from, and how (block size, local cache, retries)."""

    def __init__(self, filesystem=None, *, block_size: int = 4 << 20, cache_dir: str | None = None,
                 cache_bytes: int = 0, retry: RetryPolicy | None = None, endpoint_url: str | None = None,
                 memory_bytes: int = 64 << 20, index: str = "use", index_dir: str | None = None,
                 fetch_threads: int = 8, read_ahead_bytes: int = 64 << 20,
                 merge_gap_bytes: int = MERGE_GAP_BYTES) -> None:
        self.filesystem = filesystem
        check_storage_options(block_size=block_size, cache_dir=cache_dir, cache_bytes=cache_bytes, index_dir=index_dir)
        if int(merge_gap_bytes) < 0:
            raise ValueError(f"merge_gap_bytes must be >= 0, got {merge_gap_bytes}")
        self.merge_gap_bytes = int(merge_gap_bytes)
        if int(fetch_threads) < 1 or int(read_ahead_bytes) < 1:
            raise ValueError(f"fetch_threads and read_ahead_bytes must be >= 1, got {fetch_threads} and "
                             f"{read_ahead_bytes}")
        self.fetch_threads, self.read_ahead_bytes = int(fetch_threads), int(read_ahead_bytes)
        if index not in ("use", "build", "off"):
            raise ValueError(f"index must be 'use', 'build' or 'off', got {index!r}")
        self.index, self.index_dir = index, index_dir
        if int(block_size) < 0:
            raise ValueError(f"block_size must be >= 0 (0: exact ranges), got {block_size}")
        self.block_size = int(block_size)
        self.retry = retry or RetryPolicy()
        self.cache = BlockCache(cache_dir, cache_bytes) if cache_dir and cache_bytes else None
        self.blocks = MemoryBlocks(memory_bytes, self.cache)  # recent blocks in memory, then the disk cache
        self._s3 = S3Store(self.retry, endpoint_url)
        self._fs: dict = {}  # an FsStore by scheme; GcsStore, AzureStore, HttpStore by class name

    def store(self, url: str):
        if self.filesystem is not None:
            if "" not in self._fs:
                self._fs[""] = FsStore(self.filesystem, self.retry)
            return self._fs[""]
        scheme = url_scheme(url)
        if scheme in S3_SCHEMES:
            return self._s3
        own = {**dict.fromkeys(GCS_SCHEMES, GcsStore), **dict.fromkeys(AZURE_SCHEMES, AzureStore),
               **dict.fromkeys(HTTP_SCHEMES, HttpStore)}.get(scheme)
        if own is not None:
            if own.__name__ not in self._fs:
                self._fs[own.__name__] = own(self.retry)
            return self._fs[own.__name__]
        if scheme not in self._fs:
            try:
                import fsspec

                fs = fsspec.filesystem(scheme)
            except (ImportError, ValueError) as e:
                raise UnsupportedSourceError(
                    f"{url}: no filesystem for {scheme}:// is installed ({e}); install its fsspec package (gcsfs for "
                    "gs://, adlfs for az://) or pass a configured one: Storage(filesystem=fs)"
                ) from e
            self._fs[scheme] = FsStore(fs, self.retry)
        return self._fs[scheme]

    @property
    def bytes_read(self) -> int:
        return self._s3.bytes_read + sum(s.bytes_read for s in self._fs.values())

    @property
    def requests(self) -> int:
        return self._s3.requests + sum(s.requests for s in self._fs.values())

    def paths(self, *paths: str) -> StoragePaths:
        """Objects, prefixes or globs in this storage, to pass as a source."""
        return StoragePaths(self, list(paths))

    def head(self, url: str) -> ObjectInfo:
        return self.store(url).head(url)

    def open(self, info: ObjectInfo) -> RemoteFile:
        return RemoteFile(self.store(info.url), info, self.block_size, self.blocks)

    def listing(self, url: str) -> list[str]:
        return self.store(url).listing(url)


_DEFAULT: dict[int, Storage] = {}


def default_storage() -> Storage:
    """The process's storage for URLs given without one (the AWS settings; cache from the environment)."""
    pid = os.getpid()
    if pid not in _DEFAULT:
        cache_dir, cache_bytes = cache_from_env()
        _DEFAULT[pid] = Storage(cache_dir=cache_dir, cache_bytes=cache_bytes)
    return _DEFAULT[pid]


def is_remote(path: str, storage: Storage | None = None) -> bool:
    return (storage is not None and storage.filesystem is not None) or url_scheme(str(path)) is not None


def resolve(path: str, storage: Storage | None) -> Storage | None:
    """The storage a shard is read from, None for a local file."""
    if not is_remote(path, storage):
        return None
    return storage if storage is not None else default_storage()


def _footer(f: RemoteFile) -> bytes:
    size = f.size()
    tail = f.pread(8, size - 8) if size >= 12 else b""
    n = struct.unpack("<i", tail[:4])[0] if len(tail) == 8 else 0
    if tail[4:] != b"PAR1" or not 0 < n <= size - 12:
        raise SourceError(f"{f.name}: not a readable Parquet file (no footer at its end)")
    return f.pread(n, size - 8 - n)


class RemoteWatch:
    """A remote shard's identity (size, ETag and, for Parquet, a hash of its footer) taken when the source opened
    it. `check()` costs nothing: every read carries the ETag (If-Match), so a replaced object fails the read."""

    def __init__(self, path: str, kind: str, storage: Storage) -> None:
        self.path, self.storage = path, storage
        self.info = storage.head(path)
        ident = f"{self.info.size}:{self.info.etag.strip(chr(34))}"
        self.footer = b""  # a Parquet object's footer, parsed once by the source (not fetched again)
        if kind == "parquet":
            self.footer = footer = _footer(storage.open(self.info))
            ident += ":" + hashlib.blake2b(footer, digest_size=12).hexdigest()
        if not self.info.etag:  # no version from the store: the content itself, as a local file is identified
            ident += ":" + sampled_digest(storage.open(self.info).pread, self.info.size)
        self.identity = ident

    def check(self) -> None:
        return None


def watch_shard(path: str, kind: str, identify, storage: Storage | None, missing: str):
    """The watch of a shard: `FileWatch` for a local file (FileNotFoundError `missing` when absent), else a
    `RemoteWatch` (an `ObjectMissing` error naming the URL when absent)."""
    where = resolve(path, storage)
    if where is None:
        if not os.path.exists(path):
            raise FileNotFoundError(f"{missing}: {path}")
        return FileWatch(path, identify)
    return RemoteWatch(path, kind, where)


def open_shard(path: str, watch, storage: Storage | None):
    """A file-like object to read the shard (an unbuffered local file, or a `RemoteFile`)."""
    if isinstance(watch, RemoteWatch):
        return watch.storage.open(watch.info)
    return open(path, "rb", buffering=0)


def pread(f, n: int, offset: int) -> bytes:
    """`n` bytes at `offset` of a local file or a `RemoteFile`, leaving its position alone."""
    if isinstance(f, RemoteFile):
        return f.pread(n, offset)
    return os.pread(f.fileno(), n, offset)
