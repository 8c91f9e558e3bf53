"""When no candidate plan fits in memory, `auto` logs a warning that says by how much and what to change, and
following the advice makes the plans fit (checked by planning again with it)."""

from __future__ import annotations

import logging
import re

import msgspec
import numpy as np
import pytest

from packloader.balancers.planners.auto import AutoPlanner
from packloader.balancers.planners.registry import StepLayout, Window
from packloader.contracts import ParallelConfig, PlanConfig, PlannerState

# tp 1 and 32K micro-batches of llama3-8b on an H100: even one micro-batch in flight outgrows a stage
CFG = PlanConfig(parallel=ParallelConfig(dp=2, pp=2), max_tokens=32768, context=32768)


def window(cap: int) -> Window:
    rng = np.random.default_rng(2)
    return Window.from_lengths(np.minimum(rng.pareto(1.0, 40) * 2000 + 64, cap).astype(np.int64))


def plan(cfg: PlanConfig):
    return AutoPlanner(cfg).plan(window(cfg.context), PlannerState(), StepLayout(0, flush=True))[0]


def test_warning_says_by_how_much_and_what_to_change(caplog):
    with caplog.at_level(logging.WARNING, logger="packloader"):
        p = plan(CFG)
    assert p.memory_over > 1
    (rec,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    text = rec.getMessage()
    assert "no candidate plan fits in memory" in text and f"{p.memory_over:.2f}x" in text
    # each suggestion, applied alone, gives plans that fit
    m = re.search(r"max_tokens <= ([\d,]+)", text)
    assert m, text
    cap = int(m.group(1).replace(",", ""))
    assert plan(msgspec.structs.replace(CFG, max_tokens=cap, context=cap)).memory_over == 0.0
    t = re.search(r"tp (\d+) \(now 1\)", text)
    assert t, text
    wider = msgspec.structs.replace(CFG, parallel=msgspec.structs.replace(CFG.parallel, tp=int(t.group(1))))
    assert plan(wider).memory_over == 0.0


def test_only_the_first_step_warns(caplog):
    auto = AutoPlanner(CFG)
    with caplog.at_level(logging.WARNING, logger="packloader"):
        for s in range(3):
            auto.plan(window(CFG.context), PlannerState(), StepLayout(s, flush=True))
    assert auto.memory_over_steps == 3
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1


@pytest.mark.parametrize("require", [False, True])
def test_plan_cli_writes_memory_over_and_require_fit_fails(tmp_path, require, capsys):
    from packloader.cli.main import main

    lengths = tmp_path / "lengths.txt"
    lengths.write_text("\n".join(str(int(n)) for n in window(32768).length) + "\n")
    out = tmp_path / "plan.jsonl"
    argv = ["plan", "--lengths", str(lengths), "--dp", "2", "--pp", "2", "--max-tokens", "32768",
            "--tokens-per-step", "131072", "--out", str(out)] + (["--require-fit"] if require else [])
    rc = main(argv)
    recs = [msgspec.json.decode(line) for line in out.read_bytes().splitlines()]
    assert recs and all("memory_over" in r for r in recs)
    over = [r["memory_over"] for r in recs if r["memory_over"] > 0]
    assert over, "the test needs steps that do not fit"
    err = capsys.readouterr().err
    assert f"{len(over)} of {len(recs)} steps do not fit in memory" in err
    assert rc == (3 if require else 0)
