"""Smoke test of benchmarks/planner.py in --quick mode: it runs, checks plans, and rewrites only its own section."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import msgspec

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
