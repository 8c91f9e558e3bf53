"""The disk cache keys a block by everything that shapes its bytes (issue 35, item 6): object, version, size and
the byte range, so a restart with another `block_size` over the same cache directory reads the shards it read
before, instead of taking a cached block of the old size for a new one (healthy shards were reported corrupt:
"no footer at its end", "File too short"). The reference is each shard's bytes and pyarrow's read of it."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from packloader.sources.open import open_source
from packloader.sources.remote import ObjectInfo, RemoteFile
from packloader.sources.remote_cache import BlockCache
from packloader.sources.storage import Storage

ROWS = [np.arange(i % 700 + 1, dtype=np.int32).tolist() for i in range(300)]


def shards(tmp_path):
    pq.write_table(pa.table({"tokens": pa.array(ROWS, pa.list_(pa.int32()))}), tmp_path / "a.parquet",
                   row_group_size=60)
    with open(tmp_path / "b.jsonl", "w") as f:
        for r in ROWS:
            f.write(json.dumps({"tokens": r}) + "\n")
    return [str(tmp_path / "a.parquet"), str(tmp_path / "b.jsonl")]


def read(paths, cache_dir, block_size):
    storage = Storage(filesystem=pafs.LocalFileSystem(), block_size=block_size, cache_dir=str(cache_dir),
                      cache_bytes=1 << 30, index="off")
    out = []
    for path in paths:  # one source a format
        src = open_source(storage.paths(path))
        out.append([d.tolist() for d in src.read(0, np.arange(src.shards[0].num_rows))])
    return out


@pytest.mark.parametrize("sizes", [(64 << 10, 4 << 10), (4 << 10, 64 << 10), (5000, 0), (0, 3000)])
def test_a_restart_with_another_block_size_reads_the_same_documents(tmp_path, sizes):
    paths = shards(tmp_path)
    assert pq.read_table(paths[0]).column("tokens").to_pylist() == ROWS
    for block_size in sizes:  # the second run finds the first one's blocks in the cache directory
        assert read(paths, tmp_path / "cache", block_size) == [ROWS, ROWS]


class Counting:
    """A store over one local file that counts its ranged reads."""

    def __init__(self, data: bytes) -> None:
        self.data, self.requests = data, 0

    def get_range(self, info, a, b):
        self.requests += 1
        return self.data[a:b]


def test_same_block_size_still_hits_and_each_range_is_the_files(tmp_path):
    data = bytes(range(256)) * 100
    info = ObjectInfo("mem://x", len(data), "v1")
    cache = BlockCache(str(tmp_path / "c"), 1 << 20)
    for block_size in (1000, 1000, 768, 0):
        store = Counting(data)
        f = RemoteFile(store, info, block_size, cache)
        assert f.pread(5000, 1234) == data[1234:6234]
        assert f.pread(10**6, len(data) - 10) == data[-10:]
        if block_size == 1000 and cache.hits:  # the second pass at 1000: every block from the disk cache
            assert store.requests == 0
