"""Megatron indexed datasets: `.bin`/`.idx` pairs as megatron-core's `IndexedDatasetBuilder` writes them.

Parsed here (megatron is not imported at read time), so a Megatron or NeMo corpus is read without megatron-core
installed. The index (`.idx`, little-endian):

    b"MMIDIDX\\x00\\x00"  version (u64 = 1)  dtype code (u8)  sequence count S (u64)  document count D (u64)
    S sequence lengths (int32)  S sequence byte offsets into .bin (int64)  D document indices (int64)
    [S sequence modes (int8): multimodal datasets only]

A document is the run of sequences between two consecutive document indices (the first is 0, the last is S); its
tokens are contiguous in `.bin`. Each pair is one shard, a document one row; tokens are used as stored (Megatron's
preprocessing appends the end-of-document id itself when asked to), cast to int32.

Everything the index claims is checked when the source opens: the header, the file's size against the counts,
offsets against lengths, document indices against the sequence count, and the `.bin` size against the tokens the
index describes, so a truncated or corrupt pair is an error naming the file before any batch. `.bin` is read with
plain reads of the documents asked for, never a memory map: a mapped file that another process truncates kills
the reader with SIGBUS, which no handler catches. After each read the file is checked to be the one indexed
(`identity.FileWatch`), so a `.bin` rewritten, truncated or replaced meanwhile is a `ShardChanged` naming it.
`parse_index` takes any buffer (bytes, a memory map), the seam for readers of other storage.
"""

from __future__ import annotations

import hashlib
import os
import struct
from typing import Iterator, Sequence

import numpy as np

from packloader.sources.base import RawDocument
from packloader.sources.errors import SourceError
from packloader.sources.identity import FileWatch, changed, file_identity
from packloader.sources.reader import ShardedSource

MAGIC = b"MMIDIDX\x00\x00"
_HEAD = len(MAGIC) + 8 + 1 + 8 + 8
# megatron.core.datasets.indexed_dataset.DType codes; float codes (6, 7) hold no token ids
TOKEN_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16}
_FLOAT_CODES = {6: "float64", 7: "float32"}
_I32 = np.iinfo(np.int32).max


class MegatronIndex:
    """What an `.idx` file says: token dtype, and each document's first token and token count in `.bin`."""

    def __init__(self, dtype: np.dtype, starts: np.ndarray, lengths: np.ndarray, total_tokens: int) -> None:
        self.dtype, self.starts, self.lengths, self.total_tokens = dtype, starts, lengths, total_tokens


def _corrupt(name: str, why: str) -> SourceError:
    return SourceError(f"{name}: not a readable Megatron index ({why}); expected the .idx that megatron-core's "
                       "IndexedDatasetBuilder.finalize writes beside its .bin")


def parse_index(buf, name: str) -> MegatronIndex:
    """Parse and check an index held in `buf` (bytes, memoryview or a memory map); errors name `name`."""
    buf = memoryview(buf)
    size = len(buf)
    if size < _HEAD:
        raise _corrupt(name, f"{size} bytes, shorter than the {_HEAD}-byte header: truncated")
    if bytes(buf[: len(MAGIC)]) != MAGIC:
        raise _corrupt(name, f"header {bytes(buf[:len(MAGIC)])!r}, expected {MAGIC!r}")
    version, code, s, d = struct.unpack_from("<QBQQ", buf, len(MAGIC))
    if version != 1:
        raise _corrupt(name, f"version {version}, expected 1")
    if code in _FLOAT_CODES:
        raise SourceError(f"{name}: holds {_FLOAT_CODES[code]} values, not token ids; expected an integer dtype")
    if code not in TOKEN_DTYPES:
        raise _corrupt(name, f"dtype code {code}, expected one of {sorted(TOKEN_DTYPES)}")
    want = _HEAD + 12 * s + 8 * d
    if size == want + s and s:
        raise SourceError(f"{name}: a multimodal Megatron index (a mode per sequence); only token datasets are "
                          "supported")
    if size != want:
        raise _corrupt(name, f"{size} bytes, but {s} sequences and {d} document indices take {want}: "
                             f"{'truncated' if size < want else 'trailing bytes'}")
    dtype = np.dtype(TOKEN_DTYPES[code])
    seq_len = np.frombuffer(buf, np.int32, s, _HEAD).astype(np.int64)
    ptr = np.frombuffer(buf, np.int64, s, _HEAD + 4 * s)
    doc_idx = np.frombuffer(buf, np.int64, d, _HEAD + 12 * s)
    if s and seq_len.min() < 0:
        raise _corrupt(name, f"sequence {int(np.argmin(seq_len))} has a negative length")
    ends = np.cumsum(seq_len) * dtype.itemsize
    expect_ptr = np.concatenate(([0], ends[:-1])) if s else ends
    if not np.array_equal(ptr, expect_ptr):
        bad = int(np.flatnonzero(ptr != expect_ptr)[0])
        raise _corrupt(name, f"sequence {bad} starts at byte {int(ptr[bad])}, but the lengths before it end at "
                             f"byte {int(expect_ptr[bad])}")
    if d < 1 or doc_idx[0] != 0 or doc_idx[-1] != s or (d > 1 and np.diff(doc_idx).min() < 0):
        raise _corrupt(name, f"document indices must rise from 0 to the sequence count {s}")
    tok_ends = np.concatenate(([0], np.cumsum(seq_len)))
    starts = tok_ends[doc_idx[:-1]]
    lengths = tok_ends[doc_idx[1:]] - starts
    return MegatronIndex(dtype, starts, lengths, int(tok_ends[-1]))


def prefixes_of(paths: Sequence[str]) -> list[str]:
    """The pair prefixes named by paths to `.bin`, `.idx` or the prefix itself, in first-seen order."""
    out: list[str] = []
    for p in paths:
        prefix = p[:-4] if p.endswith((".bin", ".idx")) else p
        if prefix not in out:
            out.append(prefix)
    return out


def is_megatron_prefix(path: str) -> bool:
    return os.path.isfile(path + ".idx") and os.path.isfile(path + ".bin")


class MegatronIndexedSource(ShardedSource):
    """`.bin`/`.idx` pairs as shards (in the order given; `prefixes` may also name the `.bin` or `.idx` files)."""

    def __init__(self, prefixes: str | Sequence[str], *, empty: str = "error") -> None:
        super().__init__(empty=empty)
        self.prefixes = prefixes_of([prefixes] if isinstance(prefixes, str) else list(prefixes))
        if not self.prefixes:
            raise ValueError("MegatronIndexedSource needs at least one .bin/.idx prefix")
        self.vocab_size = None  # the index records no vocabulary
        self._index: list[MegatronIndex] = []
        self._watch: list[FileWatch] = []
        self.identities: list[str] = []  # what a saved state and the other ranks compare
        for prefix in self.prefixes:
            idx_path, bin_path = prefix + ".idx", prefix + ".bin"
            for p in (idx_path, bin_path):
                if not os.path.isfile(p):
                    raise FileNotFoundError(f"no such file: {p} (a Megatron dataset is a .bin and .idx pair)")
            with open(idx_path, "rb") as f:
                idx_bytes = f.read()
            index = parse_index(idx_bytes, idx_path)
            self._watch.append(FileWatch(bin_path, file_identity))
            size, want = os.path.getsize(bin_path), index.total_tokens * index.dtype.itemsize
            if size != want:
                raise SourceError(
                    f"{bin_path}: {size} bytes, but {idx_path} describes {index.total_tokens} {index.dtype} tokens "
                    f"({want} bytes): {'truncated' if size < want else 'trailing bytes'}, or not this index's data"
                )
            self._watch[-1].check()  # the size checked is the identified file's
            self._index.append(index)
            idx_hash = hashlib.blake2b(idx_bytes, digest_size=12).hexdigest()
            self.identities.append(f"{self._watch[-1].identity}, idx {idx_hash}")
        self._open_shards([p + ".bin" for p in self.prefixes], [len(i.lengths) for i in self._index])

    @property
    def pretokenized(self) -> bool:
        return True

    def _file(self, shard: int) -> int:
        """This process's open descriptor of the shard's `.bin` (opened once, checked to be the file indexed)."""
        cache = self._process_cache()
        f = cache.get(shard)
        if f is None:
            path = self._names[shard]
            if not os.path.exists(path):
                raise changed(path, "it was deleted or renamed")
            f = cache[shard] = open(path, "rb", buffering=0)
            self._watch[shard].check()
        return f.fileno()

    def _tokens(self, shard: int, starts: list[int], lengths: list[int]) -> list[np.ndarray]:
        """The documents' tokens as stored, by plain reads (one per run of documents adjacent in the file), checked
        after reading to come whole from the file the source indexed."""
        index, size = self._index[shard], self._index[shard].dtype.itemsize
        runs: list[list[int]] = []  # [first token, token count] of each read
        where: list[tuple[int, int]] = []  # (read, offset in it) of each document
        for a, n in zip(starts, lengths):
            if not (runs and runs[-1][0] + runs[-1][1] == a):
                runs.append([a, 0])
            where.append((len(runs) - 1, a - runs[-1][0]))
            runs[-1][1] += n
        if not any(n for _, n in runs):
            return [np.zeros(0, index.dtype) for _ in starts]
        fd = self._file(shard)
        blobs = [os.pread(fd, n * size, a * size) for a, n in runs]
        self._watch[shard].check()
        for (a, n), blob in zip(runs, blobs):
            if len(blob) != n * size:  # shorter than indexed although the identity held: still a changed file
                raise changed(self._names[shard], f"bytes {a * size}..{(a + n) * size} are gone (the file is shorter "
                                                  "than when indexed)")
        arrays = [np.frombuffer(blob, dtype=index.dtype) for blob in blobs]
        return [arrays[r][o : o + n] for (r, o), n in zip(where, lengths)]

    def _read_raw(self, shard: int, raw_rows: np.ndarray) -> Iterator[RawDocument]:
        index = self._index[shard]
        stored = self._tokens(shard, index.starts[raw_rows].tolist(), index.lengths[raw_rows].tolist())
        if index.dtype.kind == "i":  # signed files: ids must be in [0, 2^31)
            for r, doc in zip(raw_rows.tolist(), stored):
                if doc.size and (doc.min() < 0 or doc.max() > _I32):
                    pos = int(np.flatnonzero((doc < 0) | (doc > _I32))[0])
                    want = "an id in [0, 2^31)" if index.dtype.itemsize >= 4 else "an id >= 0"
                    raise SourceError(f"{self._location(shard, r)}: token id {int(doc[pos])} at position {pos}, "
                                      f"expected {want}")
        yield from (doc.astype(np.int32) for doc in stored)

    def _raw_lengths(self, shard: int) -> np.ndarray:
        return self._index[shard].lengths

    def _empty_rows(self, shard: int) -> np.ndarray:
        return self._index[shard].lengths == 0

    def _location(self, shard: int, raw_row: int) -> str:
        return f"{self._names[shard]}, document {raw_row}"
