"""Local token shards decoded a row group at a time through the length index beside them (`parquet_chunk.py`):
the documents as written, for several writers' page layouts; pyarrow still reads what the index does not cover;
corrupt pages, stale and old indexes. References are the documents the test wrote, never the code under test."""

from __future__ import annotations

import logging

import msgspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from packloader.sources.errors import SourceError
from packloader.sources.length_index import decode, encode
from packloader.sources.parquet import ParquetSource
from packloader.sources.pretokenize import write_index


def docs_of(n: int, seed: int, longest: int = 2000) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 50_000, int(rng.integers(1, longest))).astype(np.int32) for _ in range(n)]


def write(path, docs, **kw):
    t = pa.table({"tokens": pa.array([d.tolist() for d in docs], pa.list_(pa.int32())),
                  "length": pa.array([len(d) for d in docs], pa.int32())})
    pq.write_table(t, path, **({"use_dictionary": False, "row_group_size": 45} | kw))
    return write_index(str(path))


def no_pyarrow_reads(monkeypatch) -> None:
    """Fail any row group pyarrow is asked to decode: what follows must come through the index."""
    def refuse(*a, **k):
        raise AssertionError("pyarrow decoded a row group")
    monkeypatch.setattr(pq.ParquetFile, "read_row_group", refuse)


WRITERS = {
    "one document a page, zstd, checksums (tokenize)": dict(compression="zstd", max_rows_per_page=1,
                                                           write_page_checksum=True),
    "1 MiB pages, zstd (tokenize --page-rows 0)": dict(compression="zstd", write_page_checksum=True),
    "small pages, rows across pages, snappy": dict(compression="snappy", data_page_size=1500),
    "3 rows a page, gzip": dict(compression="gzip", max_rows_per_page=3),
    "uncompressed, one row group": dict(compression="none", row_group_size=1000),
}


@pytest.mark.parametrize("writer", list(WRITERS))
def test_local_shards_with_an_index_read_every_document_as_written_without_pyarrow(tmp_path, writer,
                                                                                  monkeypatch):
    docs = docs_of(130, 1)
    path = tmp_path / "a.parquet"
    write(path, docs, **WRITERS[writer])
    src = ParquetSource(str(path))
    assert src._local[0] is not None
    no_pyarrow_reads(monkeypatch)
    assert src.lengths(0).tolist() == [len(d) for d in docs]
    rows = np.random.default_rng(2).permutation(len(docs))
    assert [np.asarray(d).tolist() for d in src.read(0, rows)] == [docs[r].tolist() for r in rows]


def test_several_shards_decoded_ahead_at_once_give_each_shards_documents(tmp_path, monkeypatch):
    shards = [docs_of(60, 10 + k) for k in range(3)]
    paths = []
    for k, docs in enumerate(shards):
        paths.append(str(tmp_path / f"s{k}.parquet"))
        write(paths[-1], docs, compression="zstd", max_rows_per_page=1, row_group_size=20)
    src = ParquetSource(paths, decode_threads=2)
    no_pyarrow_reads(monkeypatch)
    rows = {k: np.arange(k, 60, 3) for k in range(3)}
    src.prefetch(rows)
    blocks = src._blocks()  # every row group these rows touch, decoded before the reads:
    assert all(blocks.get((k, g)) is not None for k in range(3) for g in range(3))
    got = {k: [np.asarray(d).tolist() for d in src.read(k, r)] for k, r in rows.items()}
    assert got == {k: [shards[k][i].tolist() for i in r] for k, r in rows.items()}


def test_data_pages_v2_are_left_to_pyarrow(tmp_path):
    docs = docs_of(50, 3)
    path = tmp_path / "v2.parquet"
    write(path, docs, compression="zstd", data_page_version="2.0", max_rows_per_page=2)
    calls = []
    real = pq.ParquetFile.read_row_group
    src = ParquetSource(str(path))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pq.ParquetFile, "read_row_group", lambda self, *a, **k: calls.append(a) or real(self, *a, **k))
        assert [np.asarray(d).tolist() for d in src.read(0, np.arange(50))] == [d.tolist() for d in docs]
    assert calls  # pyarrow decoded them


def test_a_corrupt_page_is_named_with_its_row_group(tmp_path):
    docs = docs_of(90, 4)
    path = tmp_path / "a.parquet"
    write(path, docs, compression="zstd", max_rows_per_page=1, write_page_checksum=True)
    meta = pq.read_metadata(path)
    col = meta.row_group(1).column(0)
    raw = bytearray(path.read_bytes())
    raw[col.data_page_offset + col.total_compressed_size // 2] ^= 0x10
    path.write_bytes(bytes(raw))  # same size and footer: the index still matches
    src = ParquetSource(str(path))
    assert src._local[0] is not None
    src.read(0, np.arange(0, 45))  # row group 0 is intact
    with pytest.raises(SourceError, match=r"a\.parquet: row group 1 \(rows 45\.\.89\), column 'tokens': cannot be "
                                          r"read, the file is corrupt.*(CRC checksum|page at byte)"):
        list(src.read(0, np.arange(45, 90)))


def test_ids_beyond_the_vocabulary_are_named_by_row(tmp_path):
    docs = [np.array([1, 2, 3], np.int32), np.array([4, 70_000, 5], np.int32)]
    path = tmp_path / "a.parquet"
    write(path, docs, compression="zstd", max_rows_per_page=1)
    src = ParquetSource(str(path), vocab_size=65_536)
    with pytest.raises(SourceError, match=r"a\.parquet, row 1, column 'tokens': token id 70000 at position 1"):
        list(src.read(0, np.arange(2)))


def test_a_stale_or_old_index_beside_a_local_shard_is_not_used(tmp_path, caplog):
    """A local shard rewritten after its index: the index is logged as not used and pyarrow reads the new
    documents; an index from before page bodies were recorded is not used either."""
    path = tmp_path / "a.parquet"
    index = write(path, docs_of(40, 5), compression="zstd", max_rows_per_page=1)
    stale = open(index, "rb").read()
    second = docs_of(40, 6)
    write(path, second, compression="zstd", max_rows_per_page=1)
    open(index, "wb").write(stale)
    with caplog.at_level(logging.WARNING, logger="packloader"):
        src = ParquetSource(str(path))
    assert src._local[0] is None and "length index not used" in caplog.text
    assert [np.asarray(d).tolist() for d in src.read(0, np.arange(40))] == [d.tolist() for d in second]
    write(path, second, compression="zstd", max_rows_per_page=1)
    idx = decode(open(index, "rb").read(), index)
    open(index, "wb").write(encode(msgspec.structs.replace(idx, bodies=[])))
    src = ParquetSource(str(path))
    assert src._local[0] is None
    assert [np.asarray(d).tolist() for d in src.read(0, np.arange(40))] == [d.tolist() for d in second]


def test_overwritten_bytes_in_an_indexed_shard_never_yield_changed_tokens(tmp_path):
    """16 random bytes overwritten anywhere in a shard with one document a page, CRCs and its index beside it,
    30 times: each read fails naming the file, or yields exactly the documents written (bytes in page headers,
    which the index stands in for, or in statistics the reader never uses)."""
    import random

    docs = docs_of(80, 7, longest=600)
    good = tmp_path / "good.parquet"
    index = write(good, docs, compression="zstd", max_rows_per_page=1, write_page_checksum=True, row_group_size=40)
    data, idx = good.read_bytes(), open(index, "rb").read()
    outcomes = {"error": 0, "unchanged": 0}
    for trial in range(30):
        rnd = random.Random(500 + trial)
        b = bytearray(data)
        off = rnd.randrange(4, len(data) - 16)
        b[off:off + 16] = bytes(rnd.randrange(256) for _ in range(16))
        p = tmp_path / f"c{trial}.parquet"
        p.write_bytes(bytes(b))
        (tmp_path / f"_c{trial}.parquet.index").write_bytes(idx)
        try:
            got = [np.asarray(d) for d in ParquetSource(str(p)).read(0, np.arange(80))]
        except SourceError as e:
            assert p.name in str(e)
            outcomes["error"] += 1
            continue
        assert [d.tolist() for d in got] == [d.tolist() for d in docs], f"offset {off}"
        outcomes["unchanged"] += 1
    assert outcomes["error"] >= 20, outcomes  # most of the shard is page data, and every page is checked
