# ruff: noqa: F811 (the moto and s3 fixtures, imported from tests/helpers/s3_fixtures.py)
"""Object storage: Parquet and JSONL shards read from a real S3-compatible server (moto_server) on the loopback, with
faults injected by a proxy in front of it. Expected documents are the ones the test wrote (independent reference)."""

from __future__ import annotations

import gzip
import io
import json
import os
import pickle
import struct

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers.s3_fixtures import FAST, moto, parquet_bytes, put_parquet, read_all, s3, token_docs, two_shards  # noqa: F401 (fixtures)
from helpers.s3_server import FaultProxy
from helpers.source_resume import check_exact_resume, check_exactly_once, check_replaced_shard_refused, small_config
from helpers.spawned_epoch import spawned_epoch

from packloader import PackedLoader, ParallelConfig, PlanConfig
from packloader.sources.errors import SourceError
from packloader.sources.identity import ShardChanged
from packloader.sources.open import open_source
from packloader.sources.remote import AccessDenied, ObjectMissing, RemoteError, RetryPolicy
from packloader.sources.storage import Storage

pytestmark = pytest.mark.multiprocess  # starts moto_server

def test_parquet_from_s3_url_reads_every_document(s3):
    url, docs = two_shards(s3)
    src = open_source(url)
    assert [s.name for s in src.shards] == [f"s3://{s3[1]}/p/a.parquet", f"s3://{s3[1]}/p/b.parquet"]
    assert read_all(src) == [d.tolist() for d in docs]
    assert src.identities[0].count(":") == 2  # size, ETag, footer hash
    clone = pickle.loads(pickle.dumps(src))  # as DataLoader workers and spawned processes receive it
    assert read_all(clone) == [d.tolist() for d in docs]


def test_parquet_reads_row_groups_by_range_not_whole_objects(s3):
    docs = token_docs(2000, 3)
    client, bucket = s3
    body = parquet_bytes(docs, row_group_size=200)
    client.put_object(Bucket=bucket, Key="big/a.parquet", Body=body)
    url = f"s3://{bucket}/big/a.parquet"
    meta = pq.ParquetFile(io.BytesIO(body)).metadata
    tail = 64 << 10  # pyarrow's speculative read of the footer
    bound = tail + sum(meta.row_group(0).column(c).total_compressed_size for c in range(2)) + 2 * (16 << 10)  # + a block at each end
    store = Storage(block_size=16 << 10, retry=FAST)
    src = open_source(store.paths(url))
    got = [np.asarray(d).tolist() for d in src.read(0, np.arange(5))]
    assert got == [d.tolist() for d in docs[:5]]
    assert 0 < store.bytes_read <= bound < len(body) / 2  # the footer and one row group's blocks, not the object


def test_jsonl_text_and_gzip_from_s3(s3):
    client, bucket = s3
    texts = [f"document {i} " + "word " * (i % 7) for i in range(25)]
    body = "".join(json.dumps({"text": t}) + "\n" for t in texts).encode()
    client.put_object(Bucket=bucket, Key="j/a.jsonl", Body=body)
    client.put_object(Bucket=bucket, Key="z/a.jsonl.gz", Body=gzip.compress(body))
    for url in (f"s3://{bucket}/j/a.jsonl", f"s3://{bucket}/z/"):
        src = open_source(url)
        assert list(src.read(0, np.arange(25))) == texts


def test_filesystem_objects_pyarrow_and_fsspec(s3, moto):
    import fsspec
    import pyarrow.fs as pafs

    url, docs = two_shards(s3)
    fs = pafs.S3FileSystem(endpoint_override=moto.endpoint, access_key="testing", secret_key="testing",
                           region="us-east-1")
    src = open_source(Storage(filesystem=fs).paths(f"{s3[1]}/p/*.parquet"))
    assert read_all(src) == [d.tolist() for d in docs]
    mem = fsspec.filesystem("memory")
    mem.pipe(f"/{s3[1]}/m/a.parquet", parquet_bytes(docs))
    src = open_source(Storage(filesystem=mem).paths(f"/{s3[1]}/m/"))
    assert read_all(src) == [d.tolist() for d in docs]


def test_loader_from_s3_trains_every_token_once_and_resumes_exactly(s3):
    url, docs = two_shards(s3)
    check_exactly_once(PackedLoader(url, config=small_config(), tokenizer=None, num_threads=1), docs)
    check_exact_resume(lambda: PackedLoader(url, config=small_config(), tokenizer=None, num_threads=2), stop=5)


def test_missing_object_names_the_url(s3):
    with pytest.raises(ObjectMissing, match=rf"s3://{s3[1]}/p/none.parquet: no such object"):
        open_source(f"s3://{s3[1]}/p/none.parquet")
    with pytest.raises(FileNotFoundError, match="no objects match"):
        open_source(f"s3://{s3[1]}/nothing/*.parquet")


def test_bad_credentials_name_the_url(s3, moto):
    url, _ = two_shards(s3)
    proxy = FaultProxy(moto.port)
    try:
        proxy.faults.access_key = "right-key"
        store = Storage(endpoint_url=proxy.endpoint, retry=FAST)
        with pytest.raises(AccessDenied, match=r"s3://.*a.parquet: access denied.*AWS_ACCESS_KEY_ID"):
            open_source(store.paths(url.replace("*.parquet", "a.parquet")))
    finally:
        proxy.close()


def test_object_replaced_under_a_saved_state_is_refused(s3):
    url, _ = two_shards(s3)
    # b.parquet rewritten: same name and row count, other tokens
    check_replaced_shard_refused(url, lambda: put_parquet(s3, "p/b.parquet", token_docs(30, 99)), "b.parquet")


@pytest.mark.parametrize("how", ["replaced", "deleted"])
def test_object_changed_mid_epoch_is_a_clear_error(s3, how):
    url = put_parquet(s3, "c/a.parquet", token_docs(2000, 4))  # larger than what opening it reads
    src = open_source(Storage(block_size=8 << 10, retry=FAST).paths(url))
    if how == "replaced":
        put_parquet(s3, "c/a.parquet", token_docs(2000, 5))
    else:
        s3[0].delete_object(Bucket=s3[1], Key="c/a.parquet")
    with pytest.raises((ShardChanged, RemoteError, ValueError), match=rf"{url}.*(changed|deleted)"):
        list(src.read(0, np.arange(2000)))


@pytest.mark.parametrize("mode", ["status", "reset", "slow"])
def test_transient_faults_are_retried_and_every_token_trained_once(s3, moto, mode):
    url, docs = two_shards(s3)
    proxy = FaultProxy(moto.port)
    try:
        proxy.faults.every, proxy.faults.mode, proxy.faults.slow_s = 3, mode, 0.2
        proxy.faults.status = 500 if mode == "status" else 503
        store = Storage(endpoint_url=proxy.endpoint, block_size=8 << 10, retry=FAST)
        loader = PackedLoader(store.paths(url), config=small_config(), tokenizer=None, num_threads=2)
        check_exactly_once(loader, docs)
        assert proxy.faults.injected > 0
    finally:
        proxy.close()


def test_persistent_faults_end_in_an_error_naming_the_url(s3, moto):
    url = put_parquet(s3, "f/a.parquet", token_docs(10, 6))
    proxy = FaultProxy(moto.port)
    try:
        proxy.faults.every, proxy.faults.mode = 1, "status"
        store = Storage(endpoint_url=proxy.endpoint, retry=RetryPolicy(attempts=3, base_delay_s=0.01))
        with pytest.raises(RemoteError, match=rf"{url}: GET .* failed after 3 attempts"):
            open_source(store.paths(url))
    finally:
        proxy.close()


def test_block_cache_is_bounded_and_serves_repeat_reads(s3, tmp_path):
    docs = token_docs(200, 7)
    url = put_parquet(s3, "k/a.parquet", docs)
    store = Storage(block_size=8 << 10, cache_dir=str(tmp_path / "cache"), cache_bytes=64 << 10, retry=FAST)
    src = open_source(store.paths(url))
    assert read_all(src) == [d.tolist() for d in docs]
    assert store.cache.used_bytes() <= 64 << 10 and store.cache.evictions > 0
    cache = str(tmp_path / "cache2")
    first = Storage(block_size=8 << 10, cache_dir=cache, cache_bytes=16 << 20, retry=FAST)
    read_all(open_source(first.paths(url)))
    assert first.bytes_read > 0
    restarted = Storage(block_size=8 << 10, cache_dir=cache, cache_bytes=16 << 20, retry=FAST)  # a new process
    assert read_all(open_source(restarted.paths(url))) == [d.tolist() for d in docs]
    assert restarted.bytes_read == 0  # every block came from the disk cache


def test_killed_and_resumed_from_object_storage_equals_one_uninterrupted_epoch(s3, tmp_path):
    """SIGKILL mid-epoch (mid-save, after logging), restart from the last saved state: the stitched
    batches equal an uninterrupted run's and every token is trained once (the kill harness's checks)."""
    from helpers import kill_harness as kh

    cfg = kh.KillConfig(source="parquet", strategy="wlb")
    paths, docs = kh.write_corpus(cfg.source, tmp_path / "corpus")
    client, bucket = s3
    urls = []
    for p in paths:
        client.put_object(Bucket=bucket, Key=f"kill/{os.path.basename(p)}", Body=open(p, "rb").read())
        urls.append(f"s3://{bucket}/kill/{os.path.basename(p)}")
    h = kh.Harness(cfg, urls, docs, tmp_path / "run", fork=False, timeout=240)
    h.run_reference()
    assert h.rounds >= 6
    kills = [{"at": h.rounds // 3, "phase": "save"}, {"at": h.rounds - 1, "phase": "log"}]  # mid-save, after a log
    result = h.run_kills(kills, save_at=list(range(1, h.rounds + 1, 2)))
    assert result.kills == len(kills) and result.tokens > 0
    assert (result.lost, result.repeated, result.extra_epoch_tokens) == (0, 0, 0), result
    assert result.token_errors == 0 and result.order_errors == 0, result


def test_dataloader_workers_read_from_s3_and_cover_every_token_once(s3):
    """Spawned DataLoader workers get the source pickled (no client, no open object) and make their own client."""
    from packloader import PackedDataset

    url, docs = two_shards(s3)
    ds = PackedDataset(Storage(retry=FAST).paths(url), config=small_config(), tokenizer=None, epochs=1)
    tokens, got = spawned_epoch(ds)
    assert tokens == sum(len(d) for d in docs)
    assert sorted(t for piece in got for t in piece) == sorted(t for d in docs for t in d.tolist())


def test_retries_are_bounded_in_seconds_and_classified():
    """A fault that never clears ends at the deadline however many attempts are allowed; timeouts and resets
    are retried, a missing object and refused credentials are not."""
    from botocore.exceptions import ClientError, NoCredentialsError, ReadTimeoutError

    from packloader.sources.remote import classify, with_retries

    calls = []

    def reset():
        calls.append(1)
        raise ConnectionResetError("reset by peer")

    policy = RetryPolicy(attempts=1000, base_delay_s=0.05, max_delay_s=0.05, deadline_s=0.3)
    with pytest.raises(RemoteError, match=r"s3://b/k: GET failed after \d+ attempts in .* ConnectionResetError"):
        with_retries(reset, "s3://b/k", policy, "GET")
    assert 2 <= len(calls) <= 13  # each wait is at least 0.025 s: the 0.3 s deadline stops it long before 1000
    assert classify(ReadTimeoutError(endpoint_url="http://127.0.0.1:1")) == "transient"
    assert classify(ClientError({"Error": {"Code": "SlowDown"}}, "GetObject")) == "transient"
    assert classify(ClientError({"Error": {"Code": "NoSuchKey"}}, "GetObject")) == "missing"
    assert classify(ClientError({"Error": {"Code": "InvalidAccessKeyId"}}, "GetObject")) == "denied"
    assert classify(NoCredentialsError()) == "denied"
    assert classify(ClientError({"Error": {"Code": "PreconditionFailed"}}, "GetObject")) == "changed"


def one_doc_groups(docs) -> bytes:
    """A shard as `packloader tokenize --row-group-tokens 1` writes it: one document a row group, zstd, no
    dictionary, statistics on the length column only (min == max: the length, in the footer)."""
    schema = pa.schema([("tokens", pa.list_(pa.int32())), ("length", pa.int32())])
    buf = io.BytesIO()
    with pq.ParquetWriter(buf, schema, compression="zstd", use_dictionary=False, write_statistics=["length"]) as w:
        for d in docs:
            w.write_table(pa.table({"tokens": [d.tolist()], "length": [len(d)]}, schema=schema))
    return buf.getvalue()


def test_lengths_from_footer_statistics_and_the_length_column(tmp_path):
    docs = token_docs(9, 11)
    docs[4:7] = [docs[4][:50], docs[5][:50], docs[6][:50]]  # a row group of one length: told by its statistics
    schema = pa.schema([("tokens", pa.list_(pa.int32())), ("length", pa.int32())])
    path = tmp_path / "mixed.parquet"
    with pq.ParquetWriter(path, schema, write_statistics=["length"]) as w:
        for group in (docs[:1], docs[1:4], docs[4:7], docs[7:]):  # one doc, mixed lengths, one length, mixed
            w.write_table(pa.table({"tokens": [d.tolist() for d in group], "length": [len(d) for d in group]},
                                   schema=schema))
    src = open_source(str(path))
    assert src.lengths(0).tolist() == [len(d) for d in docs]
    assert read_all(src) == [d.tolist() for d in docs]


def test_dp_ranks_fetch_only_their_documents_row_groups_and_train_every_token_once(s3):
    """Four dp_rank loaders over one-document row groups with exact ranged reads: planning costs each rank the
    footers only (lengths from the length statistics), and a rank then fetches the row groups of the documents it
    trains and nothing else, bounded from the files' own metadata; the union of ranks trains every token once."""
    client, bucket = s3
    shards = [token_docs(60, 21), token_docs(50, 22)]
    bodies = [one_doc_groups(d) for d in shards]
    where = {}  # document tokens -> (shard, row): the reference for which row groups a rank may fetch
    for k, (docs, body) in enumerate(zip(shards, bodies)):
        client.put_object(Bucket=bucket, Key=f"r/{k}.parquet", Body=body)
        where.update({tuple(d.tolist()): (k, row) for row, d in enumerate(docs)})
    metas = [pq.ParquetFile(io.BytesIO(b)).metadata for b in bodies]
    footers = sum(m.serialized_size + 8 for m in metas)
    group_bytes = [[sum(m.row_group(g).column(c).total_compressed_size for c in range(2))
                    for g in range(m.num_row_groups)] for m in metas]
    store = Storage(block_size=0, retry=FAST)
    src = open_source(store.paths(f"s3://{bucket}/r/"))
    assert [src.lengths(k).tolist() for k in range(2)] == [[len(d) for d in docs] for docs in shards]
    assert store.bytes_read == footers  # lengths without a byte of the row groups
    cfg = PlanConfig(strategy="fixed", max_tokens=256, context=256, tokens_per_step=600, parallel=ParallelConfig(dp=4))
    pieces: dict[int, dict[int, list[int]]] = {}
    ranks_of: dict[int, set[int]] = {}
    fetched = []
    for rank in range(4):
        store = Storage(block_size=0, retry=FAST)
        loader = PackedLoader(store.paths(f"s3://{bucket}/r/"), config=cfg, tokenizer=None, num_threads=2,
                              dp_rank=rank, check_ranks=False)
        for b in loader:
            ids, cu = b.input_ids.numpy().reshape(-1), b.cu_seqlens.numpy()
            for s, a, e in zip(b.segments, cu[:-1].tolist(), cu[1:].tolist()):
                assert int(s.start) not in pieces.setdefault(int(s.doc), {}), "a piece trained twice"
                pieces[int(s.doc)][int(s.start)] = ids[a:e].tolist()
                ranks_of.setdefault(int(s.doc), set()).add(rank)
        fetched.append(store.bytes_read)
    whole = {doc: tuple(t for _, p in sorted(parts.items()) for t in p) for doc, parts in pieces.items()}
    assert sorted(whole.values()) == sorted(where)  # every token of every document, once over the ranks
    total = sum(len(b) for b in bodies)
    for rank in range(4):
        mine = [where[whole[doc]] for doc, ranks in ranks_of.items() if rank in ranks]
        bound = footers + sum(group_bytes[k][row] for k, row in mine)
        assert 0 < fetched[rank] <= bound < 0.6 * total, (rank, fetched[rank], bound, total)


def test_block_size_zero_reads_exact_ranges_and_negative_is_refused(s3):
    docs = token_docs(200, 4)
    client, bucket = s3
    body = parquet_bytes(docs, row_group_size=20)
    client.put_object(Bucket=bucket, Key="x/a.parquet", Body=body)
    meta = pq.ParquetFile(io.BytesIO(body)).metadata
    store = Storage(block_size=0, retry=FAST)
    src = open_source(store.paths(f"s3://{bucket}/x/a.parquet"))
    assert [np.asarray(d).tolist() for d in src.read(0, np.arange(3))] == [d.tolist() for d in docs[:3]]
    exact = meta.serialized_size + 8 + sum(meta.row_group(0).column(c).total_compressed_size for c in range(2))
    assert store.bytes_read == exact  # the footer and row group 0's two column chunks, not a byte more
    with pytest.raises(ValueError, match="block_size"):
        Storage(block_size=-1)


def test_rank_local_reads_resume_exactly(s3):
    client, bucket = s3
    client.put_object(Bucket=bucket, Key="e/a.parquet", Body=one_doc_groups(token_docs(60, 23)))
    cfg = PlanConfig(strategy="fixed", max_tokens=256, context=256, tokens_per_step=600, parallel=ParallelConfig(dp=4))
    check_exact_resume(lambda: PackedLoader(Storage(block_size=0, retry=FAST).paths(f"s3://{bucket}/e/"), config=cfg,
                                            tokenizer=None, num_threads=2, dp_rank=1, check_ranks=False), stop=3)


def test_tokenize_one_document_row_groups_give_lengths_from_the_footer(tmp_path, monkeypatch):
    from packloader.sources.base import IterableSource
    from packloader.sources.pretokenize import tokenize_to_parquet
    from packloader.sources.tokenizers import get_tokenizer

    texts = [f"doc {i} " + "x" * (i * 7 % 40) for i in range(12)]
    tokenize_to_parquet(IterableSource(texts), get_tokenizer("bytes"), tmp_path / "t", row_group_tokens=1,
                        progress=False)
    src = open_source(str(tmp_path / "t"))

    def no_column_reads(*a, **k):
        raise AssertionError("the length column was read")

    monkeypatch.setattr(pq.ParquetFile, "read_row_groups", no_column_reads)
    monkeypatch.setattr(pq.ParquetFile, "read", no_column_reads)
    assert src.lengths(0).tolist() == [len(t.encode()) + 1 for t in texts]  # bytes and the EOS appended


def test_length_statistics_that_disagree_with_the_tokens_are_named(tmp_path):
    """The footer's statistics are what the ranks plan from: a row group whose tokens disagree with them is an
    error naming the file, row and column, not a plan of the wrong length."""
    docs = [np.arange(300, dtype=np.int32) % 200, np.arange(40, dtype=np.int32)]
    body = one_doc_groups(docs)
    n = struct.unpack("<i", body[-8:-4])[0]
    head, footer = body[: -8 - n], body[-8 - n : -8]
    assert footer.count(struct.pack("<i", 300)) == 4  # row group 0's length statistics: min, max (old and new fields)
    path = tmp_path / "forged.parquet"
    path.write_bytes(head + footer.replace(struct.pack("<i", 300), struct.pack("<i", 299)) + body[-8:])
    src = open_source(str(path))
    assert src.lengths(0).tolist() == [299, 40]  # stated, not yet read
    with pytest.raises(SourceError, match=r"forged\.parquet, row 0, column 'length': the row group's statistics say "
                                          r"every length is 299, but column 'tokens' holds 300 tokens"):
        list(src.read(0, np.arange(2)))
