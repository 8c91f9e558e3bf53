"""JSON Lines shards (plain, .gz, .zst): one JSON object per line, a text field or a token-list field.

Each shard is indexed once, when the source opens: the byte offsets of its non-blank lines (blank and
whitespace-only lines are not documents; line numbers in errors still count them, 1-based, as an editor does).
The index costs 24 bytes per document and one vectorised pass over the shard's bytes, read in chunks.

Plain files are read with plain reads (`os.pread` of each requested line), never memory-mapped: a mapped file
truncated by another process kills the reader with SIGBUS, which Python cannot catch. Each shard's identity
(`identity.py`: size and a hash of sampled blocks) is taken when the source opens, and checked after every read,
so a shard rewritten or truncated by another process is a `ShardChanged` error naming it. A compressed
shard has no random access: it is
decompressed whole into memory, once to build its index at open and again whenever a read needs it and it is not
the shard kept in memory (the most recently used compressed shards are kept up to `cache_bytes`, at least one).
Memory is therefore about one decompressed shard, and a random order over many compressed shards decompresses a
shard once per visit: store large corpora as Parquet (`packloader tokenize`) or plain JSONL instead. A compressed
shard cut short (.gz without its end-of-stream marker, .zst ending inside a frame) is an error, not a shorter shard.

Field choice: `field=None` picks the first of text, content, tokens, input_ids in the first object; an object
holding both a text and a token field is an error asking for `field=` (`column=` in `open_source` and the loader).

Rows are decoded with msgspec into a one-field struct, so other fields are skipped without building Python objects;
a malformed line, a missing field, a wrong type or bytes that are not UTF-8 are errors naming file and line.
"""

from __future__ import annotations

import gzip
import io
import os
from pathlib import Path
from typing import Annotated, Any, Iterator, Sequence

import msgspec
import numpy as np

from packloader.sources.base import RawDocument
from packloader.sources.errors import NonUtf8Error, SourceError
from packloader.sources.format_registry import DEFAULT_COLUMNS
from packloader.sources.identity import FileWatch, changed, file_identity
from packloader.sources.paths import refuse_duplicates
from packloader.sources.reader import LruCache, ShardedSource
from packloader.sources.storage import RemoteWatch, open_shard, pread, watch_shard

DEFAULT_FIELDS = DEFAULT_COLUMNS  # the column rule every format shares
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".json", ".json.gz", ".json.zst", ".ndjson")
_BOM = b"\xef\xbb\xbf"
TokenId = Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]


def compression_of(path: str) -> str | None:
    if path.endswith(".gz"):
        return "gzip"
    if path.endswith(".zst") or path.endswith(".zstd"):
        return "zstd"
    return None


def load_bytes(path: str, raw: bytes | None = None):
    """The shard's bytes, decompressed for .gz and .zst, read whole for plain files (the source itself reads
    plain files line by line: `JsonlSource`). `raw`: the file's bytes already fetched (a remote shard)."""
    if raw is None and not Path(path).exists():
        raise FileNotFoundError(f"JSONL shard not found: {path}")
    kind = compression_of(path)
    try:
        if kind == "gzip":
            with gzip.open(path if raw is None else io.BytesIO(raw), "rb") as f:
                return f.read()
        if kind == "zstd":
            return _zstd_frames(path, raw)
        return Path(path).read_bytes() if raw is None else raw
    except SourceError:
        raise
    except (OSError, EOFError, ValueError) as e:  # gzip: BadGzipFile is an OSError; zstandard: ZstdError
        raise SourceError(f"{path}: cannot be read as {kind or 'plain'} JSONL ({e})") from e
    except Exception as e:
        if type(e).__name__ == "ZstdError":
            raise SourceError(f"{path}: cannot be read as zstd-compressed JSONL ({e})") from e
        raise


def _zstd_frames(path: str, raw: bytes | None = None) -> bytes:
    """Every frame of a .zst file, decompressed; a file that ends inside a frame is an error (a streaming reader
    returns what it has, which would lose the documents after the cut without a word)."""
    import zstandard

    rest = Path(path).read_bytes() if raw is None else raw
    out = []
    while rest:
        d = zstandard.ZstdDecompressor().decompressobj()
        out.append(d.decompress(rest))
        if not d.eof:
            raise SourceError(f"{path}: cannot be read as zstd JSONL (truncated: the file ends inside a zstd frame)")
        rest = d.unused_data
    return b"".join(out)


def line_index(buf, chunk: int = 1 << 23) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(starts, ends, line_numbers) of the non-blank lines of `buf`; ends exclude the newline; numbers are 1-based."""
    arr = np.frombuffer(buf, dtype=np.uint8) if len(buf) else np.zeros(0, np.uint8)
    bom = 3 if bytes(arr[:3]) == _BOM else 0
    return index_chunks((arr[off : off + chunk] for off in range(0, arr.size, chunk)), skip=bom)


def file_line_index(f, chunk: int = 1 << 23) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`line_index` of an open file, read in chunks (never mapped, never whole in memory)."""
    def chunks():
        while data := f.read(chunk):
            yield np.frombuffer(data, dtype=np.uint8)
    bom = 3 if pread(f, 3, 0) == _BOM else 0
    return index_chunks(chunks(), skip=bom)


def index_chunks(chunks, skip: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`line_index` over consecutive chunks of a byte stream: one pass, a few chunks of temporary memory.

    A line is a segment between newlines; it is blank when it holds only spaces, tabs and carriage returns. Within a
    chunk, an OR-reduction of "not whitespace" over each segment tells its blankness; a line that runs over a chunk
    boundary carries its "seen a non-blank byte" into the next chunk. The first `skip` bytes (a UTF-8 byte order
    mark) count as blank."""
    starts, ends, numbers = [], [], []
    off, line_start, carry, line_no = 0, skip, False, 0
    for a in chunks:
        nonws = ~((a == 32) | (a == 10) | (a == 13) | (a == 9))
        if off < skip:
            nonws[: skip - off] = False
        nl = np.flatnonzero(a == 10)
        seg_starts = np.concatenate(([0], nl + 1))
        valid = seg_starts < a.size  # a chunk ending in a newline opens an empty segment past its end
        has = np.zeros(seg_starts.size, dtype=bool)
        if valid.any():  # segment i reduces [start_i, start_i+1): its bytes and its newline (blank)
            has[valid] = np.logical_or.reduceat(nonws, seg_starts[valid])
        has[0] |= carry
        if nl.size:
            closed = has[: nl.size]
            s = np.concatenate(([line_start], off + nl[:-1] + 1))
            starts.append(s[closed])
            ends.append((off + nl)[closed])
            numbers.append((line_no + 1 + np.arange(nl.size))[closed])
            line_no += nl.size
            line_start = off + int(nl[-1]) + 1
        carry = bool(has[-1])
        off += a.size
    if off > line_start and carry:  # a last line without a newline
        starts.append([line_start])
        ends.append([off])
        numbers.append([line_no + 1])
    def cat(parts):
        return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)
    return cat(starts), cat(ends), cat(numbers)


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
        storage=None,
    ) -> None:
        super().__init__(empty=empty)
        self.storage = storage  # remote shards: `storage.Storage` (None: local files, or URLs by their scheme)
        paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
        if not paths:
            raise ValueError("JsonlSource needs at least one file")
        self._paths = sorted(str(p) for p in paths)
        refuse_duplicates(self._paths)
        self.cache_bytes = int(cache_bytes)
        self.field = field
        self._pretokenized: bool | None = None
        self._index: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self._watch: list[FileWatch] = []
        for i, path in enumerate(self._paths):
            self._watch.append(watch_shard(path, "jsonl", file_identity, storage, "JSONL shard not found"))
            if compression_of(path) is None:
                f = open_shard(path, self._watch[i], storage)
                self._index.append(file_line_index(f))
                self._remember(i, f)
            else:
                self._index.append(line_index(self._remember(i, self._load(i))))
            self._watch[i].check()  # the file indexed is the one identified
            if self._pretokenized is None and len(self._index[-1][0]):
                self._detect(path, self._buffer(i), i)
        self.identities = [w.identity for w in self._watch]  # what a saved state and the other ranks compare
        if self._pretokenized is None:
            raise SourceError(f"{self._paths[0]}: no documents (every shard is empty or blank)")
        value_type: Any = list[TokenId] if self._pretokenized else str
        row = msgspec.defstruct("Row", [("value", value_type)], rename={"value": self.field})
        self._decoder = msgspec.json.Decoder(row)
        self._open_shards(self._paths, [len(ix[0]) for ix in self._index])

    @property
    def pretokenized(self) -> bool:
        return bool(self._pretokenized)

    def _detect(self, path: str, buf, shard: int) -> None:
        start, end, number = (int(x[0]) for x in self._index[shard])
        line = self._lines(shard, buf, [0])[0]
        try:
            obj = msgspec.json.decode(line)
        except (msgspec.DecodeError, UnicodeDecodeError) as e:
            raise _undecodable(f"{path}, line {number}", line, e) from e
        if not isinstance(obj, dict):
            raise SourceError(f"{path}, line {number}: expected a JSON object, got {_json_type(obj)}")
        if self.field is None:
            found = [f for f in DEFAULT_FIELDS if f in obj]
            if not found:
                raise SourceError(
                    f"{path}, line {number}: no text or token field among {sorted(obj)}; expected one of "
                    f"{list(DEFAULT_FIELDS)} or pass field=... (column= in open_source and PackedLoader, --column on "
                    "the command line)"
                )
            text = [f for f in found if isinstance(obj[f], str)]
            tokens = [f for f in found if isinstance(obj[f], list)]
            if text and tokens:
                raise SourceError(
                    f"{path}, line {number}: holds text ({', '.join(map(repr, text))}) and tokens "
                    f"({', '.join(map(repr, tokens))}); which to train is not guessed: pass field={tokens[0]!r} "
                    f"(column= in open_source and PackedLoader, --column) to read the tokens as stored, or "
                    f"field={text[0]!r} to tokenize the text"
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
        """Up to 64 open plain shards and up to `cache_bytes` of decompressed ones (always the newest)."""
        return self._process_cache().setdefault("buffers", LruCache(max_bytes=self.cache_bytes, max_items=64))

    def _buffer(self, shard: int):
        """An open file (plain shards, read line by line) or the decompressed bytes (compressed shards)."""
        buf = self._buffers().get(shard)
        if buf is not None:
            return buf
        path = self._paths[shard]
        remote = isinstance(self._watch[shard], RemoteWatch)
        if not remote and not os.path.exists(path):
            raise changed(path, "it was deleted or renamed")
        buf = open_shard(path, self._watch[shard], self.storage) if compression_of(path) is None else self._load(shard)
        self._watch[shard].check()  # the file opened or decompressed is the one indexed
        return self._remember(shard, buf)

    def _load(self, shard: int) -> bytes:
        """A compressed shard's documents, decompressed (a remote one is fetched whole first)."""
        path, watch = self._paths[shard], self._watch[shard]
        if not isinstance(watch, RemoteWatch):
            return load_bytes(path)
        return load_bytes(path, open_shard(path, watch, self.storage).readall())

    def _remember(self, shard: int, buf):
        size = len(buf) if isinstance(buf, bytes) else 0  # an open file costs a descriptor, not memory
        return self._buffers().put(shard, buf, size)

    def _lines(self, shard: int, buf, raw_rows) -> list[bytes]:
        """The bytes of these lines, checked to come from the file the source indexed."""
        starts, ends, _ = self._index[shard]
        spans = [(int(starts[r]), int(ends[r])) for r in raw_rows]
        if isinstance(buf, bytes):
            return [buf[a:b] for a, b in spans]
        out = [pread(buf, b - a, a) for a, b in spans]
        self._watch[shard].check()
        short = next((i for i, ((a, b), got) in enumerate(zip(spans, out)) if len(got) != b - a), None)
        if short is not None:  # the file shrank although its identity held: still a changed file
            a, b = spans[short]
            raise changed(self._paths[shard], f"bytes {a}..{b} of line {int(self._index[shard][2][raw_rows[short]])} "
                                              f"are gone (the file is shorter than when indexed)")
        return out

    def _decode(self, shard: int, raw_row: int, line: bytes) -> RawDocument:
        try:
            value = self._decoder.decode(line).value
        except msgspec.ValidationError as e:
            raise SourceError(f"{self._location(shard, raw_row)}, field {self.field!r}: {e}") from e
        except (msgspec.DecodeError, UnicodeDecodeError) as e:
            raise _undecodable(self._location(shard, raw_row), line, e) from e
        if self._pretokenized:
            return np.array(value, dtype=np.int32)
        return value

    def _read_raw(self, shard: int, raw_rows: np.ndarray) -> Iterator[RawDocument]:
        rows = raw_rows.tolist()
        for r, line in zip(rows, self._lines(shard, self._buffer(shard), rows)):
            yield self._decode(shard, r, line)

    def _empty_rows(self, shard: int) -> np.ndarray:
        rows = list(range(len(self._index[shard][0])))
        lines = self._lines(shard, self._buffer(shard), rows)
        return np.array([len(self._decode(shard, r, line)) == 0 for r, line in zip(rows, lines)], dtype=bool)


def _undecodable(where: str, line: bytes, e: Exception) -> SourceError:
    """Non-UTF-8 bytes are told apart by decoding the line ourselves: which exception msgspec raises for them, and
    its text, changed between releases (0.23 raises DecodeError where 0.22 let UnicodeDecodeError through)."""
    try:
        bytes(line).decode("utf-8")
    except UnicodeDecodeError as bad:
        return NonUtf8Error(f"{where}: text is not valid UTF-8 ({bad})")
    return SourceError(f"{where}: not valid JSON ({e})")
