"""Parquet data pages of a token column, one at a time: what lets a rank fetch a document's own pages instead of
its whole row group. pyarrow decodes a column chunk only whole, so the page header is parsed here (Thrift compact
protocol), the page's CRC checked, its body decompressed with pyarrow's codecs, the repetition and definition
levels stepped over and the PLAIN-encoded integers taken as they are. Only what `packloader tokenize` and most
writers produce is read this way (data pages v1 and v2, PLAIN values, no dictionary); anything else is
`Unpageable` and the shard is read by whole row groups."""

from __future__ import annotations

import struct
import zlib

import numpy as np
import pyarrow as pa

from packloader.sources.thrift_compact import ThriftError, read_struct, read_varint

_CODECS = {"UNCOMPRESSED": None, "SNAPPY": "snappy", "GZIP": "gzip", "BROTLI": "brotli", "ZSTD": "zstd",
           "LZ4_RAW": "lz4_raw"}
_WIDTHS = {"INT32": 4, "INT64": 8}
DATA_PAGE, DICTIONARY_PAGE, DATA_PAGE_V2 = 0, 2, 3
PLAIN = 0


class Unpageable(ValueError):
    """A column chunk whose pages this module does not decode one by one (then whole row groups are read)."""


class PageError(ValueError):
    """A page whose bytes are not what its header or the index says (corrupt, truncated, or another file's)."""


class ColumnLayout:
    """What decoding one page of a token column needs: codec, value width and the maximum levels."""

    def __init__(self, compression: str, physical_type: str, max_rep: int, max_def: int) -> None:
        if compression not in _CODECS:
            raise Unpageable(f"compression {compression} is not decoded page by page")
        if physical_type not in _WIDTHS:
            raise Unpageable(f"physical type {physical_type} is not a token id type")
        if int(max_rep) != 1 or int(max_def) < 1:
            raise Unpageable("not a list column")
        self.compression, self.physical_type = compression, physical_type
        self.codec = _CODECS[compression]
        self.width, self.max_rep, self.max_def = _WIDTHS[physical_type], int(max_rep), int(max_def)

    def key(self) -> tuple[str, str, int, int]:
        return self.compression, self.physical_type, self.max_rep, self.max_def


def token_leaf(meta, column: str) -> int:
    """The index of the leaf column holding `column`'s list values (`tokens.list.element`)."""
    for i in range(meta.num_columns):
        path = meta.schema.column(i).path
        if path == column or path.startswith(column + "."):
            return i
    raise Unpageable(f"no leaf column for {column!r}")


def layout(meta, leaf: int, group: int) -> ColumnLayout:
    col = meta.row_group(group).column(leaf)
    if col.has_dictionary_page:
        raise Unpageable("dictionary-encoded pages need the dictionary")
    s = meta.schema.column(leaf)
    return ColumnLayout(col.compression, col.physical_type, s.max_repetition_level, s.max_definition_level)


def _decompress(data: bytes, size: int, codec: str | None) -> bytes:
    if codec is None:
        return data
    return pa.decompress(data, decompressed_size=size, codec=codec, asbytes=True)


def varint(data, pos: int) -> tuple[int, int]:
    """A level run's header: a varint cut short is a truncated page."""
    try:
        return read_varint(data, pos)
    except ThriftError as e:
        raise PageError(f"a level run's header at byte {pos}: {e}") from None


def _hybrid(data, pos: int, end: int, width: int, count: int) -> np.ndarray:
    """`count` levels of `width` bits in the RLE / bit-packed hybrid encoding at data[pos:end]."""
    out, n = np.empty(count, dtype=np.int32), 0
    nbytes = (width + 7) // 8
    while n < count:
        if pos >= end:
            raise PageError(f"the levels end after {n} of {count} entries")
        head, pos = varint(data, pos)
        if head & 1:  # bit-packed: groups of 8 values, little-endian bit order
            k = (head >> 1) * 8
            raw = np.frombuffer(data[pos:pos + (head >> 1) * width], dtype=np.uint8)
            pos += (head >> 1) * width
            bits = np.unpackbits(raw, bitorder="little")[: k * width].reshape(-1, width)
            vals = bits @ (1 << np.arange(width, dtype=np.int32))
        else:
            k = head >> 1
            vals = np.full(k, int.from_bytes(bytes(data[pos:pos + nbytes]), "little"), dtype=np.int32)
            pos += nbytes
        take = min(k, count - n)
        out[n:n + take] = vals[:take]
        n += take
    return out


def _rows(rep: np.ndarray, dfn: np.ndarray, max_def: int) -> tuple[int, np.ndarray]:
    """(values before the first row that starts in the page, values of each row that starts in it)."""
    present = dfn == max_def
    if ((rep > 0) & ~present).any():
        raise PageError("a null token id")
    starts = np.flatnonzero(rep == 0)
    cum = np.concatenate(([0], np.cumsum(present, dtype=np.int64)))
    edges = np.concatenate((starts, [len(rep)]))
    return int(cum[edges[0]]), np.diff(cum[edges])


def rows_agree(head: int, rows, want, want_head: int) -> bool:
    """The rule every reader of an indexed shard holds a decoded page to: the ids before its first row and each
    row starting in it are what the length index says (`want`: the index's lengths of the rows starting in the
    page, `want_head`: its ids before the first of them); the last row may go on in the next page."""
    rows = rows.tolist() if isinstance(rows, np.ndarray) else list(rows)
    want = want.tolist() if isinstance(want, np.ndarray) else list(want)
    return head == want_head and len(rows) == len(want) and (not rows or (rows[:-1] == want[:-1] and rows[-1] <= want[-1]))


def page_size(buf: bytes) -> tuple[dict, int, int]:
    """(header, header bytes, page bytes with its header) of the page at the start of `buf`."""
    try:
        header, pos = read_struct(buf)
    except ThriftError as e:
        raise PageError(f"unreadable page header ({e})") from None
    size = header.get(3)
    if not isinstance(size, int) or size < 0 or header.get(1) not in (0, 1, 2, 3):
        raise PageError("a page header without a valid type and size")
    return header, pos, pos + size


def page_values(buf, lay: ColumnLayout) -> tuple[np.ndarray, int, np.ndarray] | None:
    """The data page `buf` holds (header and body), CRC checked: (its token ids, the ids before the first row
    that starts in it, each starting row's ids in it); None for a page of no values (an index page)."""
    header, pos, end = page_size(buf)
    if end > len(buf):
        raise PageError(f"the page is {end} bytes, only {len(buf)} were read")
    body = buf[pos:end]
    crc = header.get(4)
    if isinstance(crc, int) and zlib.crc32(body) != crc & 0xFFFFFFFF:
        raise PageError("the page's CRC does not match its bytes")
    kind = header[1]
    if kind == DICTIONARY_PAGE:
        raise Unpageable("dictionary-encoded pages need the dictionary")
    if kind not in (DATA_PAGE, DATA_PAGE_V2):
        return None
    raw = header.get(2)
    info = header.get(5 if kind == DATA_PAGE else 8) or {}
    count = int(info.get(1, 0))
    if info.get(2 if kind == DATA_PAGE else 4) != PLAIN:
        raise Unpageable("values not PLAIN-encoded")
    rw, dw = int(lay.max_rep).bit_length(), int(lay.max_def).bit_length()
    if kind == DATA_PAGE:
        data = _decompress(body, raw, lay.codec)
        cuts = [0]
        for _ in range(2):
            if cuts[-1] + 4 > len(data):
                raise PageError("a level section runs past the page")
            cuts.append(cuts[-1] + 4 + struct.unpack_from("<I", data, cuts[-1])[0])
        rep = _hybrid(data, 4, cuts[1], rw, count)
        dfn = _hybrid(data, cuts[1] + 4, cuts[2], dw, count)
        values = data[cuts[2]:]
    else:
        rl, dl = int(info.get(6, 0)), int(info.get(5, 0))
        if rl + dl > len(body):
            raise PageError("the level sections run past the page")
        rep = _hybrid(body, 0, rl, rw, count)
        dfn = _hybrid(body, rl, rl + dl, dw, count)
        values = _decompress(body[rl + dl:], raw - rl - dl, lay.codec if info.get(7, True) else None)
    ids = np.frombuffer(values, dtype="<i4" if lay.width == 4 else "<i8") if len(values) % lay.width == 0 else None
    head, rows = _rows(rep, dfn, lay.max_def)
    if ids is None or len(ids) != head + int(rows.sum()):
        n = head + int(rows.sum())
        raise PageError(f"{len(values)} value bytes are not the page's {n} {lay.physical_type} ids")
    return ids, head, rows


def scan_chunk(chunk: bytes, start: int, lay: ColumnLayout) -> tuple[np.ndarray, list[int], np.ndarray]:
    """Every data page of a column chunk read whole (`chunk` begins at file offset `start`): an int64 array of
    (file offset, size with header, ids, first row) per page, the rows' lengths, and per page what decoding it
    without parsing its header again needs (`parquet_chunk.py`): (header bytes, uncompressed bytes, CRC or -1,
    page type)."""
    pages, lengths, bodies = [], [], []
    view, pos = memoryview(chunk), 0
    while pos < len(view):
        header, head_bytes, end = page_size(view[pos:])
        page = page_values(view[pos:pos + end], lay)
        if page is not None:
            ids, head, rows = page
            if head and not lengths:
                raise PageError("the column chunk's first page continues a row")
            if head:
                lengths[-1] += head
            pages.append((start + pos, end, len(ids), len(lengths)))
            crc = header.get(4)
            bodies.append((head_bytes, int(header[2]), crc & 0xFFFFFFFF if isinstance(crc, int) else -1, header[1]))
            lengths.extend(rows.tolist())
        pos += end
    return (np.asarray(pages, dtype=np.int64).reshape(-1, 4), lengths,
            np.asarray(bodies, dtype=np.int64).reshape(-1, 4))
