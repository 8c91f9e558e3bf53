"""Ranks over a loopback S3 server (moto_server) with length indexes: each rank fetches the footers, the indexes and
the pages of the documents it trains, and nothing else; the union of ranks trains every token once; a killed and
resumed rank equals an uninterrupted one. References: the documents the test wrote, and the token column's bytes
as pyarrow's footer states them."""

from __future__ import annotations

import io
import os

import boto3
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers.cloud_emulators import server_or_skip
from helpers.s3_server import MOTO_MISSING, MotoServer, find_moto_server
from helpers.source_resume import check_exact_resume
from helpers.spawned_epoch import spawned_epoch

from packloader import PackedLoader, ParallelConfig, PlanConfig
from packloader.sources import storage as storage_mod
from packloader.sources.length_index import index_name
from packloader.sources.open import open_source
from packloader.sources.pretokenize import write_index
from packloader.sources.remote import RetryPolicy
from packloader.sources.storage import Storage

pytestmark = pytest.mark.multiprocess  # starts moto_server

FAST = RetryPolicy(attempts=6, base_delay_s=0.01, max_delay_s=0.1, deadline_s=30, connect_timeout_s=2,
                   read_timeout_s=2)


@pytest.fixture(scope="module")
def s3():
    with server_or_skip(find_moto_server(), MotoServer, MOTO_MISSING, "moto_server") as server:
        yield from _pages_bucket(server)


def _pages_bucket(server):
    """A bucket "pages" on `server`, the AWS settings pointing at it while the tests run."""
    saved = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION",
                                            "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3")}
    os.environ.update(AWS_ACCESS_KEY_ID="t", AWS_SECRET_ACCESS_KEY="t", AWS_DEFAULT_REGION="us-east-1",
                      AWS_ENDPOINT_URL=server.endpoint)
    os.environ.pop("AWS_ENDPOINT_URL_S3", None)
    storage_mod._DEFAULT.clear()
    client = boto3.client("s3", endpoint_url=server.endpoint)
    client.create_bucket(Bucket="pages")
    yield client
    for k, v in saved.items():
        os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    storage_mod._DEFAULT.clear()


def token_docs(n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 1000, int(rng.integers(1, 250))).astype(np.int32) for _ in range(n)]


def upload(client, tmp_path, prefix: str, shards) -> list[bytes]:
    """Shards as `packloader tokenize` writes them (row groups of many documents, one document a page), each with
    its index beside it, uploaded under `prefix`."""
    bodies = []
    for k, docs in enumerate(shards):
        path = tmp_path / f"{prefix}-{k}.parquet"
        t = pa.table({"tokens": pa.array([d.tolist() for d in docs], pa.list_(pa.int32())),
                      "length": pa.array([len(d) for d in docs], pa.int32())})
        pq.write_table(t, path, compression="zstd", use_dictionary=False, write_page_checksum=True,
                       max_rows_per_page=1, row_group_size=32, write_statistics=["length"])
        write_index(str(path))
        client.put_object(Bucket="pages", Key=f"{prefix}/{k}.parquet", Body=path.read_bytes())
        client.put_object(Bucket="pages", Key=index_name(f"{prefix}/{k}.parquet"),
                          Body=open(index_name(str(path)), "rb").read())
        bodies.append(path.read_bytes())
    return bodies


CFG = PlanConfig(strategy="fixed", max_tokens=256, context=256, tokens_per_step=600, parallel=ParallelConfig(dp=4))


def test_dp_ranks_fetch_only_their_documents_pages_and_train_every_token_once(s3, tmp_path):
    """No document is cut (context 256 > every length), so each document's pages are fetched by the one rank that
    trains it: over the four ranks the page bytes fetched add up to the token column's bytes exactly, and each rank
    fetches little more than its share."""
    shards = [token_docs(100, 31), token_docs(90, 32)]
    bodies = upload(s3, tmp_path, "d", shards)
    metas = [pq.ParquetFile(io.BytesIO(b)).metadata for b in bodies]
    token_bytes = sum(m.row_group(g).column(0).total_compressed_size for m in metas for g in range(m.num_row_groups))
    fixed = sum(m.serialized_size + 8 for m in metas) + sum(
        s3.head_object(Bucket="pages", Key=index_name(f"d/{k}.parquet"))["ContentLength"] for k in range(2))
    pieces: dict[int, list[int]] = {}
    fetched = []
    for rank in range(4):
        store = Storage(block_size=0, retry=FAST, merge_gap_bytes=0)  # exact ranges, no gap merged
        loader = PackedLoader(store.paths("s3://pages/d/*.parquet"), config=CFG, tokenizer=None, num_threads=2,
                              dp_rank=rank, check_ranks=False)
        for b in loader:
            ids, cu = b.input_ids.numpy().reshape(-1), b.cu_seqlens.numpy()
            for s, a, e in zip(b.segments, cu[:-1].tolist(), cu[1:].tolist()):
                assert int(s.doc) not in pieces, "a document trained twice"
                pieces[int(s.doc)] = ids[a:e].tolist()
        fetched.append(store.bytes_read - fixed)
    assert sorted(map(tuple, pieces.values())) == sorted(tuple(d.tolist()) for docs in shards for d in docs)
    assert sum(fetched) == token_bytes  # every page once, by the rank that trains its document
    total = sum(map(len, bodies))
    assert all(0 < f + fixed < (0.25 + 0.15) * total for f in fetched), (fetched, fixed, total)


def test_paged_reads_resume_exactly(s3, tmp_path):
    upload(s3, tmp_path, "e", [token_docs(80, 33)])
    check_exact_resume(lambda: PackedLoader(Storage(block_size=0, retry=FAST).paths("s3://pages/e/"), config=CFG,
                                            tokenizer=None, num_threads=2, dp_rank=2, check_ranks=False), stop=3)


def test_killed_and_resumed_with_paged_reads_equals_one_uninterrupted_epoch(s3, tmp_path):
    """The kill harness's corpus rewritten as `tokenize` writes it (one document a page) with its indexes, read
    page by page (4 MiB blocks, dp 2 in one process): SIGKILLs mid-save and after a log, restarts from the last
    saved state; the stitched batches equal an uninterrupted run's and every token is trained once."""
    from helpers import kill_harness as kh

    cfg = kh.KillConfig(source="parquet", strategy="wlb", dp=2)
    paths, docs = kh.write_corpus(cfg.source, tmp_path / "corpus")
    urls = []
    for p in paths:
        table = pq.read_table(p)
        pq.write_table(table, p, compression="zstd", use_dictionary=False, write_page_checksum=True,
                       max_rows_per_page=1)
        write_index(p)
        key = f"kill/{os.path.basename(p)}"
        s3.put_object(Bucket="pages", Key=key, Body=open(p, "rb").read())
        s3.put_object(Bucket="pages", Key=index_name(key), Body=open(index_name(p), "rb").read())
        urls.append(f"s3://pages/{key}")
    assert all(s is not None for s in open_source(urls)._paged)
    h = kh.Harness(cfg, urls, docs, tmp_path / "run", fork=False, timeout=240)
    h.run_reference()
    assert h.rounds >= 6
    kills = [{"at": h.rounds // 3, "phase": "save"}, {"at": h.rounds - 1, "phase": "log"}]
    result = h.run_kills(kills, save_at=list(range(1, h.rounds + 1, 2)))
    assert result.kills == len(kills) and result.tokens > 0
    assert (result.lost, result.repeated, result.extra_epoch_tokens) == (0, 0, 0), result
    assert result.token_errors == 0 and result.order_errors == 0, result


def test_spawned_workers_read_pages_and_cover_every_token_once(s3, tmp_path):
    """DataLoader workers get the source, its indexes included, pickled; each reads its pages with its own client
    and thread pool."""
    from packloader import PackedDataset

    shards = [token_docs(50, 34), token_docs(40, 35)]
    upload(s3, tmp_path, "w", shards)
    cfg = PlanConfig(strategy="fixed", max_tokens=256, context=256, tokens_per_step=600)
    ds = PackedDataset(Storage(block_size=0, retry=FAST).paths("s3://pages/w/*.parquet"), config=cfg, tokenizer=None,
                       epochs=1)
    assert all(s is not None for s in ds._p.stream.source._paged)
    tokens, got = spawned_epoch(ds)
    assert tokens == sum(len(d) for docs in shards for d in docs)
    assert sorted(map(tuple, got)) == sorted(tuple(d.tolist()) for docs in shards for d in docs)
