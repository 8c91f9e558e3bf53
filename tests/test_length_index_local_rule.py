"""A local shard's length index is held to the rule its remote reads follow (issue 35, item 5): each page's rows
must be the index's lengths. An index whose lengths were changed and its hash recomputed moved document
boundaries when read locally (only the row group's total was checked); now it is an error naming the file, row
group and page, on every path. The shards are written here with pyarrow and compared with pyarrow's own read."""

from __future__ import annotations

import msgspec
import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from packloader.sources.errors import SourceError
from packloader.sources.length_index import decode, encode, index_name
from packloader.sources.open import open_source
from packloader.sources.parquet import ParquetSource
from packloader.sources.pretokenize import write_index
from packloader.sources.storage import Storage

ROWS = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10], [11, 12, 13, 14, 15], [16, 17]]


def shard(tmp_path, rows_per_page: int):
    p = tmp_path / f"s{rows_per_page}.parquet"
    pq.write_table(pa.table({"tokens": pa.array(ROWS, pa.list_(pa.int32()))}), p, max_rows_per_page=rows_per_page,
                   use_dictionary=False, compression="zstd", write_page_checksum=True, row_group_size=3)
    write_index(str(p))
    return p


def read_local(p):
    src = ParquetSource(p)
    return [d.tolist() for d in src.read(0, np.arange(src.shards[0].num_rows))]


def read_through_filesystem(p, tmp_path):
    src = open_source(Storage(filesystem=pafs.LocalFileSystem(), block_size=0).paths(str(p)))
    return [d.tolist() for d in src.read(0, np.arange(src.shards[0].num_rows))]


def tamper(p, lengths):
    """The index's lengths replaced, its hash recomputed: well-formed, but not the shard's."""
    where = index_name(str(p))
    idx = decode(open(where, "rb").read(), where)
    open(where, "wb").write(encode(msgspec.structs.replace(idx, lengths=np.array(lengths, "<i8").tobytes())))


@pytest.mark.parametrize("rows_per_page", [1, 2])
def test_an_honest_index_reads_what_pyarrow_reads(tmp_path, rows_per_page):
    p = shard(tmp_path, rows_per_page)
    assert read_local(p) == read_through_filesystem(p, tmp_path) == pq.read_table(p).column("tokens").to_pylist() == ROWS


@pytest.mark.parametrize("rows_per_page, lengths", [
    (1, [2, 3, 4, 1, 5, 2]),  # the first two swapped: each row group's total unchanged
    (2, [2, 3, 4, 1, 5, 2]),  # the same inside one page of two rows
    (2, [3, 3, 3, 1, 5, 2]),  # rows 1 and 2 (two pages of one row group) trade a token
])
def test_moved_boundaries_are_refused_on_every_path(tmp_path, rows_per_page, lengths):
    p = shard(tmp_path, rows_per_page)
    tamper(p, lengths)
    assert [len(r) for r in ROWS] != lengths and sum(lengths[:3]) == sum(len(r) for r in ROWS[:3])
    with pytest.raises(SourceError) as local:
        read_local(p)
    assert f"{p.name}: row group 0" in str(local.value)
    assert "its ids and rows disagree with the length index; the index is not this shard's" in str(local.value)
    with pytest.raises(SourceError, match="disagree with the length index; the index is not this shard's"):
        read_through_filesystem(p, tmp_path)


@pytest.mark.parametrize("rows_per_page", [1, 3])
def test_empty_rows_take_the_level_by_level_path(tmp_path, rows_per_page):
    """Pages with an empty row (no value, a definition level below the maximum) are checked level by level: read
    with empty="skip" as pyarrow reads the non-empty rows; a moved boundary next to them is still refused."""
    rows = [[1, 2, 3], [], [4, 5], [6], [], [7, 8, 9, 10]]
    p = tmp_path / "e.parquet"
    pq.write_table(pa.table({"tokens": pa.array(rows, pa.list_(pa.int32()))}), p, max_rows_per_page=rows_per_page,
                   use_dictionary=False, compression="zstd", write_page_checksum=True)
    write_index(str(p))
    src = ParquetSource(p, empty="skip")
    assert [d.tolist() for d in src.read(0, np.arange(src.shards[0].num_rows))] == [r for r in rows if r]
    tamper(p, [2, 0, 3, 1, 0, 4])
    with pytest.raises(SourceError, match="its ids and rows disagree with the length index"):
        src = ParquetSource(p, empty="skip")
        list(src.read(0, np.arange(src.shards[0].num_rows)))
