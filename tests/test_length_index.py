"""Length indexes and page-by-page reads of remote Parquet shards (issue 24, no shared filesystem), through a
filesystem object over local files (`Storage(filesystem=LocalFileSystem())`: the same remote code path as S3, in
one process). References are independent: the documents the test wrote, and pyarrow's own decoding."""

from __future__ import annotations

import os

import msgspec
import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from packloader.sources.base import IterableSource
from packloader.sources.errors import SourceError
from packloader.sources.length_index import LengthIndexError, decode, encode, index_name
from packloader.sources.open import open_source
from packloader.sources.pretokenize import tokenize_to_parquet
from packloader.sources.storage import Storage
from packloader.sources.tokenizers import get_tokenizer


def docs_of(n: int, seed: int, longest: int = 3000) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 50_000, int(rng.integers(1, longest))).astype(np.int32) for _ in range(n)]


def write(path, docs, **kw) -> None:
    t = pa.table({"tokens": pa.array([d.tolist() for d in docs], pa.list_(pa.int32())),
                  "length": pa.array([len(d) for d in docs], pa.int32())})
    pq.write_table(t, path, **({"use_dictionary": False, "row_group_size": 40} | kw))


def local_storage(**kw) -> Storage:
    return Storage(filesystem=pafs.LocalFileSystem(), block_size=0, **kw)


WRITERS = {
    "one document a page (tokenize)": dict(compression="zstd", max_rows_per_page=1, write_page_checksum=True),
    "pyarrow defaults": dict(compression="snappy"),
    "small pages, rows across pages": dict(compression="zstd", data_page_size=2000),
    "data pages v2, 3 rows a page": dict(compression="gzip", data_page_version="2.0", max_rows_per_page=3),
    "uncompressed v2": dict(compression="none", data_page_version="2.0", write_page_checksum=True),
}


@pytest.mark.parametrize("writer", list(WRITERS))
def test_built_index_gives_the_lengths_and_every_document_as_written(tmp_path, writer):
    docs = docs_of(130, 1)
    path = tmp_path / "a.parquet"
    write(path, docs, **WRITERS[writer])
    store = local_storage(index="build", index_dir=str(tmp_path / "idx"))
    src = open_source(store.paths(str(path)))
    assert src._paged[0] is not None
    assert src.lengths(0).tolist() == [len(d) for d in docs]
    rows = np.random.default_rng(2).permutation(len(docs))[:70]
    assert [np.asarray(d).tolist() for d in src.read(0, rows)] == [docs[r].tolist() for r in rows]


def test_a_rank_fetches_only_the_pages_of_its_rows(tmp_path):
    """One document a page: asking for a tenth of the rows fetches those rows' pages and nothing else (bounded by
    the token column's bytes of those rows, computed from a shard written with the same rows alone)."""
    docs = docs_of(200, 3)
    tokenize_dir = tmp_path / "t"
    tokenize_dir.mkdir()
    path = tokenize_dir / "a.parquet"
    write(path, docs, compression="zstd", max_rows_per_page=1, write_page_checksum=True, row_group_size=200)
    from packloader.sources.pretokenize import write_index

    write_index(str(path))
    store = local_storage()
    src = open_source(store.paths(str(path)))
    opened = store.bytes_read  # the footer and the index
    assert src.lengths(0).tolist() == [len(d) for d in docs] and store.bytes_read == opened
    rows = np.arange(0, 200, 10)
    assert [np.asarray(d).tolist() for d in src.read(0, rows)] == [docs[r].tolist() for r in rows]
    token_bytes = pq.read_metadata(path).row_group(0).column(0).total_compressed_size
    fetched = store.bytes_read - opened
    assert 0 < fetched < 0.2 * token_bytes  # about a tenth of the token pages
    assert list(src.read(0, rows[:3])) and store.bytes_read - opened == fetched  # read again: from the cache


def test_tokenize_writes_an_index_beside_each_shard_that_the_remote_reader_uses(tmp_path):
    texts = [f"doc {i} " + "word " * (i * 13 % 200) for i in range(150)]
    out = tmp_path / "t"
    tokenize_to_parquet(IterableSource(texts), get_tokenizer("bytes"), out, row_group_tokens=5000,
                        shard_tokens=40_000, progress=False)
    shards = sorted(str(p) for p in out.glob("part-*.parquet"))
    assert len(shards) > 1 and all(os.path.exists(index_name(s)) for s in shards)
    assert pq.read_metadata(shards[0]).num_row_groups > 1
    local = open_source(str(out))  # the index files are not taken for shards
    assert len(local) == len(texts)
    src = open_source(local_storage(index="use").paths(str(out / "part-*.parquet")))
    assert all(p is not None for p in src._paged)
    got = [bytes(np.asarray(d[:-1], dtype=np.uint8)).decode() for k, s in enumerate(src.shards)
           for d in src.read(k, np.arange(s.num_rows))]
    assert got == texts


def test_a_built_index_is_cached_and_a_rewritten_shard_does_not_use_it(tmp_path):
    path = tmp_path / "a.parquet"
    first, second = docs_of(60, 4), docs_of(60, 5)
    write(path, first)
    idx = str(tmp_path / "idx")
    build = local_storage(index="build", index_dir=idx)
    open_source(build.paths(str(path)))
    assert build.bytes_read >= os.path.getsize(path) * 0.9  # built from one full read
    again = local_storage(index="use", index_dir=idx)
    src = open_source(again.paths(str(path)))
    assert src._paged[0] is not None and again.bytes_read < os.path.getsize(path) * 0.1  # the cached index
    write(path, second)  # a new shard under the same name
    src = open_source(local_storage(index="use", index_dir=idx).paths(str(path)))
    assert src._paged[0] is None  # the old index is keyed by the old content: not used
    src = open_source(local_storage(index="build", index_dir=idx).paths(str(path)))
    assert [np.asarray(d).tolist() for d in src.read(0, np.arange(60))] == [d.tolist() for d in second]
    assert len(os.listdir(idx)) == 2


def test_index_off_and_unpageable_shards_read_whole_row_groups(tmp_path):
    docs = docs_of(50, 6)
    path = tmp_path / "dict.parquet"
    write(path, docs, use_dictionary=True)  # dictionary pages: not decoded page by page
    src = open_source(local_storage(index="build", index_dir=str(tmp_path / "i")).paths(str(path)))
    assert src._paged[0] is None
    assert [np.asarray(d).tolist() for d in src.read(0, np.arange(50))] == [d.tolist() for d in docs]
    with pytest.raises(ValueError, match="index must be"):
        Storage(index="sometimes")


def _beside(tmp_path, docs):
    path = tmp_path / "a.parquet"
    write(path, docs, compression="zstd", max_rows_per_page=1, write_page_checksum=True)
    from packloader.sources.pretokenize import write_index

    return path, write_index(str(path))


def test_a_corrupt_index_is_an_error_naming_it(tmp_path):
    path, index = _beside(tmp_path, docs_of(30, 7))
    raw = bytearray(open(index, "rb").read())
    raw[-5] ^= 0xFF
    open(index, "wb").write(bytes(raw))
    with pytest.raises(LengthIndexError, match=r"_a\.parquet\.index: the length index is corrupt"):
        open_source(local_storage().paths(str(path)))


def test_another_shards_index_is_an_error_naming_both_identities(tmp_path):
    path, index = _beside(tmp_path, docs_of(30, 8))
    write(path, docs_of(30, 9), compression="zstd", max_rows_per_page=1)  # rewritten, its index left behind
    with pytest.raises(LengthIndexError, match=r"_a\.parquet\.index: the length index describes another shard"):
        open_source(local_storage().paths(str(path)))


def test_an_index_whose_lengths_disagree_with_the_pages_is_named_on_read(tmp_path):
    """A well-formed index (its hash recomputed) with two lengths swapped: the pages tell, naming the file."""
    docs = docs_of(30, 10)
    path, index = _beside(tmp_path, docs)
    idx = decode(open(index, "rb").read(), index)
    lengths = idx.length_array().copy()
    lengths[[3, 4]] = lengths[[4, 3]]
    assert lengths[3] != lengths[4]
    open(index, "wb").write(encode(msgspec.structs.replace(idx, lengths=lengths.astype("<i8").tobytes())))
    src = open_source(local_storage().paths(str(path)))
    with pytest.raises(SourceError, match=r"a\.parquet, row group 0, page at byte \d+.*disagree with the length index"):
        list(src.read(0, np.arange(30)))


def test_corrupt_page_bytes_are_named(tmp_path):
    docs = docs_of(30, 11)
    path, _ = _beside(tmp_path, docs)
    meta = pq.read_metadata(path)
    raw = bytearray(path.read_bytes())
    col = meta.row_group(0).column(0)
    raw[col.data_page_offset + col.total_compressed_size // 2] ^= 0xFF
    path.write_bytes(bytes(raw))  # same size, same footer: the identity still matches
    src = open_source(local_storage().paths(str(path)))
    with pytest.raises(SourceError, match=r"a\.parquet, row group 0, page at byte \d+: cannot be read"):
        list(src.read(0, np.arange(30)))


@pytest.mark.parametrize("threads, in_flight", [(1, 64 << 20), (8, 64 << 20), (8, 1)])
def test_concurrent_and_bounded_page_reads_fetch_each_page_once(tmp_path, threads, in_flight):
    """Runs of pages fetched one at a time, eight at once, or one batch per run (a bound of one byte): the same
    documents, and over two requests that cover every row, exactly the token column's bytes (as pyarrow's footer
    states them): every page once, none twice."""
    docs = docs_of(120, 12)
    path = tmp_path / "a.parquet"
    write(path, docs, compression="zstd", max_rows_per_page=1, row_group_size=120)
    from packloader.sources.pretokenize import write_index

    write_index(str(path))
    store = local_storage(fetch_threads=threads, read_ahead_bytes=in_flight, merge_gap_bytes=0)  # exact
    src = open_source(store.paths(str(path)))
    opened = store.bytes_read
    some = np.arange(0, 120, 3)
    rest = np.setdiff1d(np.arange(120), some)
    chunk = pq.read_metadata(path).row_group(0).column(0).total_compressed_size
    assert [np.asarray(d).tolist() for d in src.read(0, some)] == [docs[r].tolist() for r in some]
    assert store.bytes_read - opened < 0.5 * chunk  # a third of the documents: not the whole chunk
    assert [np.asarray(d).tolist() for d in src.read(0, rest)] == [docs[r].tolist() for r in rest]
    assert store.bytes_read - opened == chunk
    with pytest.raises(ValueError, match="fetch_threads"):
        Storage(fetch_threads=0)


def test_tokenize_cli_page_rows(tmp_path):
    """`packloader tokenize` writes one document a page by default and pyarrow's pages with --page-rows 0; both
    with an index beside each shard."""
    import json

    from packloader.cli.main import main
    from packloader.sources.length_index import decode

    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"text": f"document {i} " + "abc " * i}) + "\n" for i in range(40)))
    pages = {}
    for rows in ("1", "0"):
        out = tmp_path / f"out{rows}"
        assert main(["tokenize", str(src), "--out", str(out), "--tokenizer", "bytes", "--no-progress",
                     "--page-rows", rows]) == 0
        index = index_name(str(out / "part-00000.parquet"))
        idx = decode(open(index, "rb").read(), index)
        pages[rows] = sum(len(idx.page_array(g)) for g in range(len(idx.group_rows)))
    assert pages == {"1": 40, "0": 1}
    assert main(["tokenize", str(src), "--out", str(tmp_path / "o"), "--page-rows", "-1", "--no-progress"]) == 2


def test_prefetch_fetches_several_shards_pages_for_the_reads_that_follow(tmp_path):
    shards = [docs_of(30, 20 + k) for k in range(3)]
    paths = []
    for k, docs in enumerate(shards):
        path = tmp_path / f"s{k}.parquet"
        write(path, docs, compression="zstd", max_rows_per_page=1)
        from packloader.sources.pretokenize import write_index

        write_index(str(path))
        paths.append(str(path))
    store = local_storage()
    src = open_source(store.paths(*paths))
    rows = {k: np.arange(k, 30, 4) for k in range(3)}
    src.prefetch(rows)
    fetched, requests = store.bytes_read, store.requests
    got = {k: [np.asarray(d).tolist() for d in src.read(k, r)] for k, r in rows.items()}
    assert got == {k: [shards[k][i].tolist() for i in r] for k, r in rows.items()}
    assert (store.bytes_read, store.requests) == (fetched, requests)  # every page came from the prefetch


@pytest.mark.parametrize("gap", [0, 3000, 20_000, 1 << 30])
def test_merged_gaps_read_the_same_documents_for_bounded_extra_bytes(tmp_path, gap):
    """Runs of a quarter of the pages at most `gap` bytes apart are fetched by one read each: the same documents
    as written; every request saved costs at most `gap` more bytes than exact ranges, and all of them together at
    most MERGE_SHARE more. Every document but one in the middle: with a gap above that page's bytes, one read of
    the whole column chunk (as the footer states its bytes); exact, two reads of less."""
    from packloader.sources.parquet_ranged import MERGE_SHARE
    from packloader.sources.pretokenize import write_index

    docs = docs_of(120, 13)
    path = tmp_path / "a.parquet"
    write(path, docs, compression="zstd", max_rows_per_page=1, row_group_size=120, write_page_checksum=True)
    write_index(str(path))
    chunk = pq.read_metadata(path).row_group(0).column(0).total_compressed_size

    def fetch(rows, merge):
        store = local_storage(merge_gap_bytes=merge)
        src = open_source(store.paths(str(path)))
        b, r = store.bytes_read, store.requests
        got = [np.asarray(d).tolist() for d in src.read(0, rows)]
        assert got == [docs[i].tolist() for i in rows]
        return store.bytes_read - b, store.requests - r

    rows = np.sort(np.random.default_rng(3).permutation(120)[:30])
    (exact, exact_reqs), (merged, reqs) = fetch(rows, 0), fetch(rows, gap)
    assert reqs <= exact_reqs and exact <= merged <= min(exact + (exact_reqs - reqs) * gap,
                                                         (1 + MERGE_SHARE) * exact)
    if gap == 0:
        assert merged == exact
    if gap == 1 << 30:
        assert reqs < exact_reqs
    but_one = np.setdiff1d(np.arange(120), [60])
    assert fetch(but_one, 1 << 30) == (chunk, 1)
    apart = fetch(but_one, 0)
    assert apart[1] == 2 and apart[0] < chunk
    with pytest.raises(ValueError, match="merge_gap_bytes"):
        Storage(merge_gap_bytes=-1)
