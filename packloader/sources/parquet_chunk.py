"""A local shard's token column decoded a whole row group at a time from its length index. One document a data
page (what `packloader tokenize` writes, so that a rank reading from object storage fetches only its own pages)
costs pyarrow a zstd context and a page setup per document: 4-5x its time on pyarrow's 1 MiB pages. The index
already names every page's offset, header size, uncompressed size, CRC and ids, so here the column chunk is read
in one plain read and each page is CRC-checked, decompressed with one reused zstd context, and its PLAIN ids taken
after the two level sections (data pages v1); the rows' boundaries are the index's lengths, which must add up to
the ids found. Anything else (data pages v2, an index without page bodies) is left to pyarrow."""

from __future__ import annotations

import os
import struct
import threading
import zlib

import numpy as np
import zstandard

from packloader.sources.errors import SourceError
from packloader.sources.parquet_pages import (
    DATA_PAGE,
    ColumnLayout,
    PageError,
    _decompress,
    _hybrid,
    _rows,
    rows_agree,
    varint,
)

_LOCAL = threading.local()
_INT32_LIMIT = 2**31


def _decompressor(codec: str | None):
    """`decompress(body, size)` for `codec`: zstd through one context per thread, reused page after page."""
    if codec != "zstd":
        return lambda body, size: _decompress(body, size, codec)
    d = getattr(_LOCAL, "zstd", None)
    if d is None:
        d = _LOCAL.zstd = zstandard.ZstdDecompressor()
    return lambda body, size: d.decompress(body, max_output_size=size)


def decodable(bodies: np.ndarray | None, lay: ColumnLayout) -> bool:
    """Whether a row group's pages are all ones this module decodes (data pages v1 of a 4-byte id)."""
    return bodies is not None and lay.width == 4 and bool((bodies[:, 3] == DATA_PAGE).all())


def chunk_ids(buf, pages: np.ndarray, bodies: np.ndarray, lay: ColumnLayout, lengths: np.ndarray,
              first_row: int) -> np.ndarray:
    """Every token id of one row group's column chunk, in order. `buf` holds the file's bytes from the first
    page's offset to the last page's end; `pages` and `bodies` are the index's tables of that row group,
    `lengths` its rows' lengths (rows from `first_row`), which each page's rows must agree with (`rows_agree`, the
    rule of the ranged reader too)."""
    view, start = memoryview(buf), int(pages[0, 0])
    out = np.empty(int(pages[:, 2].sum()), dtype="<i4")
    dest, at = memoryview(out).cast("B"), 0
    decompress = _decompressor(lay.codec)
    row_starts = np.concatenate(([0], np.cumsum(lengths, dtype=np.int64)))
    firsts = np.append(pages[:, 3] - first_row, len(lengths))
    for p, ((off, size, ids, _), (head, raw, crc, _)) in enumerate(zip(pages.tolist(), bodies.tolist())):
        a = off - start
        if a + size > len(view):
            raise PageError(f"the page at byte {off} ends past the bytes read (the file is truncated)")
        body = view[a + head:a + size]
        if crc >= 0 and zlib.crc32(body) != crc:
            raise PageError(f"CRC checksum verification failed for the page at byte {off}")
        try:
            data = decompress(body, raw)
        except Exception as e:  # zstandard's and pyarrow's codecs raise their own kinds
            raise PageError(f"the page at byte {off} does not decompress ({e})") from None
        if len(data) != raw or raw < 8:
            raise PageError(f"the page at byte {off} decompresses to {len(data)} bytes, its header says {raw}")
        rep = struct.unpack_from("<I", data, 0)[0]
        values = 8 + rep + (struct.unpack_from("<I", data, 4 + rep)[0] if 8 + rep <= raw else raw)
        if raw - values != 4 * ids:
            raise PageError(f"the page at byte {off} holds {raw - values} value bytes, the index says {ids} ids")
        a, b = int(firsts[p]), int(firsts[p + 1])
        ok = 0 <= a <= b <= len(lengths)
        _check_rows(data, rep, values, lay, ids, lengths[a:b] if ok else None, row_starts[a] - at // 4 if ok else -1, off)
        dest[at:at + raw - values] = memoryview(data)[values:]
        at += raw - values
    return out


def _row_starts(data, pos: int, end: int, count: int) -> list[int]:
    """Where the first `count` 1-bit repetition levels at data[pos:end] are 0 (a row starts), read run by run: a
    page of one document is a bit-packed group and one RLE run."""
    out, n = [], 0
    while n < count:
        if pos >= end:
            raise PageError(f"the levels end after {n} of {count} entries")
        head, pos = varint(data, pos)
        if head & 1:  # bit-packed groups of 8 levels, one byte each at width 1
            groups = head >> 1
            take = min(groups * 8, count - n)
            raw = bytes(data[pos:pos + groups])
            if groups > 16:
                bits = np.unpackbits(np.frombuffer(raw, np.uint8), bitorder="little")[:take]
                out += (n + np.flatnonzero(bits == 0)).tolist()
            else:
                out += [n + 8 * j + k for j, b in enumerate(raw) if b != 0xFF for k in range(8)
                        if not (b >> k) & 1 and 8 * j + k < take]
            pos += groups
        else:  # an RLE run: one byte of value at width 1
            take = min(head >> 1, count - n)
            if data[pos] == 0:
                out += range(n, n + take)
            pos += 1
        n += take
    return out


def _all_present(data, pos: int, end: int, count: int, max_def: int) -> bool:
    """Whether the definition levels open with one RLE run of max_def covering `count` levels (no null, no empty
    row): what a page of whole token lists holds."""
    if pos >= end:
        return False
    head, pos = varint(data, pos)
    width = (max_def.bit_length() + 7) // 8
    return not head & 1 and head >> 1 >= count and int.from_bytes(bytes(data[pos:pos + width]), "little") == max_def


def _check_rows(data, rep: int, values: int, lay: ColumnLayout, ids: int, want: np.ndarray | None, want_head: int,
                off: int) -> None:
    """A page's rows, from its levels (one level per id, one per empty row the index names), against the index's
    `want` (None: the index's rows do not fit its own row group)."""
    try:
        if want is None:
            raise PageError("no rows")
        want = want.tolist()
        if 0 not in want and _all_present(data, 8 + rep, values, ids, lay.max_def):  # whole token lists: by runs
            starts = _row_starts(data, 4, 4 + rep, ids)
            head, rows = (starts[0] if starts else ids), [b - a for a, b in zip(starts, starts[1:] + [ids])]
        else:
            count = ids + want.count(0)
            levels = _hybrid(data, 4, 4 + rep, 1, count), _hybrid(data, 8 + rep, values, lay.max_def.bit_length(),
                                                                    count)
            head, rows = _rows(*levels, lay.max_def)
    except PageError:
        head, rows = -1, []
    if want is None or not rows_agree(head, rows, want, int(want_head)):
        raise PageError(f"the page at byte {off}: its ids and rows disagree with the length index; the index is not "
                        "this shard's")


def check_range(path: str, column: str, start: int, offsets: np.ndarray, tokens: np.ndarray,
                vocab_size: int | None) -> None:
    """Every id of a decoded row group (rows from `start`) in [0, vocab_size), else an error naming the row."""
    if not tokens.size:
        return
    hi = vocab_size if vocab_size is not None else _INT32_LIMIT
    if int(tokens.min()) < 0 or int(tokens.max()) >= hi:
        pos = int(np.flatnonzero((tokens < 0) | (tokens >= hi))[0])
        row = start + int(np.searchsorted(offsets, pos, side="right")) - 1
        vocab = f"in [0, {vocab_size}), the vocabulary" if vocab_size is not None else ">= 0"
        raise SourceError(f"{path}, row {row}, column {column!r}: token id {int(tokens[pos])} at position "
                          f"{pos - int(offsets[row - start])}, expected an id {vocab}")


def indexed_block(path: str, index, group: int, start: int) -> tuple[np.ndarray, np.ndarray] | None:
    """Row group `group` of a local shard (its first row `start`) as (offsets, int32 ids), decoded through its
    length index; None where its pages are not ones `chunk_ids` decodes. Errors name the file and row group."""
    pages, bodies, lay = index.page_array(group), index.body_array(group), ColumnLayout(*index.layouts[group])
    if not len(pages) or not decodable(bodies, lay):
        return None
    lengths = index.length_array()[start:start + index.group_rows[group]]
    offsets = np.concatenate(([0], np.cumsum(lengths, dtype=np.int64)))
    a, b = int(pages[0, 0]), int(pages[-1, 0] + pages[-1, 1])
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            buf = os.pread(fd, b - a, a)
        finally:
            os.close(fd)
        ids = chunk_ids(buf, pages, bodies, lay, lengths, start)
        if len(ids) != offsets[-1]:
            raise PageError(f"its pages hold {len(ids)} ids, the length index's rows {int(offsets[-1])}")
    except (OSError, PageError) as e:
        raise SourceError(f"{path}: row group {group} (rows {start}..{start + len(lengths) - 1}), column "
                          f"{index.column!r}: cannot be read, the file is corrupt or truncated ({e})") from e
    return offsets, ids
