"""JSON Lines shards (plain, .gz, .zst): one JSON object per line, a text field or a token-list field.

Each shard is indexed once, when the source opens: the byte offsets of its non-blank lines (blank and
whitespace-only lines are not documents; line numbers in errors still count them, 1-based, as an editor does).
The index costs 24 bytes per document and two vectorised passes over the shard's bytes (a few seconds per GB).

Plain files are memory-mapped, so a row is a slice of the mapping. A compressed shard has no random access: it is
decompressed whole into memory, once to build its index at open and again whenever a read needs it and it is not
the shard kept in memory (the most recently used compressed shards are kept up to `cache_bytes`, at least one).
Memory is therefore about one decompressed shard, and a random order over many compressed shards decompresses a
shard once per visit: store large corpora as Parquet (`packloader tokenize`) or plain JSONL instead. A compressed
shard cut short (.gz without its end-of-stream marker, .zst ending inside a frame) is an error, not a shorter shard.

Rows are decoded with msgspec into a one-field struct, so other fields are skipped without building Python objects;
a malformed line, a missing field, a wrong type or bytes that are not UTF-8 are errors naming file and line.
"""

from __future__ import annotations

import gzip
import mmap
import os
from pathlib import Path
from typing import Annotated, Any, Iterator, Sequence

import msgspec
import numpy as np

from packloader.sources.base import RawDocument
from packloader.sources.errors import NonUtf8Error, SourceError
from packloader.sources.reader import LruCache, ShardedSource

DEFAULT_FIELDS = ("text", "content", "tokens", "input_ids")
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".json", ".json.gz", ".json.zst", ".ndjson")
_BOM = b"\xef\xbb\xbf"
TokenId = Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]


def compression_of(path: str) -> str | None:
    if path.endswith(".gz"):
        return "gzip"
    if path.endswith(".zst") or path.endswith(".zstd"):
        return "zstd"
    return None


def load_bytes(path: str):
    """The shard's bytes: a read-only memory map for plain files, decompressed bytes for .gz and .zst."""
    if not Path(path).exists():
        raise FileNotFoundError(f"JSONL shard not found: {path}")
    kind = compression_of(path)
    try:
        if kind == "gzip":
            with gzip.open(path, "rb") as f:
                return f.read()
        if kind == "zstd":
            return _zstd_frames(path)
        if os.path.getsize(path) == 0:
            return b""
        with open(path, "rb") as f:
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except SourceError:
        raise
    except (OSError, EOFError, ValueError) as e:  # gzip: BadGzipFile is an OSError; zstandard: ZstdError
        raise SourceError(f"{path}: cannot be read as {kind or 'plain'} JSONL ({e})") from e
    except Exception as e:
        if type(e).__name__ == "ZstdError":
            raise SourceError(f"{path}: cannot be read as zstd-compressed JSONL ({e})") from e
        raise


def _zstd_frames(path: str) -> bytes:
    """Every frame of a .zst file, decompressed; a file that ends inside a frame is an error (a streaming reader
    returns what it has, which would lose the documents after the cut without a word)."""
    import zstandard

    rest = Path(path).read_bytes()
    out = []
    while rest:
        d = zstandard.ZstdDecompressor().decompressobj()
        out.append(d.decompress(rest))
        if not d.eof:
            raise SourceError(f"{path}: cannot be read as zstd JSONL (truncated: the file ends inside a zstd frame)")
        rest = d.unused_data
    return b"".join(out)


def line_index(buf, chunk: int = 1 << 24) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(starts, ends, line_numbers) of the non-blank lines of `buf`; ends exclude the newline; numbers are 1-based.

    Two passes over the bytes in chunks (newlines, then "any non-whitespace byte per line" with a reduceat), so
    the temporary memory is a few chunks, not a copy of the shard.
    """
    arr = np.frombuffer(buf, dtype=np.uint8) if len(buf) else np.zeros(0, np.uint8)
    bom = 3 if arr.size >= 3 and bytes(arr[:3]) == _BOM else 0
    arr = arr[bom:]
    n = arr.size
    newlines = [np.flatnonzero(arr[off : off + chunk] == 10) + off for off in range(0, n, chunk)]
    ends = np.concatenate(newlines) if newlines else np.zeros(0, np.int64)
    starts = np.concatenate(([0], ends + 1))
    if starts[-1] < n:  # a last line without a newline
        ends = np.concatenate((ends, [n]))
    else:
        starts = starts[:-1]
    nonblank = np.zeros(len(starts), dtype=bool)
    for off in range(0, n, chunk):
        a = arr[off : off + chunk]
        nonws = ~((a == 32) | (a == 10) | (a == 13) | (a == 9))
        lo = int(np.searchsorted(starts, off, side="right")) - 1  # the line this chunk begins inside
        hi = int(np.searchsorted(starts, off + a.size, side="left"))
        local = np.maximum(starts[lo:hi] - off, 0)  # strictly increasing: every line holds at least its newline
        nonblank[lo:hi] |= np.logical_or.reduceat(nonws, local)
    numbers = np.arange(1, len(starts) + 1, dtype=np.int64)
    return starts[nonblank].astype(np.int64) + bom, ends[nonblank].astype(np.int64) + bom, numbers[nonblank]


def _json_type(value: Any) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


class JsonlSource(ShardedSource):
    """JSONL files as shards (sorted paths). `field=None` picks the first of text, content, tokens, input_ids."""

    def __init__(
        self,
        paths: str | Path | Sequence[str | Path],
        *,
        field: str | None = None,
        empty: str = "error",
        cache_bytes: int = 1 << 30,
    ) -> None:
        super().__init__(empty=empty)
        paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
        if not paths:
            raise ValueError("JsonlSource needs at least one file")
        self._paths = sorted(str(p) for p in paths)
        self.cache_bytes = int(cache_bytes)
        self.field = field
        self._pretokenized: bool | None = None
        self._index: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        for i, path in enumerate(self._paths):
            buf = load_bytes(path)
            self._index.append(line_index(buf))
            if self._pretokenized is None and len(self._index[-1][0]):
                self._detect(path, buf, self._index[-1])
            self._remember(i, buf)
        if self._pretokenized is None:
            raise SourceError(f"{self._paths[0]}: no documents (every shard is empty or blank)")
        value_type: Any = list[TokenId] if self._pretokenized else str
        row = msgspec.defstruct("Row", [("value", value_type)], rename={"value": self.field})
        self._decoder = msgspec.json.Decoder(row)
        self._open_shards(self._paths, [len(ix[0]) for ix in self._index])

    @property
    def pretokenized(self) -> bool:
        return bool(self._pretokenized)

    def _detect(self, path: str, buf, index) -> None:
        start, end, number = (int(x[0]) for x in index)
        line = bytes(buf[start:end])
        try:
            obj = msgspec.json.decode(line)
        except (msgspec.DecodeError, UnicodeDecodeError) as e:
            raise SourceError(f"{path}, line {number}: not valid JSON ({e})") from e
        if not isinstance(obj, dict):
            raise SourceError(f"{path}, line {number}: expected a JSON object, got {_json_type(obj)}")
        if self.field is None:
            found = [f for f in DEFAULT_FIELDS if f in obj]
            if not found:
                raise SourceError(
                    f"{path}, line {number}: no text or token field among {sorted(obj)}; expected one of "
                    f"{list(DEFAULT_FIELDS)} or pass field=..."
                )
            self.field = found[0]
        if self.field not in obj:
            raise SourceError(f"{path}, line {number}: missing field {self.field!r}; the object has {sorted(obj)}")
        value = obj[self.field]
        if isinstance(value, str):
            self._pretokenized = False
        elif isinstance(value, list):
            self._pretokenized = True
        else:
            raise SourceError(
                f"{path}, line {number}, field {self.field!r}: {_json_type(value)}, expected a string (text) "
                "or a list of token ids"
            )

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        del state["_decoder"]
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        row = msgspec.defstruct("Row", [("value", list[TokenId] if self._pretokenized else str)],
                                rename={"value": self.field})
        self._decoder = msgspec.json.Decoder(row)

    def _location(self, shard: int, raw_row: int) -> str:
        return f"{self._paths[shard]}, line {int(self._index[shard][2][raw_row])}"

    def _buffers(self) -> LruCache:
        """Up to 64 mapped plain shards and up to `cache_bytes` of decompressed ones (always the newest)."""
        return self._process_cache().setdefault("buffers", LruCache(max_bytes=self.cache_bytes, max_items=64))

    def _buffer(self, shard: int):
        buf = self._buffers().get(shard)
        return buf if buf is not None else self._remember(shard, load_bytes(self._paths[shard]))

    def _remember(self, shard: int, buf):
        size = 0 if isinstance(buf, mmap.mmap) else len(buf)  # a mapping costs address space, not memory
        return self._buffers().put(shard, buf, size)

    def _decode(self, shard: int, raw_row: int, line: bytes) -> RawDocument:
        try:
            value = self._decoder.decode(line).value
        except UnicodeDecodeError as e:
            raise NonUtf8Error(f"{self._location(shard, raw_row)}: text is not valid UTF-8 ({e})") from e
        except msgspec.ValidationError as e:
            raise SourceError(f"{self._location(shard, raw_row)}, field {self.field!r}: {e}") from e
        except msgspec.DecodeError as e:
            raise SourceError(f"{self._location(shard, raw_row)}: not valid JSON ({e})") from e
        if self._pretokenized:
            return np.array(value, dtype=np.int32)
        return value

    def _read_raw(self, shard: int, raw_rows: np.ndarray) -> Iterator[RawDocument]:
        starts, ends, _ = self._index[shard]
        buf = self._buffer(shard)
        for r in raw_rows.tolist():
            yield self._decode(shard, r, buf[int(starts[r]) : int(ends[r])])

    def _empty_rows(self, shard: int) -> np.ndarray:
        starts, ends, _ = self._index[shard]
        buf = self._buffer(shard)
        spans = zip(range(len(starts)), starts.tolist(), ends.tolist())
        return np.array([len(self._decode(shard, r, buf[s:e])) == 0 for r, s, e in spans], dtype=bool)
