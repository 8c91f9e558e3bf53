"""The loopback S3 server's fixtures and the shards the object-storage tests write (their independent reference:
the documents written)."""

from __future__ import annotations

import io
import itertools
import os

import boto3
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from helpers.cloud_emulators import server_or_skip
from helpers.s3_server import MOTO_MISSING, MotoServer, find_moto_server
from packloader.sources import storage as storage_mod
from packloader.sources.remote import RetryPolicy

_NAMES = itertools.count()


def fast_retry(read_timeout_s: float = 2) -> RetryPolicy:
    """Retries and timeouts short enough for a loopback server (a test of a fault waits milliseconds, not the
    production back-off)."""
    return RetryPolicy(attempts=6, base_delay_s=0.01, max_delay_s=0.1, deadline_s=30, connect_timeout_s=2,
                       read_timeout_s=read_timeout_s)


FAST = fast_retry()


def bucket_name() -> str:
    """A bucket (or container) name no other test uses, in this process or another."""
    return f"bkt-{os.getpid()}-{next(_NAMES)}"


def server_fixture(name: str, find, start, missing: str, what: str):
    """A module-scoped fixture `name`: the server `start(find())` for the module's tests, which are skipped with
    `missing` where `find()` finds none, or naming `what` where it cannot start (cloud_emulators.server_or_skip)."""

    @pytest.fixture(scope="module", name=name)
    def server():
        with server_or_skip(find(), start, missing, what) as running:
            yield running

    return server


moto = server_fixture("moto", find_moto_server, MotoServer, MOTO_MISSING, "moto_server")


@pytest.fixture()
def s3(moto, monkeypatch):
    """A fresh bucket; the AWS settings point at the server (the default storage rebuilt from them)."""
    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
                 "AWS_ENDPOINT_URL": moto.endpoint}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    monkeypatch.setattr(storage_mod, "_DEFAULT", {})
    client = boto3.client("s3", endpoint_url=moto.endpoint)
    bucket = bucket_name()
    client.create_bucket(Bucket=bucket)
    return client, bucket


def token_docs(n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 1000, int(rng.integers(1, 300))).astype(np.int32) for _ in range(n)]


def parquet_bytes(docs, row_group_size: int = 16) -> bytes:
    t = pa.table({"tokens": pa.array([d.tolist() for d in docs], pa.list_(pa.int32())),
                  "length": pa.array([len(d) for d in docs], pa.int32())})
    buf = io.BytesIO()
    pq.write_table(t, buf, row_group_size=row_group_size)
    return buf.getvalue()


def put_parquet(s3, key: str, docs) -> str:
    client, bucket = s3
    client.put_object(Bucket=bucket, Key=key, Body=parquet_bytes(docs))
    return f"s3://{bucket}/{key}"


def two_shards(s3, prefix: str = "p"):
    a, b = token_docs(40, 1), token_docs(30, 2)
    put_parquet(s3, f"{prefix}/a.parquet", a)
    put_parquet(s3, f"{prefix}/b.parquet", b)
    return f"s3://{s3[1]}/{prefix}/*.parquet", a + b


def read_all(src) -> list[list[int]]:
    out = []
    for k, s in enumerate(src.shards):
        out += [np.asarray(d).tolist() for d in src.read(k, np.arange(s.num_rows))]
    return out
