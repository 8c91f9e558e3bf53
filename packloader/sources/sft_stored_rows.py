"""SFT rows from the two stores that hold samples rather than tables: MDS shards and Megatron `.bin`/`.idx` pairs.

An MDS sample is read whole (every column, decoded by mosaicml-streaming's own `decode_sample`), so a shard of
`messages` (a `json` column), of prompt/completion pairs, or of `input_ids` with a mask column (`ndarray`
columns) trains as the same rows would from JSONL. A Megatron pair holds one token array per document and nothing
else, so the mask travels as a second pair of the same shape (`<prefix>_loss_mask.bin/.idx`, 0/1 per token, written
with megatron-core's `IndexedDatasetBuilder` like the tokens); the two must agree document by document.

Object-storage URLs (s3://, gs://, az://, http(s)://, or `Storage(...).paths(...)`) of JSONL or Parquet files are
fetched whole when the source opens (SFT sets are small beside pretraining corpora, and rows need random access);
an MDS prefix is read shard by shard through the storage's block caches, as `MdsSource` reads it.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import numpy as np

from packloader.sources.base import ShardInfo
from packloader.sources.errors import SourceError
from packloader.sources.mds import MdsSource
from packloader.sources.megatron_indexed import MegatronIndexedSource, is_megatron_prefix, prefixes_of
from packloader.sources.sft_row_reader import RowReader

MASK_SUFFIX = "_loss_mask"


def _plain(value: Any) -> Any:
    """Arrays as lists, as the JSONL and Parquet readers give them (the SFT source checks lists of ints)."""
    return value.reshape(-1).tolist() if isinstance(value, np.ndarray) else value


class _WholeSamples(MdsSource):
    """MdsSource's shard access (local or object storage, compressed or not, cached) without its one-column rule."""

    def _check_column(self, k: int, reader) -> None:
        self.column = self.column or reader.column_names[0]  # unused: samples are decoded whole

    @property
    def pretokenized(self) -> bool:
        return True


class MdsRows(RowReader):
    """An MDS directory (the one holding index.json), one shard per MDS shard, samples as dicts of every column."""

    def __init__(self, directory: str, storage=None) -> None:
        self._src = _WholeSamples(directory, storage=storage)
        self.shards = [ShardInfo(s.name, s.num_rows) for s in self._src.shards]

    def location(self, shard: int, row: int) -> str:
        return self._src._location(shard, row)

    def rows(self, shard: int, rows: Sequence[int]) -> list[dict[str, Any]]:
        buf, offsets = self._src._data(shard)
        reader = self._src._readers[shard]
        out = []
        for r in (int(r) for r in rows):
            try:
                sample = reader.decode_sample(bytes(buf[int(offsets[r]):int(offsets[r + 1])]))
            except Exception as e:  # noqa: BLE001 - streaming's decoders raise many kinds; name the sample
                raise SourceError(f"{self.location(shard, r)}: the sample does not decode ({e!r})") from e
            out.append({k: _plain(v) for k, v in sample.items()})
        return out


def is_megatron_spec(data) -> bool:
    paths = [data] if isinstance(data, (str, os.PathLike)) else data
    if not isinstance(paths, (list, tuple)) or not paths or not all(isinstance(p, (str, os.PathLike)) for p in paths):
        return False
    return all(is_megatron_prefix(p) for p in prefixes_of([str(p) for p in paths]))


class MegatronRows(RowReader):
    """Megatron pairs as rows {"input_ids", "loss_mask"}; each tokens pair's mask pair is `<prefix>_loss_mask`.

    Without mask pairs the rows hold `input_ids` only, which trains with loss_on="all"; any other loss_on is refused
    by the SFT source for want of a mask column, naming the row."""

    def __init__(self, prefixes: Sequence[str]) -> None:
        prefixes = [p for p in prefixes_of([str(p) for p in prefixes]) if not p.endswith(MASK_SUFFIX)]
        self._tokens = MegatronIndexedSource(prefixes)
        masked = [is_megatron_prefix(p + MASK_SUFFIX) for p in prefixes]
        if any(masked) and not all(masked):
            p = prefixes[masked.index(False)]
            raise SourceError(f"{p}: no mask pair {p}{MASK_SUFFIX}.bin/.idx, while {prefixes[masked.index(True)]} has "
                              "one: expected a mask pair for every tokens pair, or for none")
        self._masks = MegatronIndexedSource([p + MASK_SUFFIX for p in prefixes]) if all(masked) else None
        if self._masks is not None:
            for k, p in enumerate(prefixes):
                want, got = self._tokens._raw_lengths(k), self._masks._raw_lengths(k)
                if len(want) != len(got) or (want != got).any():
                    at = int(np.flatnonzero(want[:len(got)] != got[:len(want)])[0]) if len(want) == len(got) else \
                        min(len(want), len(got))
                    raise SourceError(f"{p}{MASK_SUFFIX}.idx: {len(got)} documents, document {at} of "
                                      f"{got[at] if at < len(got) else 'none'} tokens; {p}.idx has {len(want)}, document "
                                      f"{at} of {want[at] if at < len(want) else 'none'}: expected one mask value per "
                                      "token")
        self.shards = list(self._tokens.shards)

    def location(self, shard: int, row: int) -> str:
        return self._tokens._location(shard, row)

    def rows(self, shard: int, rows: Sequence[int]) -> list[dict[str, Any]]:
        idx = np.asarray(rows, dtype=np.int64)
        ids = [t.tolist() for t in self._tokens.read(shard, idx)]
        if self._masks is None:
            return [{"input_ids": t} for t in ids]
        return [{"input_ids": t, "loss_mask": m.tolist()} for t, m in zip(ids, self._masks.read(shard, idx))]
