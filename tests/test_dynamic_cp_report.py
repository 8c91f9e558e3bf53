"""The report's per-document CP row (issue 26): shown where the layout has context parallelism, every drawn token
planned once, and a note that says whether it beats fixed CP; absent at cp 1, so other reports are unchanged."""

from __future__ import annotations

import numpy as np

from packloader.contracts import ParallelConfig, PlanConfig
from packloader.report.build import ReportOptions, build_report
from packloader.report.lengths import Lengths
from packloader.report.table import render_text

OPTS = ReportOptions(steps=2, strategies=("fixed", "hydraulis"), plots=False, advice=False, progress=False)


def lengths() -> np.ndarray:
    rng = np.random.default_rng(26)
    return np.concatenate([rng.integers(100, 3000, 300), [30000, 50000, 60000]])


def test_dynamic_cp_report_row_and_note():
    cfg = PlanConfig(parallel=ParallelConfig(dp=2, cp=4, tp=8), max_tokens=65536, context=65536,
                     tokens_per_step=200_000)
    report, runs = build_report(Lengths(lengths(), origin="test"), cfg, OPTS)
    row = next(f for f in report.strategies if f.name == "dynamic-cp")
    assert row.status == "ok", row.note
    assert row.tokens_planned == row.tokens_drawn and row.tokens_dropped == row.tokens_duplicated == 0
    assert all(p.cp_mode == "dynamic" and len(p.ranks) == 8 for p in runs["dynamic-cp"].plans)
    note = next(n for n in report.notes if n.startswith("per-document CP (dynamic-cp"))
    assert ("it wins at these settings" in note) != ("fixed CP stays faster" in note)
    text = render_text(report)
    assert "dynamic-cp" in text and "per-document CP" in text


def test_dynamic_cp_report_absent_without_context_parallelism():
    cfg = PlanConfig(parallel=ParallelConfig(dp=2), max_tokens=65536, context=65536, tokens_per_step=200_000)
    report, _ = build_report(Lengths(lengths(), origin="test"), cfg, OPTS)
    assert [f.name for f in report.strategies] == ["fixed", "hydraulis"]
    assert not any("per-document CP" in n for n in report.notes)


def test_dynamic_cp_plan_cli_writes_placements(tmp_path):
    import json

    from packloader.cli.main import main

    np.save(tmp_path / "lengths.npy", lengths())
    out = tmp_path / "plan.jsonl"
    code = main(["plan", "--lengths", str(tmp_path / "lengths.npy"), "--dp", "2", "--cp", "2", "--tp", "8",
                 "--max-tokens", "65536", "--context", "65536", "--tokens-per-step", "200000", "--cp-mode", "dynamic",
                 "--out", str(out), "--quiet"])
    assert code == 0
    count = {d: np.zeros(n, np.int64) for d, n in enumerate(lengths())}
    for line in out.read_text().splitlines():
        rec = json.loads(line)
        assert rec["cp_mode"] == "dynamic" and len(rec["ranks"]) == len(rec["cp"]) == 4
        for g, (mbs, cps) in enumerate(zip(rec["ranks"], rec["cp"])):
            for segs, places in zip(mbs, cps):
                assert len(segs) == len(places)
                for (doc, start, end, _), (size, first) in zip(segs, places):
                    assert first <= g < first + size and first % size == 0
                    if g == first:
                        count[doc][start:end] += 1
    assert all((c == 1).all() for c in count.values())
