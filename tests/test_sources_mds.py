"""MdsSource on local shards written by streaming's MDSWriter, read without StreamingDataset."""

import json
import os

import numpy as np
import pytest

streaming = pytest.importorskip("streaming")

from packloader.sources.errors import EmptyDocumentError, NonUtf8Error, SourceError  # noqa: E402
from packloader.sources.mds import MdsSource  # noqa: E402

RNG = np.random.default_rng(5)


def _samples(n, seed=0):
    rng = np.random.default_rng(seed)
    return [
        {
            "text": f"sample {i} ünï " * int(rng.integers(1, 20)),
            "tokens": rng.integers(0, 2**31 - 1, size=int(rng.integers(1, 300))).astype(np.int32),
            "id": i,
        }
        for i in range(n)
    ]


def _write(out, samples, compression=None, size_limit=4096):
    from streaming import MDSWriter

    columns = {"text": "str", "tokens": "ndarray:int32", "id": "int"}
    with MDSWriter(out=str(out), columns=columns, size_limit=size_limit, compression=compression) as w:
        for s in samples:
            w.write(s)


def _reference_rows(src, samples):
    """Global sample index of (shard, row), from the shard sizes in order."""
    starts = np.concatenate(([0], np.cumsum([s.num_rows for s in src.shards])))
    return lambda shard, row: samples[starts[shard] + row]


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_text_and_tokens_random_order(tmp_path, compression):
    samples = _samples(150)
    _write(tmp_path / "mds", samples, compression)
    shm_before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    text = MdsSource(tmp_path / "mds", column="text")
    with pytest.raises(SourceError, match=r"shard.00000.mds: holds text \('text'\) and tokens \('tokens'\)"):
        MdsSource(tmp_path / "mds")  # both kinds and no column named: which to train is not guessed
    tokens = MdsSource(tmp_path / "mds", column="tokens")
    assert len(text.shards) > 2 and sum(s.num_rows for s in text.shards) == 150
    assert not text.pretokenized and tokens.pretokenized
    ref = _reference_rows(text, samples)
    for shard, info in enumerate(text.shards):
        rows = RNG.permutation(info.num_rows)
        assert list(text.read(shard, rows)) == [ref(shard, r)["text"] for r in rows]
        out = list(tokens.read(shard, rows))
        assert all(o.dtype == np.int32 and o.flags.writeable for o in out)
        assert [o.tolist() for o in out] == [ref(shard, r)["tokens"].tolist() for r in rows]
    # streaming's own reader agrees on an uncompressed shard (it cannot read a compressed one locally)
    if compression is None:
        from streaming.base.format import reader_from_json

        obj = json.loads((tmp_path / "mds" / "index.json").read_text())["shards"][1]
        reader = reader_from_json(str(tmp_path / "mds"), None, obj)
        assert list(text.read(1, [3, 0])) == [reader.get_item(3)["text"], reader.get_item(0)["text"]]
    shm_after = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    assert shm_after - shm_before == set()  # no shared memory left behind


def test_missing_index(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"index\.json"):
        MdsSource(tmp_path)


def test_missing_shard_file(tmp_path):
    _write(tmp_path / "mds", _samples(40))
    (tmp_path / "mds" / "shard.00001.mds").unlink()
    src = MdsSource(tmp_path / "mds", column="text")
    with pytest.raises(FileNotFoundError, match=r"shard\.00001\.mds"):
        list(src.read(1, [0]))


def test_corrupt_shard(tmp_path):
    _write(tmp_path / "mds", _samples(40))
    (tmp_path / "mds" / "shard.00000.mds").write_bytes(b"\x07\x00")
    with pytest.raises(SourceError, match=r"shard\.00000\.mds: truncated MDS shard"):
        list(MdsSource(tmp_path / "mds", column="text").read(0, [0]))


def test_wrong_column_encoding_and_missing_column(tmp_path):
    _write(tmp_path / "mds", _samples(10))
    with pytest.raises(SourceError, match=r"shard\.00000\.mds, column 'id': encoding 'int', expected 'str'"):
        MdsSource(tmp_path / "mds", column="id")
    with pytest.raises(SourceError, match=r"shard\.00000\.mds: no column 'body'; the shard has columns"):
        MdsSource(tmp_path / "mds", column="body")


def test_empty_text_error_or_skip(tmp_path):
    samples = _samples(12)
    samples[4]["text"] = ""
    _write(tmp_path / "mds", samples, size_limit=1 << 20)
    src = MdsSource(tmp_path / "mds", column="text")
    with pytest.raises(EmptyDocumentError, match=r"shard\.00000\.mds, row 4: empty document"):
        list(src.read(0, np.arange(12)))
    skipping = MdsSource(tmp_path / "mds", column="text", empty="skip")
    assert skipping.shards[0].num_rows == 11 and skipping.skipped["empty documents"] == 1
    assert list(skipping.read(0, [4])) == [samples[5]["text"]]


def test_non_utf8_text(tmp_path):
    _write(tmp_path / "mds", _samples(3), size_limit=1 << 20)
    path = tmp_path / "mds" / "shard.00000.mds"
    data = bytearray(path.read_bytes())
    pos = data.find(b"sample 1")
    data[pos : pos + 6] = b"\xff\xfe\xfd\xfc\xfb\xfa"
    path.write_bytes(bytes(data))
    src = MdsSource(tmp_path / "mds", column="text")
    with pytest.raises(NonUtf8Error, match=r"shard\.00000\.mds, row 1, column 'text': text is not valid UTF-8"):
        list(src.read(0, [0, 1]))


def test_missing_extra_is_a_clear_error(tmp_path, monkeypatch):
    import sys

    _write(tmp_path / "mds", _samples(3))
    for name in [m for m in sys.modules if m == "streaming" or m.startswith("streaming.")]:
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ImportError, match=r"pip install 'packloader\[mds\]'"):
        MdsSource(tmp_path / "mds")
