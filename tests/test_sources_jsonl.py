"""JsonlSource on plain, .gz and .zst shards: random-order reads against json.loads per line, and bad input."""

import gzip
import json
import pickle

import numpy as np
import pytest
import zstandard

from packloader.sources.errors import EmptyDocumentError, NonUtf8Error, SourceError
from packloader.sources.jsonl import JsonlSource, line_index

RNG = np.random.default_rng(11)


def _write(path, lines: list[bytes]):
    data = b"".join(lines)
    if str(path).endswith(".gz"):
        data = gzip.compress(data)
    elif str(path).endswith(".zst"):
        data = zstandard.ZstdCompressor().compress(data)
    path.write_bytes(data)
    return path


def _records(n, seed=0):
    rng = np.random.default_rng(seed)
    text = f"doc {seed}/{{}} \"quoted\" ünïcode 😀 "
    return [{"id": i, "text": text.format(i) * int(rng.integers(1, 9)), "meta": {"a": [1, 2]}} for i in range(n)]


def _reference(path):
    opener = gzip.open if str(path).endswith(".gz") else open
    if str(path).endswith(".zst"):
        with open(path, "rb") as f:
            data = zstandard.ZstdDecompressor().stream_reader(f).read()
    else:
        with opener(path, "rb") as f:
            data = f.read()
    return [json.loads(line) for line in data.splitlines() if line.strip()]


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz", ".jsonl.zst"])
def test_random_order_matches_json_loads(tmp_path, suffix):
    paths = []
    for k, n in enumerate([120, 3]):
        lines = [json.dumps(r, ensure_ascii=k == 0).encode() + b"\n" for r in _records(n, k)]
        lines.insert(5 % n, b"\n   \n")  # blank lines are not documents
        paths.append(_write(tmp_path / f"s{k}{suffix}", lines))
    src = JsonlSource(paths)
    assert not src.pretokenized and src.field == "text"
    assert [s.num_rows for s in src.shards] == [120, 3]
    for shard, p in enumerate(paths):
        ref = [r["text"] for r in _reference(p)]
        rows = RNG.permutation(len(ref))
        assert list(src.read(shard, rows)) == [ref[r] for r in rows]
    clone = pickle.loads(pickle.dumps(src))
    assert list(clone.read(1, [2, 0])) == [_reference(paths[1])[2]["text"], _reference(paths[1])[0]["text"]]


def test_token_field(tmp_path):
    docs = [RNG.integers(0, 100_000, size=int(RNG.integers(1, 50))).tolist() for _ in range(60)]
    p = _write(tmp_path / "tok.jsonl.zst", [json.dumps({"input_ids": d}).encode() + b"\n" for d in docs])
    src = JsonlSource(p)
    assert src.pretokenized and src.field == "input_ids" and src.lengths(0) is None
    rows = RNG.permutation(60)
    out = list(src.read(0, rows))
    assert all(o.dtype == np.int32 for o in out)
    assert [o.tolist() for o in out] == [docs[r] for r in rows]


def test_last_line_without_newline_crlf_and_bom(tmp_path):
    p = _write(tmp_path / "w.jsonl", [b'\xef\xbb\xbf{"text": "a"}\r\n', b'{"text": "b"}\r\n', b'{"text": "c"}'])
    assert list(JsonlSource(p).read(0, [2, 1, 0])) == ["c", "b", "a"]


def test_line_index_counts_lines_like_an_editor():
    buf = b'{"a":1}\n\n  \n{"a":2}\n \t\n{"a":3}'
    starts, ends, numbers = line_index(buf, chunk=5)  # chunk boundaries inside lines
    assert [buf[s:e] for s, e in zip(starts, ends)] == [b'{"a":1}', b'{"a":2}', b'{"a":3}']
    assert numbers.tolist() == [1, 4, 6]
    assert [len(x) for x in line_index(b"")] == [0, 0, 0]
    assert line_index(b"\n\n")[2].tolist() == []


def test_explicit_field(tmp_path):
    p = _write(tmp_path / "f.jsonl", [b'{"text": "no", "body": "yes"}\n'])
    assert list(JsonlSource(p, field="body").read(0, [0])) == ["yes"]


# --- bad input --------------------------------------------------------------------------------------------------


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="gone.jsonl"):
        JsonlSource(tmp_path / "gone.jsonl")


def test_bad_json_line_names_file_and_line(tmp_path):
    p = _write(tmp_path / "bad.jsonl", [b'{"text": "a"}\n', b"\n", b'{"text": "b"\n', b'{"text": "c"}\n'])
    src = JsonlSource(p)
    assert list(src.read(0, [0, 2])) == ["a", "c"]
    with pytest.raises(SourceError, match=r"bad\.jsonl, line 3: not valid JSON"):
        list(src.read(0, [1]))


def test_missing_field_names_line_and_field(tmp_path):
    p = _write(tmp_path / "m.jsonl", [b'{"text": "a"}\n', b'{"txt": "b"}\n'])
    with pytest.raises(SourceError, match=r"m\.jsonl, line 2, field 'text': Object missing required field `text`"):
        list(JsonlSource(p).read(0, [1]))


@pytest.mark.parametrize("name,lines,errors", [
    ("t.jsonl", [b'{"text": "a"}\n', b'{"text": 42}\n', b'[1, 2]\n'],
     {1: r"t\.jsonl, line 2, field 'text': Expected `str`, got `int`",
      2: r"t\.jsonl, line 3, field 'text': Expected `object`, got `array`"}),
    ("tok.jsonl", [b'{"tokens": [1, 2]}\n', b'{"tokens": [1, 2.5]}\n', b'{"tokens": [-1]}\n'],
     {1: r"tok\.jsonl, line 2, field 'tokens': Expected `int`, got `float`",
      2: r"tok\.jsonl, line 3, field 'tokens': Expected `int` >= 0"}),
], ids=["text", "tokens"])
def test_wrong_type_names_line_and_field(tmp_path, name, lines, errors):
    src = JsonlSource(_write(tmp_path / name, lines))
    for row, message in errors.items():  # one source, each bad row read in turn
        with pytest.raises(SourceError, match=message):
            list(src.read(0, [row]))


def test_null_text_names_line_and_field(tmp_path):
    q = _write(tmp_path / "n.jsonl", [b'{"text": null}\n'])
    with pytest.raises(SourceError, match=r"n\.jsonl, line 1, field 'text': null, expected a string"):
        JsonlSource(q)


def test_first_line_decides_kind_and_names_problems(tmp_path):
    p = _write(tmp_path / "k.jsonl", [b'{"other": 1}\n'])
    with pytest.raises(SourceError, match=r"k\.jsonl, line 1: no text or token field among \['other'\]"):
        JsonlSource(p)
    q = _write(tmp_path / "j.jsonl", [b"\n", b'{"text": {"nested": 1}}\n'])
    with pytest.raises(SourceError, match=r"j\.jsonl, line 2, field 'text': object, expected a string"):
        JsonlSource(q)


def test_non_utf8_line(tmp_path):
    p = _write(tmp_path / "l1.jsonl.gz", [b'{"text": "ok"}\n', '{"text": "café"}\n'.encode("latin-1")])
    src = JsonlSource(p)
    with pytest.raises(NonUtf8Error, match=r"l1\.jsonl\.gz, line 2: text is not valid UTF-8"):
        list(src.read(0, [0, 1]))


def test_corrupt_compressed_shard(tmp_path):
    p = tmp_path / "c.jsonl.gz"
    p.write_bytes(b"not gzip data")
    with pytest.raises(SourceError, match=r"c\.jsonl\.gz: cannot be read as gzip JSONL"):
        JsonlSource(p)
    q = tmp_path / "c.jsonl.zst"
    q.write_bytes(b"not zstd data")
    with pytest.raises(SourceError, match=r"c\.jsonl\.zst: cannot be read as zstd"):
        JsonlSource(q)


def test_empty_documents_error_or_skip(tmp_path):
    lines = [b'{"text": "a"}\n', b'{"text": ""}\n', b'{"text": "c"}\n']
    p = _write(tmp_path / "e.jsonl", lines)
    with pytest.raises(EmptyDocumentError, match=r"e\.jsonl, line 2: empty document"):
        list(JsonlSource(p).read(0, [0, 1, 2]))
    src = JsonlSource(p, empty="skip")
    assert src.shards[0].num_rows == 2 and src.skipped["empty documents"] == 1
    assert list(src.read(0, [1, 0])) == ["c", "a"]


def test_all_blank(tmp_path):
    p = _write(tmp_path / "blank.jsonl", [b"\n \n"])
    with pytest.raises(SourceError, match=r"blank\.jsonl: no documents"):
        JsonlSource(p)


def test_threads_share_buffers_safely(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    paths = [_write(tmp_path / f"s{k}.jsonl.gz", [json.dumps(r).encode() + b"\n" for r in _records(50, k)])
             for k in range(4)]
    src = JsonlSource(paths, cache_bytes=1)  # one decompressed shard at a time: threads keep evicting each other
    refs = [[r["text"] for r in _reference(p)] for p in paths]
    jobs = [(k % 4, RNG.permutation(50)) for k in range(16)]
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda job: list(src.read(job[0], job[1])), jobs))
    assert results == [[refs[s][r] for r in rows] for s, rows in jobs]
