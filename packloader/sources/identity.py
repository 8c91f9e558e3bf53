"""What a shard is, by content, cheaply: the identity a saved state and the other ranks compare a shard by.

A shard's name and row count say little (a shard rewritten under the same name with as many rows is a different
shard), and hashing every byte of a terabyte corpus at every start is too slow. So:

- Parquet: the file's size and a hash of its footer (the serialized FileMetaData: schema and key-value metadata,
  every row group's row count, byte offsets and compressed sizes, and the column statistics the writer kept). Any
  rewrite that changes one compressed page's size, a min/max statistic or the metadata changes it; `packloader
  tokenize` also records a digest of every token it wrote (`packloader.tokens_blake2b`), so for its shards the
  footer hash covers the tokens themselves. A change inside page data that keeps every size and statistic is
  caught by the page checksums on read, where the file has them.
- A directory of text files: each shard (a group of files) by its files' relative names and sizes.
- Any other file (JSONL, compressed JSONL, MDS shards): its size and a hash of its first and last
  1 MiB and of 16 blocks of 64 KiB spread evenly between (the whole file when it is at most 4 MiB). Every change of
  size, of the head or the tail (a rewritten or appended JSONL's first or last lines) is caught; an edit of the
  same size that falls only between the sampled blocks of a file over 4 MiB is not.

A remote object is known by its size and the version its store gives (ETag, generation, modification time), plus
its footer hash for Parquet; an object whose store gives no version (an http(s) server without ETag or
Last-Modified) is hashed as a local file of its kind is (sampled blocks, footer) and never served from the disk
block cache, which could only key it by name and size.
The identity is computed when a source opens its shards and is kept by the source, so a file replaced later is
compared against what was actually indexed (`ShardChanged` names the file).
"""

from __future__ import annotations

import hashlib
import os
import struct

from packloader.sources.errors import SourceError

_HEAD = 1 << 20
_BLOCK = 64 << 10
_BLOCKS = 16
_WHOLE = 4 << 20


class ShardChanged(SourceError):
    """A shard whose bytes are not the ones the source indexed when it opened (rewritten, truncated, replaced)."""


def _digest(parts) -> str:
    h = hashlib.blake2b(digest_size=12)
    for p in parts:
        h.update(p)
    return h.hexdigest()


def parquet_identity(path: str) -> str:
    """`size:footer-hash` of a Parquet file (the footer is its last 8 + footer-length bytes)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 12:
            raise SourceError(f"{path}: not a readable Parquet file ({size} bytes)")
        f.seek(size - 8)
        tail = f.read(8)
        (n,) = struct.unpack("<i", tail[:4])
        if tail[4:] != b"PAR1" or not 0 < n <= size - 12:
            raise SourceError(f"{path}: not a readable Parquet file (no footer at its end)")
        f.seek(size - 8 - n)
        footer = f.read(n)
    return f"{size}:{_digest([footer])}"


def sampled_digest(pread, size: int) -> str:
    """The hash of a file's head, tail and evenly spread blocks (the whole file when small), its bytes read by
    `pread(n, offset)`: a local file's, or a remote object's that has no version of its own."""
    if size <= _WHOLE:
        return _digest([pread(size, 0)])
    step = (size - 2 * _HEAD) // (_BLOCKS + 1)
    offsets = [0] + [_HEAD + step * (k + 1) for k in range(_BLOCKS)] + [size - _HEAD]
    sizes = [_HEAD] + [_BLOCK] * _BLOCKS + [_HEAD]
    return _digest([pread(n, off) for off, n in zip(offsets, sizes)])


def file_identity(path: str) -> str:
    """`size:hash` of a file's head, tail and evenly spread blocks (the whole file when small)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        return f"{size}:{sampled_digest(lambda n, off: os.pread(f.fileno(), n, off), size)}"


def file_set_identity(names, sizes) -> str:
    """`files:hash` of a group of files' relative names and sizes (a shard of a directory of text files): a file
    added, removed, renamed or resized changes it; an edit of the same size does not."""
    parts = [f"{n}\0{int(z)}\0".encode() for n, z in zip(names, sizes)]
    return f"{len(parts)} files:{_digest(parts)}"


def shard_identity(source, shard: int) -> str | None:
    """The content identity a source recorded for one of its shards, or None for sources that have none (in-memory
    data, third-party `Source`s): those are known by name and row count only."""
    ids = getattr(source, "identities", None)
    if ids is None:
        return None
    return ids[shard]


def shard_fingerprints(source) -> dict[str, str]:
    """{shard path under the shards' common directory: "N rows" or "N rows, identity"}, in shard order."""
    names = [str(s.name) for s in source.shards]
    try:
        common = os.path.commonpath(names) if len(names) > 1 else os.path.dirname(names[0])
    except ValueError:  # absolute beside relative paths, or labels that are not paths
        common = ""
    out = {}
    for k, s in enumerate(source.shards):
        name = os.path.relpath(str(s.name), common) if common else str(s.name)
        ident = shard_identity(source, k)
        out[name] = f"{s.num_rows} rows" + (f", {ident}" if ident is not None else "")
    return out


def changed(path: str, why: str) -> ShardChanged:
    return ShardChanged(
        f"{path}: the file changed since the source opened it ({why}); another process rewrote, truncated or replaced "
        "it. Reading on would train other documents than those indexed: reopen the source on shards no one writes"
    )


def _stat_key(st: os.stat_result) -> tuple[int, int, int, int]:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


class FileWatch:
    """A shard's identity when its source opened it, and the cheap check that the file is still that one.

    `check()` costs one `stat`; only when the inode, size or modification time moved is the content identity
    computed again (a `touch` or a copy of the same bytes passes). Readers call it after each read, so bytes read
    from a file that another process rewrote meanwhile are never used. Reads are plain reads, never memory maps: a
    mapped file truncated by another process kills the reader with SIGBUS, which Python cannot catch."""

    def __init__(self, path: str, identify) -> None:
        self.path, self._identify = path, identify
        try:
            self._key = _stat_key(os.stat(path))
        except FileNotFoundError as e:
            raise FileNotFoundError(f"shard not found: {path}") from e
        self.identity: str = identify(path)
        self.check()  # the identity was taken from the file the stat saw

    def check(self) -> None:
        try:
            key = _stat_key(os.stat(self.path))
        except FileNotFoundError:
            raise changed(self.path, "it was deleted or renamed") from None
        if key == self._key:
            return
        try:
            now = self._identify(self.path)
        except (OSError, SourceError) as e:
            raise changed(self.path, f"it can no longer be identified: {e}") from e
        if now != self.identity:
            raise changed(self.path, f"identity {self.identity}, now {now}: size and content hash")
        self._key = key
