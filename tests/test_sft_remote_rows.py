"""SFT rows from object storage (a loopback S3 server): JSONL and Parquet objects and an MDS prefix give the same
documents and masks as the same rows read from local files."""

# ruff: noqa: F811 (the moto and s3 fixtures, imported from tests/helpers/s3_fixtures.py)
from __future__ import annotations

import io
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers.s3_fixtures import moto, s3  # noqa: F401 (fixtures)
from helpers.sft_data import CONVERSATIONS, TOKENIZER_DIR

from packloader.sources.errors import SourceError
from packloader.sources.sft import SftSource
from packloader.sources.storage import Storage

pytestmark = pytest.mark.multiprocess  # starts moto_server

ROWS = [{"messages": c} for c in CONVERSATIONS]


def _docs(source) -> list[tuple[list[int], list[int]]]:
    return [(d.tolist(), d.loss_mask.astype(int).tolist()) for s, info in enumerate(source.shards)
            for d in source.read(s, np.arange(info.num_rows))]


def _jsonl(rows) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def test_jsonl_and_parquet_objects_equal_local_rows(s3, tmp_path):
    client, bucket = s3
    want = _docs(SftSource(ROWS, str(TOKENIZER_DIR)))
    client.put_object(Bucket=bucket, Key="chat/a.jsonl", Body=_jsonl(ROWS[:2]))
    client.put_object(Bucket=bucket, Key="chat/b.jsonl", Body=_jsonl(ROWS[2:]))
    assert _docs(SftSource(f"s3://{bucket}/chat/*.jsonl", str(TOKENIZER_DIR))) == want
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(ROWS), buf, row_group_size=1)
    client.put_object(Bucket=bucket, Key="pq/p.parquet", Body=buf.getvalue())
    src = SftSource([f"s3://{bucket}/pq/p.parquet"], str(TOKENIZER_DIR))
    assert src.location(0, 2) == f"s3://{bucket}/pq/p.parquet, row 2"
    assert _docs(src) == want


def test_mds_prefix_equals_local_rows(s3, tmp_path):
    import streaming

    client, bucket = s3
    want = _docs(SftSource(ROWS, str(TOKENIZER_DIR)))
    out = tmp_path / "mds"
    with streaming.MDSWriter(out=str(out), columns={"messages": "json"}, size_limit=512) as w:
        for r in ROWS:
            w.write(r)
    for f in sorted(out.iterdir()):
        client.put_object(Bucket=bucket, Key=f"mds/{f.name}", Body=f.read_bytes())
    assert _docs(SftSource(f"s3://{bucket}/mds", str(TOKENIZER_DIR))) == want
    assert _docs(SftSource(Storage().paths(f"s3://{bucket}/mds"), str(TOKENIZER_DIR))) == want


def test_objects_of_two_kinds_are_refused(s3):
    client, bucket = s3
    client.put_object(Bucket=bucket, Key="mix/a.jsonl", Body=_jsonl(ROWS[:1]))
    client.put_object(Bucket=bucket, Key="mix/b.txt", Body=b"hello")
    with pytest.raises(SourceError, match=r"expected JSONL or Parquet objects of one kind .*found \['None', 'jsonl'\]"):
        SftSource(f"s3://{bucket}/mix/", str(TOKENIZER_DIR))
