"""A shard's length index: every document's length, and for each row group the data pages of its token column
(file offset, bytes, ids, first row). Every rank plans from the lengths alone and then fetches only the pages of
the documents it trains, whatever the row-group size. `packloader tokenize` writes one beside each shard
(`_part-00000.parquet.index`: the leading underscore keeps it out of listings and globs of shards); for a shard
without one, `Storage(index="build")` builds it once (one full read) and keeps it in a local directory. An index is
keyed by its shard's content identity (size and footer hash, as `identity.py` identifies Parquet files, the same
for a local file and its uploaded copy), so a rewritten shard never uses a stale one; its bytes carry their own
hash, so a corrupt index is an error naming it rather than wrong document boundaries."""

from __future__ import annotations

import hashlib
import logging
import os

import msgspec
import numpy as np
import pyarrow as pa

from packloader.sources.errors import SourceError
from packloader.sources.parquet_pages import PageError, Unpageable, layout, scan_chunk, token_leaf
from packloader.sources.remote import AccessDenied

log = logging.getLogger("packloader")
MAGIC = b"PKLIDX1\n"
VERSION = 1


class LengthIndexError(SourceError):
    """A length index that is corrupt or belongs to another shard."""


class LengthIndex(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What crosses from `tokenize` (or the first reader) to every rank: msgpack, zstd, hash-checked."""

    version: int
    identity: str  # "size:footer-hash" of the shard it describes
    column: str
    group_rows: list[int]
    layouts: list[tuple[str, str, int, int]]  # per row group: compression, physical type, max rep, max def levels
    lengths: bytes  # int64 per row
    pages: list[bytes]  # per row group: int64 (offset, bytes, ids, first row) per data page
    # per row group: int64 (header bytes, uncompressed bytes, CRC or -1, page type) per data page, so a local
    # reader decodes a whole chunk without parsing page headers (`parquet_chunk.py`); empty in older indexes
    bodies: list[bytes] = []

    def length_array(self) -> np.ndarray:
        return np.frombuffer(self.lengths, dtype="<i8")

    def page_array(self, group: int) -> np.ndarray:
        return np.frombuffer(self.pages[group], dtype="<i8").reshape(-1, 4)

    def body_array(self, group: int) -> np.ndarray | None:
        return np.frombuffer(self.bodies[group], dtype="<i8").reshape(-1, 4) if self.bodies else None


def content_identity(size: int, footer: bytes) -> str:
    """The shard's identity as `identity.parquet_identity` computes it for a local file."""
    return f"{int(size)}:{hashlib.blake2b(footer, digest_size=12).hexdigest()}"


def index_name(shard: str) -> str:
    """Where the index of `shard` sits beside it."""
    head, _, base = shard.rpartition("/")
    return f"{head}/_{base}.index" if head else f"_{base}.index"


def encode(index: LengthIndex) -> bytes:
    raw = msgspec.msgpack.encode(index)
    body = len(raw).to_bytes(8, "little") + pa.compress(raw, codec="zstd", asbytes=True)
    return MAGIC + hashlib.blake2b(body, digest_size=16).digest() + body


def decode(data: bytes, where: str) -> LengthIndex:
    """The index in `data`, checked whole (magic, hash, schema, internal consistency); errors name `where`."""
    if data[:len(MAGIC)] != MAGIC:
        raise LengthIndexError(f"{where}: not a packloader length index (no {MAGIC!r} header)")
    digest, body = data[len(MAGIC):len(MAGIC) + 16], data[len(MAGIC) + 16:]
    if hashlib.blake2b(body, digest_size=16).digest() != digest or len(body) < 8:
        raise LengthIndexError(f"{where}: the length index is corrupt (its hash does not match its bytes); delete "
                               "it (Storage(index='build') builds it again) or rewrite it with `packloader tokenize`")
    try:
        raw = pa.decompress(body[8:], decompressed_size=int.from_bytes(body[:8], "little"), codec="zstd",
                            asbytes=True)
        index = msgspec.msgpack.decode(raw, type=LengthIndex)
    except (pa.ArrowException, msgspec.DecodeError) as e:
        raise LengthIndexError(f"{where}: unreadable length index ({e})") from None
    if index.version != VERSION:
        raise LengthIndexError(f"{where}: length index version {index.version}, expected {VERSION}")
    groups = len(index.group_rows)
    if len(index.layouts) != groups or len(index.pages) != groups or len(index.lengths) != 8 * sum(index.group_rows):
        raise LengthIndexError(f"{where}: the length index's row groups, pages and lengths disagree")
    if index.bodies and (len(index.bodies) != groups
                         or any(len(b) != len(p) for b, p in zip(index.bodies, index.pages))):
        raise LengthIndexError(f"{where}: the length index's pages and page bodies disagree")
    return index


def check_matches(index: LengthIndex, identity: str, meta, column: str, where: str) -> None:
    """An index is used only for the shard it was built from, and that shard's token column."""
    if index.identity != identity:
        raise LengthIndexError(f"{where}: the length index describes another shard (identity {index.identity}, "
                               f"the shard is {identity}: size and footer hash); the shard was rewritten after its "
                               "index. Rewrite both with `packloader tokenize`, or delete the index")
    rows = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
    if index.column != column or index.group_rows != rows:
        raise LengthIndexError(f"{where}: the length index is for column {index.column!r} with "
                               f"{len(index.group_rows)} row groups; the shard is read as column {column!r} with "
                               f"{len(rows)} row groups")


def build(pread, meta, column: str, identity: str) -> LengthIndex:
    """The index of a shard read whole through `pread(n, offset)`: each row group's token chunk fetched once,
    every page decoded to count its ids and rows. `Unpageable` where pages cannot be read one by one."""
    leaf = token_leaf(meta, column)
    lengths: list[int] = []
    pages, bodies, layouts, rows = [], [], [], []
    for g in range(meta.num_row_groups):
        lay = layout(meta, leaf, g)
        col = meta.row_group(g).column(leaf)
        start = col.data_page_offset
        table, got, body = scan_chunk(pread(col.total_compressed_size, start), start, lay)
        if len(got) != meta.row_group(g).num_rows:
            raise PageError(f"row group {g}: its pages hold {len(got)} rows, the footer says "
                            f"{meta.row_group(g).num_rows}")
        table[:, 3] += len(lengths)
        lengths += got
        pages.append(table.astype("<i8").tobytes())
        bodies.append(body.astype("<i8").tobytes())
        layouts.append(lay.key())
        rows.append(meta.row_group(g).num_rows)
    return LengthIndex(version=VERSION, identity=identity, column=column, group_rows=rows, layouts=layouts,
                       lengths=np.asarray(lengths, dtype="<i8").tobytes(), pages=pages, bodies=bodies)


def write_beside(path: str, index: LengthIndex) -> str:
    """Write `path`'s index beside it (atomically); the index's path."""
    out = index_name(path)
    tmp = f"{out}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(encode(index))
    os.replace(tmp, out)
    return out


def local_dir(cache_dir: str | None) -> str:
    """Where built indexes are kept: `Storage(index_dir=...)`, `PACKLOADER_INDEX_DIR`, else the user's cache."""
    return cache_dir or os.environ.get("PACKLOADER_INDEX_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "packloader", "index")


def cached_path(directory: str, identity: str, column: str) -> str:
    key = hashlib.blake2b(f"{identity}\0{column}".encode(), digest_size=16).hexdigest()
    return os.path.join(directory, f"{key}.index")


def find(watch, storage, meta, column: str, mode: str) -> LengthIndex | None:
    """The index of a remote shard: beside it, else in the local index directory, else (mode "build") built
    from one full read and kept there; None where there is none (mode "use") or its pages cannot be read one by
    one. A corrupt or mismatched index is an error naming it."""
    if mode == "off":
        return None
    identity = content_identity(watch.info.size, watch.footer)
    beside = index_name(watch.path)
    try:
        info = storage.head(beside)
    except FileNotFoundError:
        info = None
    except AccessDenied:  # S3 answers 403 for a missing key to a user who may not list the bucket
        log.info("%s: no length index readable beside the shard (access denied)", watch.path)
        info = None
    if info is not None:
        f = storage.open(info)
        index = decode(f.pread(info.size, 0), beside)
        check_matches(index, identity, meta, column, beside)
        return index
    local = cached_path(local_dir(storage.index_dir), identity, column)
    if os.path.exists(local):
        with open(local, "rb") as fh:
            index = decode(fh.read(), local)
        check_matches(index, identity, meta, column, local)
        return index
    if mode != "build":
        return None
    f = storage.open(watch.info)
    try:
        index = build(f.pread, meta, column, identity)
    except (Unpageable, PageError) as e:
        log.warning("%s: no length index (%s); its row groups are read whole", watch.path, e)
        return None
    os.makedirs(os.path.dirname(local), exist_ok=True)
    tmp = f"{local}.{os.getpid()}.tmp"
    with open(tmp, "wb") as fh:
        fh.write(encode(index))
    os.replace(tmp, local)
    return index


def find_local(path: str, identity: str, meta, column: str) -> LengthIndex | None:
    """The index beside a local shard, where it lets whole row groups be decoded from it (`parquet_chunk.py`);
    None where there is none. For a local file the index only speeds decoding (pyarrow reads the file whole and
    checked without it), so an index that is corrupt, stale or from an older writer is logged and left unused."""
    beside = index_name(path)
    if not os.path.exists(beside):
        return None
    try:
        with open(beside, "rb") as fh:
            index = decode(fh.read(), beside)
        check_matches(index, identity, meta, column, beside)
    except (LengthIndexError, OSError) as e:
        log.warning("%s: length index not used, the shard's row groups are read whole (%s)", path, e)
        return None
    return index if index.bodies else None
