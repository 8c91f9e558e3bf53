"""MDS directories in object storage (moto_server on the loopback): written by streaming's own MDSWriter, uploaded,
read through packloader's ranged reads and disk cache. The expected samples are the ones the test wrote."""

# ruff: noqa: F811 (the moto and s3 fixtures, imported from tests/helpers/s3_fixtures.py)
from __future__ import annotations

import os
import pickle

import numpy as np
import pytest
from helpers.s3_fixtures import FAST, moto, s3  # noqa: F401 (fixtures)
from helpers.source_resume import check_exact_resume, check_exactly_once, small_config

from packloader import PackedLoader
from packloader.sources.errors import SourceError
from packloader.sources.identity import ShardChanged
from packloader.sources.mds import MdsSource
from packloader.sources.open import open_source
from packloader.sources.storage import Storage

pytest.importorskip("streaming")
pytestmark = pytest.mark.multiprocess  # starts moto_server


def token_samples(n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 1000, int(rng.integers(1, 300))).astype(np.int32) for _ in range(n)]


def upload_mds(tmp_path, s3, prefix: str, docs, compression=None) -> str:
    """MDSWriter's shards (several: a small size limit), uploaded object by object; the directory's URL."""
    from streaming import MDSWriter

    out = tmp_path / prefix
    with MDSWriter(out=str(out), columns={"tokens": "ndarray:int32", "id": "int"}, size_limit=4096,
                   compression=compression) as w:
        for i, d in enumerate(docs):
            w.write({"tokens": d, "id": i})
    client, bucket = s3
    for name in sorted(os.listdir(out)):
        client.put_object(Bucket=bucket, Key=f"{prefix}/{name}", Body=(out / name).read_bytes())
    return f"s3://{bucket}/{prefix}"


def read_every_shard(src) -> list[list[int]]:
    out = []
    for k, s in enumerate(src.shards):
        out += [np.asarray(d).tolist() for d in src.read(k, np.arange(s.num_rows))]
    return out


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_mds_from_s3_reads_every_sample_in_order(tmp_path, s3, compression):
    docs = token_samples(120, 1)
    url = upload_mds(tmp_path, s3, "m", docs, compression)
    for given in (url, url + "/", url + "/index.json"):
        src = open_source(given)
        assert isinstance(src, MdsSource) and len(src.shards) > 2
        assert read_every_shard(src) == [d.tolist() for d in docs]
    assert all(i and i.count(":") == 1 for i in src.identities)  # size and ETag of each shard object
    assert read_every_shard(pickle.loads(pickle.dumps(src))) == [d.tolist() for d in docs]


def test_mds_loader_trains_every_token_once_and_resumes_exactly(tmp_path, s3):
    docs = token_samples(90, 2)
    url = upload_mds(tmp_path, s3, "r", docs)
    check_exactly_once(PackedLoader(url, config=small_config(), tokenizer=None, num_threads=1), docs)
    check_exact_resume(lambda: PackedLoader(url, config=small_config(), tokenizer=None, num_threads=2), stop=5)


def test_mds_shards_come_from_the_disk_cache_the_second_time(tmp_path, s3):
    docs = token_samples(60, 3)
    url = upload_mds(tmp_path, s3, "c", docs)
    cache = dict(cache_dir=str(tmp_path / "cache"), cache_bytes=64 << 20, block_size=1 << 20, retry=FAST)
    first = Storage(**cache)
    assert read_every_shard(open_source(first.paths(url))) == [d.tolist() for d in docs]
    total = sum(o["Size"] for o in s3[0].list_objects_v2(Bucket=s3[1], Prefix="c/")["Contents"])
    assert 0 < first.bytes_read <= total  # each object fetched once, never twice
    again = Storage(**cache)  # a restart: a fresh process's storage on the same cache directory
    assert read_every_shard(open_source(again.paths(url))) == [d.tolist() for d in docs]
    assert again.bytes_read == 0


def test_mds_shard_replaced_is_refused_naming_it(tmp_path, s3):
    docs = token_samples(60, 4)
    url = upload_mds(tmp_path, s3, "x", docs)
    loader = PackedLoader(url, config=small_config(), tokenizer=None, num_threads=1)
    next(iter(loader))
    state = pickle.loads(pickle.dumps(loader.state_dict()))
    src = open_source(Storage(retry=FAST).paths(url))
    body = s3[0].get_object(Bucket=s3[1], Key="x/shard.00001.mds")["Body"].read()
    s3[0].put_object(Bucket=s3[1], Key="x/shard.00001.mds", Body=body[:-1] + bytes([body[-1] ^ 1]))
    with pytest.raises(ShardChanged, match=rf"{url}/shard.00001.mds: the object changed"):
        list(src.read(1, np.arange(src.shards[1].num_rows)))  # opened before the rewrite: refused mid-epoch
    fresh = PackedLoader(url, config=small_config(), tokenizer=None, num_threads=1)
    with pytest.raises(ValueError, match="shard.00001.mds"):
        fresh.load_state_dict(state)  # a saved state of the old object


def test_mds_missing_index_or_shard_names_the_url(tmp_path, s3):
    url = upload_mds(tmp_path, s3, "g", token_samples(40, 5))
    with pytest.raises(FileNotFoundError, match=rf"{url}/none/index.json"):
        open_source(url + "/none", format="mds")
    s3[0].delete_object(Bucket=s3[1], Key="g/shard.00000.mds")
    src = open_source(url)
    with pytest.raises((FileNotFoundError, SourceError), match=rf"{url}/shard.00000.mds"):
        list(src.read(0, np.arange(2)))
