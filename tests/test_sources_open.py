"""open_source: format detection by extension and directory contents; missing paths."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from packloader.sources.directory import DirectorySource
from packloader.sources.jsonl import JsonlSource
from packloader.sources.open import open_source
from packloader.sources.parquet import ParquetSource


def _parquet(path, texts):
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"text": texts}), path)
    return path


def _jsonl(path, texts):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def test_files_by_extension(tmp_path):
    p = _parquet(tmp_path / "a.parquet", ["x", "y"])
    j = _jsonl(tmp_path / "b.jsonl", ["z"])
    assert isinstance(open_source(p), ParquetSource)
    assert isinstance(open_source(str(j)), JsonlSource)
    two = open_source([_parquet(tmp_path / "c.parquet", ["w"]), p])
    assert [s.name for s in two.shards] == [str(p), str(tmp_path / "c.parquet")]
    with pytest.raises(ValueError, match="cannot tell the format"):
        open_source([p, j])
    assert list(open_source(j, format="jsonl").read(0, [0])) == ["z"]


def test_glob(tmp_path):
    for k in range(3):
        _parquet(tmp_path / "d" / f"part-{k}.parquet", [str(k)])
    src = open_source(str(tmp_path / "d" / "part-*.parquet"))
    assert len(src.shards) == 3
    with pytest.raises(FileNotFoundError, match=r"no files match .*\*\.jsonl"):
        open_source(str(tmp_path / "d" / "*.jsonl"))


def test_directories(tmp_path):
    _parquet(tmp_path / "pq" / "x" / "a.parquet", ["a"])
    _parquet(tmp_path / "pq" / "b.parquet", ["b"])
    (tmp_path / "pq" / "README.md").write_text("ignored")
    src = open_source(tmp_path / "pq")
    assert isinstance(src, ParquetSource) and len(src.shards) == 2
    _jsonl(tmp_path / "js" / "a.jsonl", ["a"])
    assert isinstance(open_source(tmp_path / "js"), JsonlSource)
    (tmp_path / "txt").mkdir()
    (tmp_path / "txt" / "one.txt").write_text("hello")
    (tmp_path / "txt" / "two.md").write_text("world")
    text = open_source(tmp_path / "txt")
    assert isinstance(text, DirectorySource) and len(text.files) == 2
    only_md = open_source(tmp_path / "txt", pattern="*.md")
    assert list(only_md.read(0, [0])) == ["world"]
    assert isinstance(open_source(tmp_path / "js", format="directory"), DirectorySource)
    with pytest.raises(FileNotFoundError, match=r"no parquet files under"):
        open_source(tmp_path / "txt", format="parquet")


def test_a_directory_is_read_whole_or_refused(tmp_path):
    """Files beside shards (_SUCCESS, README) do not count; any other mix is refused with the files listed;
    format= reads one kind on purpose; the pattern decides what counts."""
    d = tmp_path / "d"
    _parquet(d / "a.parquet", ["a"] * 100)
    (d / "_SUCCESS").write_text("")
    (d / "LICENSE").write_text("MIT")
    (d / ".hidden.jsonl").write_text("not read")
    assert isinstance(open_source(d), ParquetSource)
    _jsonl(d / "b.jsonl", ["b"] * 100)
    with pytest.raises(ValueError, match=r"mixes file formats \(parquet: .*a\.parquet; jsonl: .*b\.jsonl\)"):
        open_source(d)
    assert len(open_source(d, format="jsonl")) == 100 and len(open_source(d, format="parquet")) == 100
    assert isinstance(open_source(d, pattern="*.jsonl"), JsonlSource)
    (d / "b.jsonl").unlink()
    (d / "notes.csv").write_text("x,y")
    with pytest.raises(ValueError, match=r"parquet: .*a\.parquet; other: .*notes\.csv"):
        open_source(d)

    code = tmp_path / "code"
    (code / "pkg").mkdir(parents=True)
    (code / "pkg" / "m.py").write_text("x = 1")
    (code / "sub").mkdir()
    _jsonl(code / "sub" / "data.json", ["stray"])
    src = open_source(code, pattern="**/*.py")  # the stray JSON file is not what the pattern asks for
    assert isinstance(src, DirectorySource) and [p.rsplit("/", 1)[-1] for p in src.files] == ["m.py"]
    with pytest.raises(FileNotFoundError, match=r"no files match '\*\.py'"):
        open_source(code, pattern="*.py")  # top level only: nothing there
    with pytest.raises(ValueError, match="mixes file formats"):
        open_source(code)


def test_mds_directory(tmp_path):
    pytest.importorskip("streaming")
    from streaming import MDSWriter

    from packloader.sources.mds import MdsSource

    with MDSWriter(out=str(tmp_path / "m"), columns={"text": "str"}) as w:
        w.write({"text": "hi"})
    src = open_source(tmp_path / "m")
    assert isinstance(src, MdsSource) and list(src.read(0, [0])) == ["hi"]


def test_missing_path_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no such file or directory: .*missing\.parquet"):
        open_source(tmp_path / "missing.parquet")
    with pytest.raises(FileNotFoundError, match="missing-too"):
        open_source([_parquet(tmp_path / "a.parquet", ["a"]), tmp_path / "missing-too.parquet"])
    with pytest.raises(ValueError, match="format must be one of"):
        open_source(tmp_path, format="csv")
