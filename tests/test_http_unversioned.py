"""An http(s) shard from a server that sends no ETag (issue 35, item 4): its identity was its size alone, so a
same-size replacement was read on resume. Now the object's Last-Modified date is its version where the server
sends one, and with neither its content is hashed (sampled as a local file's) and the disk cache does not keep it:
the resume is refused naming the URL. The server is a real http.server on the loopback that honours Range."""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest
from helpers.plain_http import serve, write_docs

from packloader import PackedLoader
from packloader.contracts import PlanConfig
from packloader.sources.identity import ShardChanged
from packloader.sources.open import open_source
from packloader.sources.storage import Storage


@pytest.fixture
def server(tmp_path, request):
    srv, base = serve(str(tmp_path), getattr(request, "param", False))
    yield base
    srv.shutdown()
    srv.server_close()


def loader(url, tmp_path):
    storage = Storage(cache_dir=str(tmp_path / "cache"), cache_bytes=1 << 30, block_size=1 << 10)
    return PackedLoader(storage.paths(url), tokenizer=None, num_threads=0,
                        config=PlanConfig(strategy="fixed", max_tokens=128, context=128, tokens_per_step=256))


def state_after_three_steps(url, tmp_path) -> dict:
    first = loader(url, tmp_path)
    it = iter(first)
    for _ in range(3):
        next(it)
    return first.state_dict()


def test_same_size_replacement_without_any_version_is_refused_on_resume(tmp_path, server):
    write_docs(tmp_path / "a.jsonl", 1)
    url = f"{server}/a.jsonl"
    state = state_after_three_steps(url, tmp_path)
    size = os.path.getsize(tmp_path / "a.jsonl")
    write_docs(tmp_path / "a.jsonl", 2)
    assert os.path.getsize(tmp_path / "a.jsonl") == size  # the replacement the size alone cannot tell
    with pytest.raises(ValueError, match=r"differently configured loader \(source.a.jsonl: saved '80 rows, "):
        loader(url, tmp_path).load_state_dict(state)


def test_an_unchanged_file_without_a_version_resumes(tmp_path, server):
    write_docs(tmp_path / "a.jsonl", 1)
    url = f"{server}/a.jsonl"
    state = state_after_three_steps(url, tmp_path)
    loader(url, tmp_path).load_state_dict(state)
    rows = [json.loads(line)["tokens"] for line in open(tmp_path / "a.jsonl")]
    assert [d.tolist() for d in open_source(Storage().paths(url)).read(0, np.arange(80))] == rows


@pytest.mark.parametrize("server", [True], indirect=True)
def test_last_modified_is_the_version_when_there_is_no_etag(tmp_path, server):
    write_docs(tmp_path / "a.jsonl", 1)
    url = f"{server}/a.jsonl"
    src = open_source(Storage(block_size=1 << 10, memory_bytes=1).paths(url))  # every read asks the server
    write_docs(tmp_path / "a.jsonl", 2)
    os.utime(tmp_path / "a.jsonl", (1e9, 1e9))  # another date, the same size
    with pytest.raises(ShardChanged, match=rf"{re.escape(url)}: the file changed since the source opened it"):
        list(src.read(0, np.arange(80)))
