"""The format registry: every reader of formats (opening, the CLI's --format, the unsupported-source error,
docs/formats.md) reads it, and a format added from one file outside the package is opened like the built-in ones."""

import argparse
import importlib
import pathlib
import sys
import textwrap

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from packloader import Format, register_format
from packloader.sources.format_registry import format_names, format_of, markdown_table, unregister_format
from packloader.sources.open import open_source
from packloader.sources.unsupported import UnsupportedSourceError

BUILTIN = ("parquet", "jsonl", "mds", "directory", "arrow", "megatron", "hf-disk")  # written out by hand
DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs" / "formats.md"


def _format_choices(module) -> tuple:
    p = argparse.ArgumentParser()
    module.add_arguments(p)
    return tuple(next(a for a in p._actions if a.dest == "format").choices)


def test_builtin_formats_and_suffixes():
    assert format_names()[: len(BUILTIN)] == BUILTIN
    expected = {"a.parquet": "parquet", "B.PQ": "parquet", "c.jsonl": "jsonl", "d.jsonl.zst": "jsonl",
                "e.ndjson.gz": "jsonl", "f.json": "jsonl", "g.txt": None, "h.arrow": None, "index.json.bak": None}
    assert {name: format_of(name) for name in expected} == expected


def test_docs_table_is_the_registry():
    assert markdown_table() in DOCS.read_text(), "docs/formats.md is stale: paste markdown_table() into it"
    for name in BUILTIN:
        assert f"| `{name}` |" in DOCS.read_text()


def test_cli_offers_every_format():
    from packloader.cli import report, tokenize

    assert _format_choices(tokenize) == BUILTIN
    assert _format_choices(report) == BUILTIN


def test_register_refuses_a_taken_name_and_a_bad_opener():
    with pytest.raises(ValueError, match="'parquet' is already registered"):
        register_format(Format("parquet", "again", "x:y"))
    with pytest.raises(ValueError, match="opener must be 'module:function'"):
        register_format(Format("nocolon", "bad", "just_a_name"))
    assert "nocolon" not in format_names()


@pytest.fixture
def tsv_plugin(tmp_path, monkeypatch):
    """A format defined in one module outside the package (not imported yet): tab-separated lines, the first
    field the text."""
    plugin = tmp_path / "plugin_dir" / "my_tsv_format.py"
    plugin.parent.mkdir()
    plugin.write_text(textwrap.dedent('''
        from packloader import Format, register_format
        from packloader.sources.python_objects import python_source


        def open_tsv(paths, *, column, empty, **_):
            lines = [line.split("\\t")[0] for p in paths for line in open(p).read().splitlines()]
            return python_source(lines, empty=empty, label=",".join(paths))


        register_format(Format("tsv-test", "tab-separated text", "my_tsv_format:open_tsv", suffixes=(".tsv",),
                               column_rule="the first field", recognised_by="suffix .tsv"))
    '''))
    monkeypatch.syspath_prepend(str(plugin.parent))
    yield "my_tsv_format"
    unregister_format("tsv-test")
    sys.modules.pop("my_tsv_format", None)


@pytest.fixture
def tsv_format(tsv_plugin):
    importlib.import_module(tsv_plugin)
    return "tsv-test"


def test_cli_plugin_adds_a_format_choice(tsv_plugin, capsys):
    from packloader.cli.main import main

    assert "tsv-test" not in format_names()
    assert main(["report", "--plugin", tsv_plugin, "--help"]) == 0
    assert "tsv-test" in capsys.readouterr().out


def _texts(source) -> list:
    out = []
    for i, shard in enumerate(source.shards):
        out.extend(source.read(i, np.arange(shard.num_rows)))  # text documents are str
    return out


def test_a_format_from_outside_the_package(tsv_format, tmp_path):
    from packloader.cli import report, tokenize

    data = tmp_path / "docs.tsv"
    data.write_text("alpha one\tx\nbeta two\ty\ngamma\tz\n")
    expected = ["alpha one", "beta two", "gamma"]  # the first field of each line, by hand
    assert _texts(open_source(str(data))) == expected  # recognised by its suffix
    other = tmp_path / "docs.data"
    other.write_text("delta\tq\n")
    assert _texts(open_source(str(other), format=tsv_format)) == ["delta"]  # named
    assert tsv_format in _format_choices(tokenize) and tsv_format in _format_choices(report)
    with pytest.raises(UnsupportedSourceError, match="added formats: tsv-test \\(tab-separated text: .tsv\\)"):
        open_source(object())
    assert f"| `{tsv_format}` | suffix .tsv | no | no | the first field |" in markdown_table()


def test_the_added_format_is_gone_after_unregistering(tmp_path):
    assert "tsv-test" not in format_names()
    with pytest.raises(ValueError, match="format must be one of"):
        open_source(str(tmp_path), format="tsv-test")
    with pytest.raises(UnsupportedSourceError) as e:
        open_source(object())
    assert "added formats" not in str(e.value)


def test_a_local_only_format_is_refused_on_object_storage(tsv_format):
    from packloader.sources.remote_open import open_remote

    with pytest.raises(UnsupportedSourceError, match="format 'tsv-test' is not read from object storage"):
        open_remote(["s3://bucket/a.tsv"], storage=None, column=None, format=tsv_format, empty="error")


def test_builtin_readers_still_open(tmp_path):
    pq.write_table(pa.table({"text": ["one", "two"]}), tmp_path / "a.parquet")
    (tmp_path / "b.jsonl").write_text('{"text": "three"}\n')
    assert _texts(open_source(str(tmp_path / "a.parquet"))) == ["one", "two"]
    assert _texts(open_source(str(tmp_path / "b.jsonl"))) == ["three"]
