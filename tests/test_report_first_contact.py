"""What a first-time reader of the report sees: the costs figure compares micro-batches within their own step
(auto, which picks a count per step, no longer looks uneven for being even step by step), and the advice gives
settings, not a mean that reads like one."""

from __future__ import annotations

import json
import types

import numpy as np
import pytest

from packloader.balancers.cost.lookup import cost_model_for
from packloader.balancers.offline import plan_run
from packloader.balancers.sim.metrics import score_plan
from packloader.cli.main import main
from packloader.contracts import ParallelConfig, PlanConfig
from packloader.report.build import _mb_costs
from packloader.report.figures import Advice


def longtail(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.minimum(rng.pareto(1.1, n) * 300 + 64, 60000).astype(np.int64)


@pytest.mark.parametrize("strategy", ["auto", "fixed", "wlb"])
def test_costs_figure_is_each_micro_batch_over_its_steps_mean(strategy):
    cfg = PlanConfig(strategy=strategy, parallel=ParallelConfig(dp=2, pp=2), max_tokens=16384, context=16384,
                     tokens_per_step=131072, model="tiny")
    run = plan_run(longtail(2000, 4), cfg, 6)
    model = cost_model_for(cfg)
    got = _mb_costs(types.SimpleNamespace(plans=run.plans), model, len(run.plans))
    at = 0
    for plan in run.plans:  # no DP-Merge here: every micro-batch once per rank
        n = sum(len(r.micro_batches) for r in plan.ranks)
        step = got[at: at + n]
        at += n
        assert step.mean() == pytest.approx(1.0, rel=1e-9)
        # the step's slowest over its mean is the step's global imbalance degree, scored independently
        assert step.max() == pytest.approx(score_plan(plan, model, cfg.parallel).imbalance_global, rel=1e-9)
    assert at == len(got)


def test_advice_gives_settings():
    own = Advice(strategy="auto", reason="", num_micro_batches=6, max_tokens=32768, speedup_vs_baseline=1.0,
                 baseline="", micro_batches_mean=6.2)
    text = own.settings_text()
    assert "num_micro_batches left to the planner" in text and "6.2 per DP rank on average" in text
    assert "num_micro_batches=6" not in text
    pinned = Advice(strategy="wlb", reason="", num_micro_batches=8, max_tokens=16384, speedup_vs_baseline=1.0,
                    baseline="", micro_batches_pinned=True, micro_batches_mean=8.0)
    assert "num_micro_batches=8 (--micro-batches 8)" in pinned.settings_text()


def test_report_prints_the_settings(tmp_path, capsys):
    np.save(tmp_path / "l.npy", longtail(1500, 2))
    out = tmp_path / "out"
    assert main(["report", "--lengths", str(tmp_path / "l.npy"), "--dp", "2", "--model", "tiny", "--max-tokens",
                 "16384", "--tokens-per-step", "65536", "--steps", "3", "--strategies", "fixed,wlb,auto",
                 "--no-plots", "--no-progress", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    adv = json.loads((out / "report.json").read_text())["advice"]
    line = next(x for x in text.splitlines() if x.strip().startswith("settings:"))
    assert f"strategy={adv['strategy']}" in line and f"max_tokens={adv['max_tokens']:,}" in line
    assert "micro-batches per DP rank," not in text


def test_report_does_not_flood_with_memory_warnings(tmp_path, capsys):
    # llama3-8b on one GPU without tp: nothing fits; the report says so in its notes, not in a warning per planner
    np.save(tmp_path / "l.npy", longtail(800, 3))
    out = tmp_path / "out"
    assert main(["report", "--lengths", str(tmp_path / "l.npy"), "--max-tokens", "4096", "--tokens-per-step", "16384",
                 "--steps", "2", "--strategies", "auto", "--no-plots", "--no-advice", "--no-progress",
                 "--out", str(out)]) == 0
    notes = json.loads((out / "report.json").read_text())["notes"]
    assert any("no candidate fit" in n for n in notes), notes
    assert "no candidate plan fits in memory" not in capsys.readouterr().err
