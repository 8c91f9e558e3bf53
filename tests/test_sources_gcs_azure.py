"""Object storage on Google Cloud Storage (gs://) and Azure Blob Storage (az://, abfs://): Parquet and JSONL shards
read from real emulators on the loopback (gcp-storage-emulator, Azurite), faults injected by the proxy the S3 tests
use. Expected documents are the ones the test wrote (an independent reference)."""

from __future__ import annotations

import gzip
import json
import os
import pickle

import numpy as np
import pyarrow.parquet as pq
import pytest
from helpers.cloud_emulators import (
    AZURITE_MISSING,
    GCS_MISSING,
    azurite_connection_string,
    find_azurite,
    find_gcs_emulator,
    start_azurite,
    start_gcs_emulator,
)
from helpers.s3_fixtures import bucket_name, fast_retry, parquet_bytes, read_all, server_fixture, token_docs
from helpers.s3_server import FaultProxy
from helpers.source_resume import check_exact_resume, check_exactly_once, check_replaced_shard_refused, small_config

from packloader import PackedLoader
from packloader.sources import storage as storage_mod
from packloader.sources.identity import ShardChanged
from packloader.sources.open import open_source
from packloader.sources.remote import AccessDenied, ObjectMissing, RemoteError
from packloader.sources.storage import Storage

pytestmark = pytest.mark.multiprocess  # starts the emulators

FAST = fast_retry(read_timeout_s=5)
gcs_server = server_fixture("gcs_server", find_gcs_emulator, start_gcs_emulator, GCS_MISSING, "gcp-storage-emulator")
azurite_server = server_fixture("azurite_server", find_azurite, start_azurite, AZURITE_MISSING, "Azurite")


class Bucket:
    """A fresh bucket or container on one emulator, and how to point the standard settings at an endpoint."""

    def __init__(self, scheme: str, server, monkeypatch) -> None:
        self.scheme, self.server, self.mp = scheme, server, monkeypatch
        self.name = bucket_name()
        self.point(server.endpoint)
        if scheme == "gs":
            from google.cloud import storage

            self.client = storage.Client(project="test")
            self.client.create_bucket(self.name)
        else:
            from azure.storage.blob import BlobServiceClient

            conn = azurite_connection_string(server.endpoint)
            self.client = BlobServiceClient.from_connection_string(conn).get_container_client(self.name)
            self.client.create_container()

    def point(self, endpoint: str, key: str | None = None) -> None:
        """The standard settings at `endpoint` (the emulator, or a proxy in front of it); a fresh default storage."""
        if self.scheme == "gs":
            self.mp.setenv("STORAGE_EMULATOR_HOST", endpoint)
        else:
            conn = azurite_connection_string(endpoint, *([key] if key else []))
            self.mp.setenv("AZURE_STORAGE_CONNECTION_STRING", conn)
        self.mp.setattr(storage_mod, "_DEFAULT", {})

    def url(self, key: str) -> str:
        return f"{self.scheme}://{self.name}/{key}"

    def put(self, key: str, data: bytes) -> str:
        if self.scheme == "gs":
            self.client.bucket(self.name).blob(key).upload_from_string(data)
        else:
            self.client.upload_blob(key, data, overwrite=True)
        return self.url(key)

    def delete(self, key: str) -> None:
        if self.scheme == "gs":
            self.client.bucket(self.name).blob(key).delete()
        else:
            self.client.delete_blob(key)


@pytest.fixture(params=["gs", "az"])
def bucket(request, monkeypatch):
    server = request.getfixturevalue("gcs_server" if request.param == "gs" else "azurite_server")
    return Bucket(request.param, server, monkeypatch)


def two_shards(bucket: Bucket, prefix: str = "p"):
    a, b = token_docs(40, 1), token_docs(30, 2)
    bucket.put(f"{prefix}/a.parquet", parquet_bytes(a))
    bucket.put(f"{prefix}/b.parquet", parquet_bytes(b))
    return bucket.url(f"{prefix}/*.parquet"), a + b


def test_parquet_from_url_reads_every_document(bucket):
    url, docs = two_shards(bucket)
    src = open_source(url)
    assert [s.name for s in src.shards] == [bucket.url("p/a.parquet"), bucket.url("p/b.parquet")]
    assert read_all(src) == [d.tolist() for d in docs]
    clone = pickle.loads(pickle.dumps(src))  # as DataLoader workers and spawned processes receive it
    assert read_all(clone) == [d.tolist() for d in docs]
    assert read_all(open_source(bucket.url("p/"))) == [d.tolist() for d in docs]  # a prefix lists its objects


def test_abfs_url_names_the_same_container(azurite_server, monkeypatch):
    b = Bucket("az", azurite_server, monkeypatch)
    docs = token_docs(10, 7)
    b.put("x/a.parquet", parquet_bytes(docs))
    for url in (f"abfs://{b.name}/x/a.parquet", f"abfss://{b.name}@devstoreaccount1.dfs.core.windows.net/x/*.parquet"):
        assert read_all(open_source(url)) == [d.tolist() for d in docs]


def test_parquet_reads_row_groups_by_range_not_whole_objects(bucket):
    docs = token_docs(2000, 3)
    body = parquet_bytes(docs, row_group_size=200)
    url = bucket.put("big/a.parquet", body)
    meta = pq.ParquetFile(pa_buffer(body)).metadata
    tail = 64 << 10  # pyarrow's speculative read of the footer
    bound = tail + sum(meta.row_group(0).column(c).total_compressed_size for c in range(2)) + 2 * (16 << 10)
    store = Storage(block_size=16 << 10, retry=FAST)
    src = open_source(store.paths(url))
    got = [np.asarray(d).tolist() for d in src.read(0, np.arange(5))]
    assert got == [d.tolist() for d in docs[:5]]
    assert 0 < store.bytes_read <= bound < len(body) / 2  # the footer and one row group's blocks, not the object


def pa_buffer(body: bytes):
    import pyarrow as pa

    return pa.BufferReader(body)


def test_jsonl_text_and_gzip(bucket):
    texts = [f"document {i} " + "word " * (i % 7) for i in range(25)]
    body = "".join(json.dumps({"text": t}) + "\n" for t in texts).encode()
    bucket.put("j/a.jsonl", body)
    bucket.put("z/a.jsonl.gz", gzip.compress(body))
    for url in (bucket.url("j/a.jsonl"), bucket.url("z/")):
        assert list(open_source(url).read(0, np.arange(25))) == texts


def test_loader_trains_every_token_once_and_resumes_exactly(bucket):
    url, docs = two_shards(bucket)
    check_exactly_once(PackedLoader(url, config=small_config(), tokenizer=None, num_threads=1), docs)
    check_exact_resume(lambda: PackedLoader(url, config=small_config(), tokenizer=None, num_threads=2), stop=5)


def test_missing_object_names_the_url(bucket):
    two_shards(bucket)
    url = bucket.url("p/none.parquet")
    with pytest.raises(ObjectMissing, match=rf"{url}: no such object"):
        open_source(url)
    with pytest.raises(FileNotFoundError, match="no objects match"):
        open_source(bucket.url("nothing/*.parquet"))


def test_bad_credentials_name_the_url(bucket):
    url, _ = two_shards(bucket)
    url = url.replace("*.parquet", "a.parquet")
    proxy = FaultProxy(bucket.server.port)
    try:
        if bucket.scheme == "gs":  # the emulator checks no token: the proxy asks for one the client lacks
            proxy.faults.bearer = "right-token"
            bucket.point(proxy.endpoint)
            hint = "GOOGLE_APPLICATION_CREDENTIALS"
        else:  # Azurite checks the shared-key signature itself
            bucket.point(bucket.server.endpoint, key="d3Jvbmcta2V5" * 4)
            hint = "AZURE_STORAGE_CONNECTION_STRING"
        with pytest.raises(AccessDenied, match=rf"(?s){url}: access denied.*{hint}"):
            open_source(Storage(retry=FAST).paths(url))
    finally:
        proxy.close()


def test_object_replaced_under_a_saved_state_is_refused(bucket):
    url, _ = two_shards(bucket)
    # b.parquet rewritten: same name and row count, other tokens
    check_replaced_shard_refused(url, lambda: bucket.put("p/b.parquet", parquet_bytes(token_docs(30, 99))), "b.parquet")


@pytest.mark.parametrize("how", ["replaced", "deleted"])
def test_object_changed_mid_epoch_is_a_clear_error(bucket, how):
    url = bucket.put("c/a.parquet", parquet_bytes(token_docs(2000, 4)))  # larger than what opening it reads
    src = open_source(Storage(block_size=8 << 10, retry=FAST).paths(url))
    if how == "replaced":
        bucket.put("c/a.parquet", parquet_bytes(token_docs(2100, 5)))
    else:
        bucket.delete("c/a.parquet")
    with pytest.raises(ShardChanged, match=rf"{url}.*(changed|deleted)"):
        list(src.read(0, np.arange(2000)))


@pytest.mark.parametrize("mode", ["status", "reset", "slow"])
def test_transient_faults_are_retried_and_every_token_trained_once(bucket, mode):
    url, docs = two_shards(bucket)
    proxy = FaultProxy(bucket.server.port)
    try:
        proxy.faults.every, proxy.faults.mode, proxy.faults.slow_s = 3, mode, 0.2
        bucket.point(proxy.endpoint)
        storage_mod._DEFAULT[os.getpid()] = Storage(block_size=4 << 10, retry=FAST)
        check_exactly_once(PackedLoader(url, config=small_config(), tokenizer=None, num_threads=1), docs)
        assert proxy.faults.injected > 0
    finally:
        proxy.close()


def test_a_store_that_stays_down_is_an_error_naming_the_url(bucket):
    url, _ = two_shards(bucket)
    proxy = FaultProxy(bucket.server.port)
    try:
        bucket.point(proxy.endpoint)
        src = open_source(Storage(block_size=4 << 10, retry=FAST).paths(url))
        proxy.faults.every, proxy.faults.status = 1, 503
        with pytest.raises(RemoteError, match=rf"{bucket.url('p/a.parquet')}: GET .* failed after 6 attempts"):
            list(src.read(0, np.arange(40)))
    finally:
        proxy.close()


def test_mds_directory_reads_every_sample(bucket, tmp_path):
    streaming = pytest.importorskip("streaming")
    docs = token_docs(50, 6)
    out = tmp_path / "mds"
    with streaming.MDSWriter(out=str(out), columns={"tokens": "ndarray:int32"}, size_limit=4096) as w:
        for d in docs:
            w.write({"tokens": d})
    for name in sorted(os.listdir(out)):
        bucket.put(f"mds/{name}", (out / name).read_bytes())
    src = open_source(bucket.url("mds"))
    assert len(src.shards) > 2 and read_all(src) == [d.tolist() for d in docs]


def test_sdk_errors_are_classified_as_their_http_status_says():
    """What each SDK raises for a status, taken for what the status means (hand-listed, not read from the code)."""
    import google.auth.exceptions as gauth
    from azure.core import exceptions as az
    from google.api_core import exceptions as gapi

    from packloader.sources.remote import classify

    cases = [(gapi.ServiceUnavailable("x"), "transient"), (gapi.TooManyRequests("x"), "transient"),
             (gapi.InternalServerError("x"), "transient"), (gapi.NotFound("x"), "missing"),
             (gapi.Forbidden("x"), "denied"), (gapi.Unauthorized("x"), "denied"),
             (gapi.PreconditionFailed("x"), "changed"), (gauth.RefreshError("x"), "denied"),
             (gauth.DefaultCredentialsError("x"), "denied"), (gauth.TransportError("x"), "transient"),
             (az.ResourceNotFoundError("x"), "missing"), (az.ClientAuthenticationError("x"), "denied"),
             (az.ServiceRequestError("x"), "transient"), (az.ServiceResponseError("x"), "transient")]
    for status, kind in ((412, "changed"), (503, "transient"), (403, "denied"), (500, "transient")):
        e = az.HttpResponseError("x")
        e.status_code = status
        cases.append((e, kind))
    assert [(type(e).__name__, classify(e)) for e, _ in cases] == [(type(e).__name__, k) for e, k in cases]
