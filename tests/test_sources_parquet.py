"""ParquetSource on small real files: random-order reads against pyarrow, row-group reuse, and every bad input."""

import pickle

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from packloader.sources.errors import EmptyDocumentError, NonUtf8Error, SourceError
from packloader.sources.parquet import ParquetSource

RNG = np.random.default_rng(7)


def _texts(n, seed=0):
    rng = np.random.default_rng(seed)
    return [f"doc {seed}-{i} " + "é漢字 word " * int(rng.integers(1, 30)) for i in range(n)]


def _token_lists(n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 50_000, size=int(rng.integers(1, 200))).astype(np.int32) for _ in range(n)]


def _write_tokens(path, docs, *, large=False, value_type=pa.int32(), length=True, row_group_size=37):
    lengths = np.array([len(d) for d in docs], dtype=np.int64)
    offsets = np.concatenate(([0], np.cumsum(lengths)))
    values = pa.array(np.concatenate(docs)).cast(value_type)
    if large:
        arr = pa.LargeListArray.from_arrays(pa.array(offsets), values)
    else:
        arr = pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), values)
    cols = {"tokens": arr}
    if length:
        cols["length"] = pa.array(lengths.astype(np.int32))
    pq.write_table(pa.table(cols), path, row_group_size=row_group_size)


def test_text_shards_random_order_match_pyarrow(tmp_path):
    paths = []
    for k, n in enumerate([300, 1, 157]):
        p = tmp_path / f"part-{k}.parquet"
        pq.write_table(pa.table({"id": np.arange(n), "text": _texts(n, k)}), p, row_group_size=23)
        paths.append(p)
    src = ParquetSource(list(reversed(paths)))  # shards are the sorted paths
    assert [s.name for s in src.shards] == [str(p) for p in paths]
    assert [s.num_rows for s in src.shards] == [300, 1, 157]
    assert not src.pretokenized and src.lengths(0) is None
    for shard, p in enumerate(paths):
        ref = pq.read_table(p).column("text").to_pylist()
        rows = RNG.permutation(len(ref))
        assert list(src.read(shard, rows)) == [ref[r] for r in rows]
    # repeated and arbitrary subsets, across calls that reuse the cache
    rows = np.array([5, 5, 299, 0, 150, 5])
    ref = pq.read_table(paths[0]).column("text").to_pylist()
    assert list(src.read(0, rows)) == [ref[r] for r in rows]
    assert list(src.read(0, np.array([], dtype=np.int64))) == []


def test_large_string_and_explicit_column(tmp_path):
    p = tmp_path / "a.parquet"
    texts = _texts(50)
    pq.write_table(pa.table({"body": pa.array(texts, pa.large_string()), "text": pa.array(np.arange(50))}), p)
    src = ParquetSource(p, column="body")
    assert list(src.read(0, np.arange(50)[::-1])) == texts[::-1]


def test_token_shards_with_lengths(tmp_path):
    docs = _token_lists(200)
    p = tmp_path / "tok.parquet"
    _write_tokens(p, docs)
    src = ParquetSource(p)
    assert src.pretokenized and src.column == "tokens" and src.length_column == "length"
    np.testing.assert_array_equal(src.lengths(0), [len(d) for d in docs])
    ref = pq.read_table(p).column("tokens").to_pylist()
    rows = RNG.permutation(200)
    out = list(src.read(0, rows))
    assert all(o.dtype == np.int32 for o in out)
    assert [o.tolist() for o in out] == [ref[r] for r in rows]
    out[0][:] = -1  # documents are copies: writing to one leaves the source's data alone
    assert list(src.read(0, rows[:1]))[0].tolist() == ref[rows[0]]


def test_large_list_of_int64_is_cast(tmp_path):
    docs = _token_lists(40, seed=3)
    p = tmp_path / "tok.parquet"
    _write_tokens(p, docs, large=True, value_type=pa.int64(), length=False)
    src = ParquetSource(p)
    assert src.pretokenized and src.lengths(0) is None
    rows = RNG.permutation(40)
    assert [o.tolist() for o in src.read(0, rows)] == [docs[r].tolist() for r in rows]


def test_each_row_group_decoded_once_per_read(tmp_path, monkeypatch):
    p = tmp_path / "t.parquet"
    pq.write_table(pa.table({"text": _texts(1000)}), p, row_group_size=64)  # 16 row groups
    calls = []
    original = pq.ParquetFile.read_row_group

    def counting(self, i, *args, **kwargs):
        calls.append(i)
        return original(self, i, *args, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", counting)
    src = ParquetSource(p, cache_bytes=0)  # the cache keeps only the current row group
    rows = RNG.permutation(1000)
    out = list(src.read(0, rows))
    assert len(out) == 1000
    assert sorted(calls) == list(range(16))
    calls.clear()
    list(src.read(0, np.arange(64, 128)))  # sequential rows of one group: one decode ...
    list(src.read(0, np.arange(64, 128)[::-1]))  # ... then served from the cache
    assert calls == [1]


def test_pickled_source_reads_the_same(tmp_path):
    p = tmp_path / "t.parquet"
    texts = _texts(20)
    pq.write_table(pa.table({"text": texts}), p)
    src = ParquetSource(p)
    list(src.read(0, [1]))  # warm the cache; it must not travel
    clone = pickle.loads(pickle.dumps(src))
    assert list(clone.read(0, [3, 2])) == [texts[3], texts[2]]


# --- bad input --------------------------------------------------------------------------------------------------


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.parquet"):
        ParquetSource(tmp_path / "nope.parquet")


def test_corrupt_file_names_it(tmp_path):
    p = tmp_path / "broken.parquet"
    p.write_bytes(b"this is not parquet at all" * 10)
    with pytest.raises(SourceError, match=r"broken\.parquet: not a readable Parquet file"):
        ParquetSource(p)


def test_wrong_column_type(tmp_path):
    p = tmp_path / "ints.parquet"
    pq.write_table(pa.table({"text": pa.array([1, 2, 3])}), p)
    with pytest.raises(SourceError, match=r"ints\.parquet, column 'text': type int64, expected string"):
        ParquetSource(p)
    q = tmp_path / "floats.parquet"
    pq.write_table(pa.table({"tokens": pa.array([[1.0, 2.0]])}), q)
    with pytest.raises(SourceError, match=r"floats\.parquet, column 'tokens': type list<element: double>"):
        ParquetSource(q)


def test_missing_column(tmp_path):
    p = tmp_path / "a.parquet"
    pq.write_table(pa.table({"body": ["x"]}), p)
    with pytest.raises(SourceError, match=r"a\.parquet: no column 'text'; the file has columns \['body'\]"):
        ParquetSource(p, column="text")
    with pytest.raises(SourceError, match=r"a\.parquet: no text or token column found among \['body'\]"):
        ParquetSource(p)


def test_shards_disagreeing_on_kind(tmp_path):
    pq.write_table(pa.table({"x": ["text"]}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"x": pa.array([[1, 2]], pa.list_(pa.int32()))}), tmp_path / "b.parquet")
    with pytest.raises(SourceError, match=r"b\.parquet, column 'x'.*all shards must agree"):
        ParquetSource([tmp_path / "a.parquet", tmp_path / "b.parquet"], column="x")


def test_null_text_names_row(tmp_path):
    p = tmp_path / "nulls.parquet"
    pq.write_table(pa.table({"text": ["a", "b", None, "d"]}), p, row_group_size=2)
    src = ParquetSource(p)
    assert list(src.read(0, [1, 0])) == ["b", "a"]
    with pytest.raises(SourceError, match=r"nulls\.parquet, row 2, column 'text': null"):
        list(src.read(0, [3]))


def test_null_token_id_names_row(tmp_path):
    p = tmp_path / "nulltok.parquet"
    pq.write_table(pa.table({"tokens": pa.array([[1, 2], [3], [4, None]], pa.list_(pa.int32()))}), p)
    with pytest.raises(SourceError, match=r"nulltok\.parquet, row 2, column 'tokens': null token id"):
        list(ParquetSource(p).read(0, [0]))


def test_token_ids_beyond_int32(tmp_path):
    p = tmp_path / "big.parquet"
    pq.write_table(pa.table({"tokens": pa.array([[1, 2**40]], pa.list_(pa.int64()))}), p)
    with pytest.raises(SourceError, match=r"big\.parquet, column 'tokens': token ids do not fit int32"):
        list(ParquetSource(p).read(0, [0]))


def test_length_column_that_lies(tmp_path):
    p = tmp_path / "lie.parquet"
    tokens = pa.array([[1, 2], [3, 4, 5]], pa.list_(pa.int32()))
    pq.write_table(pa.table({"tokens": tokens, "length": pa.array([2, 7], pa.int32())}), p)
    with pytest.raises(SourceError, match=r"lie\.parquet, row 1, column 'length': says 7 tokens.*holds 3"):
        list(ParquetSource(p).read(0, [0]))


def test_non_utf8_text_names_row(tmp_path):
    p = tmp_path / "latin1.parquet"
    raw = pa.array([b"fine", "café".encode("latin-1"), b"ok"], pa.binary()).view(pa.string())
    pq.write_table(pa.table({"text": raw}), p)
    src = ParquetSource(p)
    assert list(src.read(0, [2, 0])) == ["ok", "fine"]
    with pytest.raises(NonUtf8Error, match=r"latin1\.parquet, row 1, column 'text': text is not valid UTF-8"):
        list(src.read(0, [0, 1]))


def test_empty_documents_error_or_skip(tmp_path):
    p = tmp_path / "e.parquet"
    texts = ["a", "", "c", "", "e"]
    pq.write_table(pa.table({"text": texts}), p, row_group_size=2)
    src = ParquetSource(p)
    with pytest.raises(EmptyDocumentError, match=r"e\.parquet, row 1: empty document.*empty='skip'"):
        list(src.read(0, np.arange(5)))
    skipping = ParquetSource(p, empty="skip")
    assert skipping.shards[0].num_rows == 3
    assert skipping.skipped["empty documents"] == 2
    assert "e.parquet, row 1" in skipping.skipped.examples[0]
    assert list(skipping.read(0, [2, 0, 1])) == ["e", "a", "c"]
    assert [skipping.raw_row(0, r) for r in range(3)] == [0, 2, 4]

    q = tmp_path / "et.parquet"
    _write_tokens(q, [np.array([1], np.int32), np.zeros(0, np.int32), np.array([2, 3], np.int32)])
    toks = ParquetSource(q, empty="skip")
    np.testing.assert_array_equal(toks.lengths(0), [1, 2])
    assert [d.tolist() for d in toks.read(0, [1, 0])] == [[2, 3], [1]]
    with pytest.raises(EmptyDocumentError, match=r"et\.parquet, row 1: empty document \(no tokens\)"):
        list(ParquetSource(q).read(0, [1]))


def test_row_out_of_range(tmp_path):
    p = tmp_path / "a.parquet"
    pq.write_table(pa.table({"text": ["x", "y"]}), p)
    src = ParquetSource(p)
    with pytest.raises(IndexError, match=r"a\.parquet: row 2 out of range; the shard has 2 rows"):
        list(src.read(0, [0, 2]))
    with pytest.raises(IndexError, match="shard 1 does not exist"):
        list(src.read(1, [0]))


_FORKED = None


def _read_forked(rows):
    return list(_FORKED.read(0, np.asarray(rows)))


@pytest.mark.multiprocess
def test_threads_and_forked_workers_read_the_same(tmp_path):
    import multiprocessing
    from concurrent.futures import ThreadPoolExecutor

    global _FORKED
    p = tmp_path / "t.parquet"
    texts = _texts(500)
    pq.write_table(pa.table({"text": texts}), p, row_group_size=16)
    _FORKED = src = ParquetSource(p, cache_bytes=4096)
    list(src.read(0, [0]))  # the parent holds an open file and a decoded row group when it forks
    chunks = [RNG.permutation(500)[:200] for _ in range(8)]
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda rows: list(src.read(0, rows)), chunks))
    assert results == [[texts[r] for r in rows] for rows in chunks]
    with multiprocessing.get_context("fork").Pool(2) as pool:
        results = pool.map(_read_forked, [rows.tolist() for rows in chunks[:4]])
    assert results == [[texts[r] for r in rows] for rows in chunks[:4]]


def test_token_ids_checked_against_the_vocabulary(tmp_path):
    """The bound comes from the argument, else the metadata `packloader tokenize` writes; the error names the row."""
    p = tmp_path / "v.parquet"
    _write_tokens(p, [np.array([0, 5], np.int32), np.array([7, 9, 3], np.int32)], row_group_size=1)
    assert ParquetSource(p).vocab_size is None
    assert [d.tolist() for d in ParquetSource(p, vocab_size=10).read(0, [0, 1])] == [[0, 5], [7, 9, 3]]
    src = ParquetSource(p, vocab_size=9)
    assert list(src.read(0, [0]))[0].tolist() == [0, 5]  # row group 0 holds only in-range ids
    with pytest.raises(SourceError, match=r"v\.parquet, row 1, column 'tokens': token id 9 at position 1, "
                                          r"expected an id in \[0, 9\), the vocabulary"):
        list(src.read(0, [1]))
    table = pq.read_table(p).replace_schema_metadata({"packloader.vocab_size": "8"})
    pq.write_table(table, tmp_path / "m.parquet")
    assert ParquetSource(tmp_path / "m.parquet").vocab_size == 8
    with pytest.raises(SourceError, match=r"m\.parquet, row 1, .*token id 9 .*\[0, 8\)"):
        list(ParquetSource(tmp_path / "m.parquet").read(0, [0, 1]))
    with pytest.raises(ValueError, match="vocab_size must be >= 1"):
        ParquetSource(p, vocab_size=0)


def test_empty_token_row_in_a_length_column_is_refused_like_one_read(tmp_path):
    """lengths() sees the 0 before any token is read; the error is the one read() gives for that row."""
    q = tmp_path / "ez.parquet"
    _write_tokens(q, [np.array([1], np.int32), np.array([2], np.int32), np.zeros(0, np.int32)])
    src = ParquetSource(q)
    with pytest.raises(EmptyDocumentError, match=r"ez\.parquet, row 2: empty document \(no tokens\)") as by_length:
        src.lengths(0)
    with pytest.raises(EmptyDocumentError) as by_read:
        list(src.read(0, [2]))
    assert str(by_length.value) == str(by_read.value)


def test_written_checksums_are_verified(tmp_path):
    """A page of a checksummed file whose bytes change fails; the same bytes read with verification off do not."""
    p = tmp_path / "crc.parquet"
    docs = _token_lists(40)
    table = pa.table({"tokens": pa.array([d.tolist() for d in docs], pa.list_(pa.int32()))})
    pq.write_table(table, p, compression="snappy", use_dictionary=False, write_page_checksum=True)
    col = pq.ParquetFile(p).metadata.row_group(0).column(0)
    data = bytearray(p.read_bytes())
    end = col.data_page_offset + col.total_compressed_size
    data[end - 40] ^= 0x01  # a low bit of a value near the end of the page
    bad = tmp_path / "crc-bad.parquet"
    bad.write_bytes(bytes(data))
    pq.ParquetFile(bad, page_checksum_verification=False).read()  # decodes: only the checksum can tell
    with pytest.raises(SourceError, match=r"crc-bad\.parquet: row group 0 \(rows 0\.\.39\), column 'tokens': "
                                          r"cannot be read.*CRC"):
        list(ParquetSource(bad).read(0, [0]))
