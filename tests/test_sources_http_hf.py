"""http(s):// shard URLs read by ranged GETs, served by real HTTP servers on the loopback: moto_server's objects
(an S3 object's URL, as a public or signed URL is: Range, ETag and If-Match honoured) and the standard library's
`http.server` (which ignores Range: refused); and hf:// through huggingface_hub, whose Hub this machine cannot
reach: the error names the URL and the settings. Expected documents are the ones the test wrote."""

# ruff: noqa: F811 (the moto and s3 fixtures, imported from tests/helpers/s3_fixtures.py)
from __future__ import annotations

import functools
import json
import re
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
from helpers.s3_fixtures import FAST, moto, parquet_bytes, put_parquet, read_all, s3, token_docs  # noqa: F401 (fixtures)
from helpers.source_resume import check_exact_resume, check_exactly_once, small_config

from packloader import PackedLoader
from packloader.sources.identity import ShardChanged
from packloader.sources.open import open_source
from packloader.sources.remote import ObjectMissing, RemoteError
from packloader.sources.storage import Storage
from packloader.sources.unsupported import UnsupportedSourceError

pytestmark = pytest.mark.multiprocess  # starts moto_server


def http_url(moto, s3, key: str) -> str:
    """A presigned URL of the object: a private object's https:// URL as object stores hand them out."""
    return s3[0].generate_presigned_url("get_object", Params={"Bucket": s3[1], "Key": key}, ExpiresIn=600)


def test_parquet_and_jsonl_over_http_read_every_document(moto, s3):
    a, b = token_docs(40, 1), token_docs(30, 2)
    put_parquet(s3, "h/a.parquet", a)
    put_parquet(s3, "h/b.parquet", b)
    urls = [http_url(moto, s3, "h/a.parquet"), http_url(moto, s3, "h/b.parquet")]
    src = open_source(urls)
    assert [s.name for s in src.shards] == urls
    assert read_all(src) == [d.tolist() for d in a + b]
    texts = [f"document {i} " + "word " * (i % 5) for i in range(12)]
    s3[0].put_object(Bucket=s3[1], Key="h/t.jsonl", Body="".join(json.dumps({"text": t}) + "\n" for t in texts))
    assert list(open_source(http_url(moto, s3, "h/t.jsonl")).read(0, np.arange(12))) == texts


def test_loader_over_http_trains_every_token_once_and_resumes_exactly(moto, s3):
    a, b = token_docs(40, 1), token_docs(30, 2)
    put_parquet(s3, "r/a.parquet", a)
    put_parquet(s3, "r/b.parquet", b)
    urls = [http_url(moto, s3, "r/a.parquet"), http_url(moto, s3, "r/b.parquet")]
    check_exactly_once(PackedLoader(urls, config=small_config(), tokenizer=None, num_threads=1), a + b)
    check_exact_resume(lambda: PackedLoader(urls, config=small_config(), tokenizer=None, num_threads=2), stop=5)


@pytest.mark.parametrize("how", ["replaced", "deleted"])
def test_file_changed_under_a_read_is_a_clear_error(moto, s3, how):
    put_parquet(s3, "c/a.parquet", token_docs(2000, 4))
    url = http_url(moto, s3, "c/a.parquet")
    src = open_source(Storage(block_size=8 << 10, retry=FAST).paths(url))
    if how == "replaced":
        put_parquet(s3, "c/a.parquet", token_docs(2000, 5))
    else:
        s3[0].delete_object(Bucket=s3[1], Key="c/a.parquet")
    with pytest.raises(ShardChanged, match=rf"{re.escape(url)}: .*(changed|deleted)"):
        list(src.read(0, np.arange(2000)))


def test_missing_file_and_listing_name_the_url(moto, s3):
    url = http_url(moto, s3, "none.parquet")
    with pytest.raises(ObjectMissing, match=rf"{re.escape(url)}: no such object"):
        open_source(url)
    with pytest.raises(UnsupportedSourceError, match=r"HTTP has no listing.*pass each shard's URL"):
        open_source(f"{moto.endpoint}/{s3[1]}/h/*.parquet")


def test_a_server_that_ignores_range_is_refused(tmp_path):
    (tmp_path / "a.parquet").write_bytes(parquet_bytes(token_docs(5, 1)))
    handler = functools.partial(SimpleHTTPRequestHandler, directory=str(tmp_path))
    handler.log_message = lambda *a: None
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/a.parquet"
        with pytest.raises(RemoteError, match=rf"{url}: .*ignores Range requests"):
            open_source(Storage(retry=FAST).paths(url))
    finally:
        server.shutdown()
        server.server_close()


def test_hf_url_when_the_hub_is_unreachable_names_the_url_and_settings(monkeypatch):
    pytest.importorskip("huggingface_hub")
    import huggingface_hub.constants
    from huggingface_hub import HfFileSystem

    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    HfFileSystem.clear_instance_cache()
    from packloader.sources import storage as storage_mod

    monkeypatch.setattr(storage_mod, "_DEFAULT", {})
    url = "hf://datasets/org/name/data/a.parquet"
    try:
        with pytest.raises(RemoteError, match=rf"{url}: .*failed.*HF_TOKEN.*HF_ENDPOINT"):
            open_source(url)
    finally:
        HfFileSystem.clear_instance_cache()
