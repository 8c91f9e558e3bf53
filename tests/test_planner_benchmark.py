"""Smoke test of benchmarks/planner.py in --quick mode: it runs, checks plans, and rewrites only its own section."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import msgspec
import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def load_benchmark():
    if str(ROOT / "benchmarks") not in sys.path:  # planner.py imports its folder's sections.py, as a script does
        sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("planner_benchmark", ROOT / "benchmarks" / "planner.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_quick_run_writes_only_the_planner_section(tmp_path, capsys):
    bench = load_benchmark()
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# B\n\n<!-- SECTION:loader -->\nkeep me\n<!-- END:loader -->\n\n"
                   "<!-- SECTION:planner -->\n(pending)\n<!-- END:planner -->\n\ntail\n")
    out = tmp_path / "rows.json"
    rc = bench.main(["--quick", "--strategies", "fixed", "concat", "multipack", "karmarkar_karp",
                     "--write", str(doc), "--json", str(out)])
    assert rc == 0
    text = doc.read_text()
    printed = capsys.readouterr().out
    report = printed[printed.index("Measured "):-1]  # the report as printed after the progress lines
    # the section holds the printed report byte for byte, between the markers, as before the shared writer
    assert f"<!-- SECTION:planner -->\n{report}<!-- END:planner -->" in text
    assert "<!-- SECTION:loader -->\nkeep me\n<!-- END:loader -->" in text and text.endswith("\n\ntail\n")
    assert "(pending)" not in text and "benchmarks/planner.py --quick" in text
    rows = msgspec.json.decode(out.read_bytes())["rows"]
    assert {r["strategy"] for r in rows} == {"fixed", "concat", "multipack", "karmarkar_karp"}
    assert all(r["ok"] for r in rows), [r["note"] for r in rows if not r["ok"]]
    # every plan was verified (coverage, cap, equal counts) before scoring; the fixed row is its own baseline
    assert all(abs(r["speedup"] - 1.0) < 1e-12 for r in rows if r["strategy"] == "fixed")


def test_merged_runs_report_every_row_once(tmp_path, capsys):
    """Rows of an earlier run (--json) reported with this run's (--merge): a strategy run again replaces its
    earlier rows, and the section lists both command lines."""
    bench = load_benchmark()
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    assert bench.main(["--quick", "--setups", "dp8-pp4", "--strategies", "fixed", "concat", "--no-cross", "--json", str(a)]) == 0
    first = {(r["setup"], r["strategy"]): r for r in msgspec.json.decode(a.read_bytes())["rows"]}
    assert bench.main(["--quick", "--strategies", "concat", "--no-cross", "--merge", str(a), "--json", str(b)]) == 0
    out = msgspec.json.decode(b.read_bytes())
    keys = [(r["setup"], r["strategy"]) for r in out["rows"]]
    assert len(keys) == len(set(keys)) and ("dp8-pp4", "fixed") in keys and ("dp64", "concat") in keys
    merged = {(r["setup"], r["strategy"]): r for r in out["rows"]}
    assert merged[("dp8-pp4", "fixed")] == first[("dp8-pp4", "fixed")]  # kept from the first run
    assert len(out["commands"]) == 2 and "--merge" in out["commands"][1]
    printed = capsys.readouterr().out
    assert printed.count("$ .venv/bin/python benchmarks/planner.py --quick") >= 3  # each run's report lists its commands


def test_longtail_data_skips_empty_documents_and_keeps_every_token():
    """synthetic-longtail (issue 25's target data) has empty documents and documents past 64K: the benchmark's
    draw leaves the empty ones out, as the loader does, and cuts the rest into pieces that cover every token."""
    bench = load_benchmark()
    lengths = bench.synthetic("synthetic-longtail", 20_000, 0)
    assert (lengths == 0).any() and lengths.max() > 4 * 65536
    setup = bench.Setup("t", 8, 4, 65536, 1 << 20, 3)
    stream = bench.draw_stream(lengths, (1 << 20) * 4, 0)
    windows = bench.windows_for(stream, setup, 65536)
    docs = np.concatenate([w.doc for w in windows])
    assert (np.concatenate([w.length for w in windows]) > 0).all()
    drawn = np.arange(docs.min(), docs.max() + 1)
    assert set(docs.tolist()) == set(drawn[stream[drawn] > 0].tolist())  # every non-empty document, no empty one
    assert sum(int(w.length.sum()) for w in windows) == int(stream[drawn].sum())
