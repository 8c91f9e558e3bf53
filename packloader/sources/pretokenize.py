"""Text shards in, Parquet token shards out, so that later epochs skip tokenizing (`packloader tokenize`).

Output: `part-00000.parquet`, `part-00001.parquet`, ... in `out_dir`, each with columns `tokens: list<int32>` and
`length: int32` (zstd, no dictionary encoding, CRC page checksums that `ParquetSource` verifies, row groups of
about `row_group_tokens` tokens, one document a data page by default: `page_rows`), documents in source order
(shard by shard, row by row). A new file starts once the current one holds `shard_tokens` tokens. The schema
metadata records the tokenizer, its EOS id and whether EOS was appended (`packloader.eos_appended`), so a reader
knows not to append it again; `ParquetSource(...).metadata` exposes it. Each file's footer also records a BLAKE2b
digest of its tokens and row lengths (`packloader.tokens_blake2b`), so the footer hash that identifies a shard
(`sources/identity.py`) changes with any token. Beside each file goes its length index (`_part-00000.parquet.index`,
`length_index.py`): uploaded with the shards, it lets each rank fetch only its own documents' pages. One document a
page costs about 9 % more bytes than pyarrow's 1 MiB pages at documents of ~1,000 tokens, and is what brings a
rank's share of the bytes down to its share of the documents (`docs/benchmarks.md`, "Object storage").

A reader thread reads the next batch of documents while the tokenizer encodes the current one in its own threads;
files are written under a temporary name and renamed when complete.
"""

from __future__ import annotations

import hashlib
import os
import queue
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import msgspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from packloader.sources.identity import parquet_identity
from packloader.sources.length_index import build, index_name, write_beside

SCHEMA = pa.schema([("tokens", pa.list_(pa.int32())), ("length", pa.int32())])
_INT32_MAX = 2**31 - 1


class TokenizeSummary(msgspec.Struct, frozen=True):
    files: list[str]
    documents: int
    tokens: int  # EOS included when appended
    seconds: float
    tokenizer: str
    eos_appended: bool
    skipped: dict[str, int]


def _batches(source, batch_docs: int, batch_chars: int, documents: tuple[int, int] | None = None) -> Iterator[list[str]]:
    """The source's texts in order; `documents`: only those from index a to b-1 of the whole order."""
    batch, chars = [], 0
    a, b = documents if documents is not None else (0, sum(s.num_rows for s in source.shards))
    first = 0
    for shard, info in enumerate(source.shards):
        lo, hi = max(a, first) - first, min(b, first + info.num_rows) - first
        first += info.num_rows
        if hi <= lo:
            continue
        for doc in source.read(shard, np.arange(lo, hi, dtype=np.int64)):
            batch.append(doc)
            chars += len(doc)
            if len(batch) >= batch_docs or chars >= batch_chars:
                yield batch
                batch, chars = [], 0
    if batch:
        yield batch


def _prefetched(it: Iterator, depth: int = 2) -> Iterator:
    """Run `it` in a thread, `depth` items ahead; its exceptions surface here, in order."""
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    done = object()

    def work() -> None:
        try:
            for item in it:
                if stop.is_set():
                    return
                q.put((item, None))
            q.put((done, None))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            q.put((done, e))

    t = threading.Thread(target=work, name="packloader-tokenize-reader", daemon=True)
    t.start()
    try:
        while True:
            item, err = q.get()
            if item is done:
                if err is not None:
                    raise err
                return
            yield item
    finally:
        stop.set()
        while t.is_alive():  # unblock a producer waiting on a full queue
            try:
                q.get_nowait()
            except queue.Empty:
                t.join(0.05)


def write_index(path: str) -> str:
    """The length index of a token shard just written, beside it (one local read of the file)."""
    meta = pq.read_metadata(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        index = build(lambda n, off: os.pread(fd, n, off), meta, "tokens", parquet_identity(path))
    finally:
        os.close(fd)
    return write_beside(path, index)


class _ShardWriter:
    """Writes token arrays into numbered Parquet files, row group by row group, rolling over at `shard_tokens`."""

    def __init__(self, out_dir: Path, shard_tokens: int, row_group_tokens: int, metadata: dict[str, str],
                 page_rows: int = 1, prefix: str = "part-") -> None:
        self.out_dir, self.page_rows, self.prefix = out_dir, page_rows, prefix
        self.shard_tokens = shard_tokens
        self.row_group_tokens = row_group_tokens
        self.schema = SCHEMA.with_metadata(metadata)
        self.files: list[str] = []
        self._writer: pq.ParquetWriter | None = None
        self._tmp: Path | None = None
        self._file_tokens = 0
        self._pending: list[np.ndarray] = []
        self._pending_tokens = 0
        self._digest = hashlib.blake2b(digest_size=16)

    def add(self, docs: list[np.ndarray]) -> None:
        for d in docs:
            if len(d) > _INT32_MAX:
                raise ValueError(f"a document of {len(d)} tokens does not fit a list<int32> row")
            self._pending.append(d)
            self._pending_tokens += len(d)
            self._file_tokens += len(d)
            if self._pending_tokens >= self.row_group_tokens or self._file_tokens >= self.shard_tokens:
                self._flush_row_group()
            if self._file_tokens >= self.shard_tokens:
                self._close_file()

    def _flush_row_group(self) -> None:
        if not self._pending:
            return
        lengths = np.fromiter((len(d) for d in self._pending), dtype=np.int64, count=len(self._pending))
        offsets = np.concatenate(([0], np.cumsum(lengths)))
        if offsets[-1] > _INT32_MAX:  # keep list<int32> offsets valid: split the row group
            half = len(self._pending) // 2
            rest = self._pending[half:]
            self._pending = self._pending[:half]
            self._flush_row_group()
            self._pending = rest
            self._flush_row_group()
            return
        values = np.concatenate(self._pending).astype(np.int32, copy=False)
        self._digest.update(lengths.astype("<i8").tobytes())
        self._digest.update(values.astype("<i4", copy=False).tobytes())
        tokens = pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(values))
        table = pa.Table.from_arrays([tokens, pa.array(lengths.astype(np.int32))], schema=self.schema)
        if self._writer is None:
            name = f"{self.prefix}{len(self.files):05d}.parquet"
            self._tmp = self.out_dir / f".{name}.tmp"
            self._writer = pq.ParquetWriter(self._tmp, self.schema, compression="zstd", use_dictionary=False,
                                           write_page_checksum=True, max_rows_per_page=self.page_rows or None,
                                           write_statistics=["length"])  # token statistics tell nothing
            self.files.append(str(self.out_dir / name))
        self._writer.write_table(table, row_group_size=len(self._pending))
        self._pending, self._pending_tokens = [], 0

    def _close_file(self) -> None:
        self._flush_row_group()
        if self._writer is not None:
            self._writer.add_key_value_metadata({"packloader.tokens_blake2b": self._digest.hexdigest()})
            self._writer.close()
            os.replace(self._tmp, self.files[-1])
            self._writer, self._tmp = None, None
            write_index(self.files[-1])
        self._file_tokens = 0
        self._digest = hashlib.blake2b(digest_size=16)

    def close(self) -> None:
        self._close_file()

    def abort(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._tmp.unlink(missing_ok=True)
            self._writer = None


def tokenize_to_parquet(
    source,
    tokenizer,
    out_dir: str | os.PathLike,
    *,
    append_eos: bool = True,
    shard_tokens: int = 1 << 27,
    row_group_tokens: int = 1 << 20,
    page_rows: int = 1,
    batch_docs: int = 1024,
    batch_chars: int = 8 << 20,
    overwrite: bool = False,
    progress: bool = True,
    doc_range: tuple[int, int] | None = None,
    prefix: str = "part-",
    metadata: dict[str, str] | None = None,
) -> TokenizeSummary:
    """Tokenize every document of a text `source` with `tokenizer` and write Parquet token shards to `out_dir`.
    `doc_range`, `prefix` and `metadata` serve one part of a split run (`tokenize_parts.py`): documents a..b-1 of
    the source's order, files `<prefix>NNNNN.parquet`, extra footer metadata."""
    if source.pretokenized:
        raise ValueError("the source is already tokenized; tokenize reads text sources")
    if append_eos and tokenizer.eos_id is None:
        raise ValueError(f"tokenizer {tokenizer.name!r} has no EOS token; pass append_eos=False (--no-eos)")
    if shard_tokens < 1 or row_group_tokens < 1:
        raise ValueError("shard_tokens and row_group_tokens must be >= 1")
    if page_rows < 0:
        raise ValueError(f"page_rows must be >= 0 (0: pyarrow's page size alone), got {page_rows}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    existing = sorted(out.glob(f"{prefix}*.parquet"))
    if existing:
        if not overwrite:
            raise FileExistsError(f"{out} already holds token shards ({existing[0].name}, ...); pass overwrite=True "
                                  "(--overwrite on the command line)")
        for p in existing:
            p.unlink()
            Path(index_name(str(p))).unlink(missing_ok=True)
    metadata = {
        **(metadata or {}),
        "packloader.tokenizer": tokenizer.name,
        "packloader.vocab_size": str(tokenizer.vocab_size),
        "packloader.eos_id": "" if tokenizer.eos_id is None else str(tokenizer.eos_id),
        "packloader.eos_appended": "true" if append_eos else "false",
    }
    writer = _ShardWriter(out, shard_tokens, row_group_tokens, metadata, page_rows, prefix)
    eos = None if not append_eos else np.array([tokenizer.eos_id], dtype=np.int32)
    from tqdm import tqdm

    total_docs = sum(s.num_rows for s in source.shards) if doc_range is None else doc_range[1] - doc_range[0]
    bar = tqdm(total=total_docs, unit="doc", disable=not progress, file=sys.stderr, desc="tokenize", smoothing=0.1)
    documents = tokens = 0
    start = time.perf_counter()
    try:
        for texts in _prefetched(_batches(source, batch_docs, batch_chars, doc_range)):
            encoded = tokenizer.encode_batch(texts)
            if eos is not None:
                encoded = [np.concatenate((ids, eos)) for ids in encoded]
            writer.add(encoded)
            documents += len(encoded)
            tokens += sum(len(ids) for ids in encoded)
            bar.update(len(encoded))
            bar.set_postfix(tokens=f"{tokens:,}", refresh=False)
        writer.close()
    except BaseException:
        writer.abort()
        raise
    finally:
        bar.close()
    skipped = getattr(source, "skipped", None)
    return TokenizeSummary(
        files=writer.files,
        documents=documents,
        tokens=tokens,
        seconds=time.perf_counter() - start,
        tokenizer=tokenizer.name,
        eos_appended=append_eos,
        skipped=dict(skipped.counts) if skipped is not None else {},
    )
