"""`packloader tokenize`: text shards in, Parquet token shards out, read back through ParquetSource."""

import json
import re
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from packloader.cli.main import main
from packloader.sources.base import IterableSource
from packloader.sources.errors import SourceError
from packloader.sources.open import open_source
from packloader.sources.parquet import ParquetSource
from packloader.sources.pretokenize import tokenize_to_parquet
from packloader.sources.tokenizers import get_tokenizer


def _texts(n, seed=0):
    rng = np.random.default_rng(seed)
    return [f"#{seed}.{i} " + "lorem ipsum ünï 😀 " * int(rng.integers(1, 40)) for i in range(n)]


def _read_all(src):
    return [d for shard, info in enumerate(src.shards) for d in src.read(shard, np.arange(info.num_rows))]


@pytest.mark.multiprocess
def test_cli_round_trip_subprocess(tmp_path):
    a, b = _texts(150, 0), _texts(80, 1)
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in a))
    (tmp_path / "in" / "b.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in b))
    out = tmp_path / "out"
    res = subprocess.run(
        [sys.executable, "-m", "packloader.cli.main", "tokenize", str(tmp_path / "in" / "a.jsonl"),
         str(tmp_path / "in" / "b.jsonl"), "--out", str(out), "--tokenizer", "tekken", "--shard-tokens", "3000",
         "--row-group-tokens", "700", "--threads", "2"],
        capture_output=True, text=True, timeout=300,
    )
    assert res.returncode == 0, res.stderr
    assert "230 documents" in res.stdout and "EOS appended" in res.stdout
    assert "tokenize" in res.stderr and "doc" in res.stderr  # the progress bar goes to stderr
    files = sorted(out.glob("part-*.parquet"))
    assert len(files) > 2 and not list(out.glob(".*tmp"))

    tok = get_tokenizer("tekken")
    expected = [np.append(ids, tok.eos_id) for ids in tok.encode_batch(a + b)]  # document order kept
    src = ParquetSource(files)
    assert src.pretokenized and src.length_column == "length"
    assert src.metadata["packloader.tokenizer"] == "tekken"
    assert src.metadata["packloader.eos_appended"] == "true" and src.metadata["packloader.eos_id"] == "2"
    got = _read_all(src)
    assert len(got) == len(expected)
    assert all(np.array_equal(g, e) for g, e in zip(got, expected))
    lengths = np.concatenate([src.lengths(s) for s in range(len(src.shards))])
    np.testing.assert_array_equal(lengths, [len(e) for e in expected])

    table = pq.read_table(files[0])
    assert table.schema.field("tokens").type == pa.list_(pa.int32())
    assert table.schema.field("length").type == pa.int32()
    meta = pq.ParquetFile(files[0]).metadata
    assert meta.num_row_groups > 1
    assert meta.row_group(0).column(0).compression == "ZSTD"
    # --shard-tokens: every file but the last reaches the budget, and only just
    for f in files[:-1]:
        n = int(pq.read_table(f).column("length").to_numpy().sum())
        assert 3000 <= n < 3000 + max(len(e) for e in expected)


def test_main_parquet_input_no_eos_and_bytes(tmp_path, capsys):
    texts = _texts(40, 2)
    pq.write_table(pa.table({"body": texts, "n": np.arange(40)}), tmp_path / "t.parquet", row_group_size=7)
    out = tmp_path / "tok"
    rc = main(["tokenize", str(tmp_path / "t.parquet"), "--out", str(out), "--tokenizer", "bytes", "--column", "body",
               "--no-eos", "--no-progress"])
    assert rc == 0
    got = _read_all(open_source(out))
    assert [g.tobytes() for g in got] == [np.frombuffer(t.encode(), np.uint8).astype(np.int32).tobytes() for t in texts]
    assert ParquetSource(sorted(out.glob("*.parquet"))).metadata["packloader.eos_appended"] == "false"
    capsys.readouterr()
    assert main(["tokenize", str(tmp_path / "t.parquet"), "--out", str(out), "--tokenizer", "bytes", "--column",
                 "body"]) == 2
    err = capsys.readouterr().err
    assert "packloader tokenize: error: " in err and "already holds token shards" in err
    assert main(["tokenize", str(tmp_path / "t.parquet"), "--out", str(out), "--tokenizer", "bytes", "--column",
                 "body", "--overwrite", "--no-progress"]) == 0
    assert len(_read_all(open_source(out))) == 40


def test_skip_empty_and_bad_input(tmp_path, capsys):
    d = tmp_path / "docs"
    d.mkdir()
    (d / "a.txt").write_text("first")
    (d / "b.txt").write_text("")
    (d / "c.txt").write_bytes("caf\xe9".encode("latin-1"))
    (d / "d.txt").write_text("last")
    out = tmp_path / "out"
    assert main(["tokenize", str(d), "--out", str(out), "--tokenizer", "bytes", "--no-progress"]) == 2
    assert re.search(r"error: .*docs/b\.txt: empty document", capsys.readouterr().err)
    assert main(["tokenize", str(tmp_path / "missing.jsonl"), "--out", str(out)]) == 2
    assert "no such file or directory: " + str(tmp_path / "missing.jsonl") in capsys.readouterr().err
    assert not list(out.glob("*.parquet")) and not list(out.glob(".*"))  # nothing half-written is left
    rc = main(["tokenize", str(d), "--out", str(out), "--tokenizer", "bytes", "--no-progress", "--skip-empty",
               "--skip-bad-files"])
    assert rc == 0
    err = capsys.readouterr().err
    assert "1 empty documents" in err and "1 non-UTF-8 files" in err
    got = _read_all(open_source(out))
    assert [bytes(g[:-1].astype(np.uint8)).decode() for g in got] == ["first", "last"]
    assert all(g[-1] == 256 for g in got)


def test_pattern_decides_what_is_read(tmp_path, capsys):
    """`--pattern '**/*.py'` reads the .py files, never a stray JSON file beside them; a directory mixing them
    without a pattern is refused with both listed, and nothing is written."""
    d = tmp_path / "src"
    (d / "sub").mkdir(parents=True)
    (d / "a.py").write_text("print('a')")
    (d / "sub" / "b.py").write_text("print('b')")
    (d / "sub" / "data.json").write_text(json.dumps({"text": "stray"}) + "\n")
    out = tmp_path / "out"
    assert main(["tokenize", str(d), "--pattern", "**/*.py", "--out", str(out), "--tokenizer", "bytes", "--no-eos",
                 "--no-progress"]) == 0
    got = [bytes(g.astype(np.uint8)).decode() for g in _read_all(open_source(out))]
    assert got == ["print('a')", "print('b')"]
    capsys.readouterr()
    assert main(["tokenize", str(d), "--out", str(tmp_path / "o2"), "--tokenizer", "bytes", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "mixes file formats" in err and "data.json" in err and "a.py" in err
    assert not list((tmp_path / "o2").glob("*.parquet"))


def test_tokenize_writes_page_checksums(tmp_path):
    summary = tokenize_to_parquet(IterableSource(["ab", "c"]), get_tokenizer("bytes"), tmp_path / "o", progress=False)
    data = bytearray(open(summary.files[0], "rb").read())
    col = pq.ParquetFile(summary.files[0]).metadata.row_group(0).column(0)
    data[col.data_page_offset + col.total_compressed_size - 2] ^= 0x10
    (tmp_path / "bad.parquet").write_bytes(bytes(data))
    with pytest.raises(SourceError, match="CRC checksum"):
        list(ParquetSource(tmp_path / "bad.parquet").read(0, [0, 1]))


def test_library_function_refuses_tokens_and_missing_eos(tmp_path):
    from packloader.sources.base import IterableSource

    with pytest.raises(ValueError, match="already tokenized"):
        tokenize_to_parquet(IterableSource([np.array([1, 2])]), get_tokenizer("bytes"), tmp_path / "o")

    class NoEos:
        name, vocab_size, eos_id = "noeos", 10, None

    with pytest.raises(ValueError, match="has no EOS token"):
        tokenize_to_parquet(IterableSource(["a"]), NoEos(), tmp_path / "o")
    summary = tokenize_to_parquet(IterableSource(["ab", "c"]), get_tokenizer("bytes"), tmp_path / "o",
                                  progress=False)
    assert (summary.documents, summary.tokens, len(summary.files)) == (2, 5, 1)
