"""A planner added from outside the package in one file (tests/plugins/round_robin.py) is a strategy of the
library, of `auto`, of `packloader plan` and of `packloader report` (`--plugin`), with its options reachable from
PlanConfig.planner_options; nothing in packloader names it."""

from __future__ import annotations

import json
import sys

import msgspec
import numpy as np
import pytest

from packloader.balancers.planners.auto import AutoPlanner
from packloader.balancers.planners.registry import (
    _REGISTRY,
    StepLayout,
    Window,
    load_plugins,
    make_planner,
    report_strategies,
)
from packloader.balancers.sim.metrics import score_plan
from packloader.cli.main import main
from packloader.contracts import ParallelConfig, PlanConfig, PlannerState
from packloader.loader.state import validate_config

MODULE, NAME = "plugins.round_robin", "round_robin_test"
LENGTHS = [5, 4096, 17, 300, 9, 1000, 2]
# by hand from the plugin's docstring, 2 pieces at most per micro-batch, cap 4096, dp 2: micro-batches
# [0] [1] [2, 3] [4, 5] [6], micro-batch k on rank k % 2
BY_HAND = [[[0], [2, 3], [6]], [[1], [4, 5], []]]


@pytest.fixture
def fresh():
    """Neither imported nor registered before the test, and forgotten after it (other tests see no plugin)."""
    _REGISTRY.pop(NAME, None)
    sys.modules.pop(MODULE, None)
    yield
    _REGISTRY.pop(NAME, None)
    sys.modules.pop(MODULE, None)


def docs_by_rank(plan) -> list:
    return [[[s.doc for s in mb.segments] for mb in r.micro_batches] for r in plan.ranks]


def test_planner_options_reach_the_plugin_and_unknown_keys_are_named(fresh):
    load_plugins([MODULE])
    raw = dict(strategy=NAME, parallel=dict(dp=2), max_tokens=4096, context=4096, tokens_per_step=8192,
               planner_options={NAME: {"per_micro_batch": 2}})
    plan, state = make_planner(validate_config(raw)).plan(Window.from_lengths(np.array(LENGTHS)), PlannerState(), 0)
    assert docs_by_rank(plan) == BY_HAND and not state.queued
    with pytest.raises(ValueError, match=r"planner_options\['round_robin_test'\].*per_mb"):
        validate_config({**raw, "planner_options": {NAME: {"per_mb": 2}}})
    with pytest.raises(ValueError, match="planner_options names 'nope', which is no planner"):
        validate_config({**raw, "planner_options": {"nope": {}}})
    with pytest.raises(ValueError, match=r"planner_options\['wlb'\].*fil"):
        validate_config({**raw, "planner_options": {"wlb": {"fil": 0.5}}})


def test_auto_plans_with_the_plugin(fresh):
    load_plugins([MODULE])
    # pieces of one micro-batch each: every candidate plans the same 8 micro-batches, so all tie and the first in
    # auto's order wins (module docstring of auto); the plugin's entry puts it first
    cfg = PlanConfig(strategy="auto", parallel=ParallelConfig(dp=2, pp=1), max_tokens=4096, context=4096,
                     tokens_per_step=8 * 4096, allow_slicing=False)
    auto = AutoPlanner(cfg)
    window = Window.from_lengths(np.full(8, 4096))
    plan, _ = auto.plan(window, PlannerState(), StepLayout(0, flush=True))
    assert plan.planner == NAME
    assert docs_by_rank(plan) == [[[0], [2], [4], [6]], [[1], [3], [5], [7]]]
    # on a long tail auto scores the plugin like the others: its score over wlb's is their simulated step times'
    # ratio (metrics.score_plan, the plan-level simulator)
    rng = np.random.default_rng(3)
    window = Window.from_lengths(np.clip(rng.lognormal(np.log(600), 1.4, 64), 16, 4096).astype(np.int64))
    auto.plan(window, PlannerState(), StepLayout(0, flush=True))
    scores = {c.planner: s for c, s in auto.last_scores if c.micro_batches is None}
    assert NAME in scores and "wlb" in scores
    times = {}
    for name in (NAME, "wlb"):
        sub = msgspec.structs.replace(cfg, strategy=name)
        p, _ = make_planner(sub).plan(window, PlannerState(), StepLayout(0, flush=True))
        times[name] = score_plan(p, auto.model, cfg.parallel).step_time
    assert scores[NAME] / scores["wlb"] == pytest.approx(times[NAME] / times["wlb"], rel=1e-6)


def test_packloader_plan_loads_the_plugin(fresh, tmp_path, capsys):
    np.save(tmp_path / "l.npy", np.array(LENGTHS))
    args = ["plan", "--lengths", str(tmp_path / "l.npy"), "--dp", "2", "--max-tokens", "4096", "--tokens-per-step",
            "8192", "--strategy", NAME, "--quiet", "--planner-options", json.dumps({NAME: {"per_micro_batch": 2}})]
    assert main(args) == 2  # not loaded: an unknown strategy
    assert f"unknown planner strategy {NAME!r}" in capsys.readouterr().err
    assert main([*args, "--plugin", "plugins.no_such_module"]) == 2
    assert "--plugin plugins.no_such_module: cannot import it" in capsys.readouterr().err
    assert main([*args, "--plugin", MODULE]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    ranks = json.loads(line)["ranks"]
    assert [[[seg[0] for seg in mb] for mb in rank] for rank in ranks] == BY_HAND


def test_packloader_report_loads_the_plugin(fresh, tmp_path, capsys):
    rng = np.random.default_rng(0)
    np.save(tmp_path / "l.npy", np.clip(rng.lognormal(6.5, 1.2, 600), 1, 8192).astype(np.int64))
    code = main(["report", "--plugin", MODULE, "--lengths", str(tmp_path / "l.npy"), "--dp", "2", "--model", "tiny",
                 "--max-tokens", "8192", "--steps", "2", "--strategies", f"fixed,{NAME}", "--out",
                 str(tmp_path / "o"), "--no-advice", "--no-plots", "--no-progress"])
    assert code == 0, capsys.readouterr().err
    rep = json.loads((tmp_path / "o" / "report.json").read_text())
    mine = next(f for f in rep["strategies"] if f["name"] == NAME)
    assert (mine["status"], mine["role"], mine["description"]) == ("ok", "packloader", "round robin in draw order (a test plugin)")
    # and among the report's default strategies, after the shipped packloader planners of lower report_order
    assert report_strategies()[-3:] == ("slimpack", NAME, "auto")


def test_a_shipped_planners_options_reach_it_alone_and_inside_auto():
    """wlb's `fill` from PlanConfig.planner_options: 16 pieces of 1000 tokens under a 4096 cap make
    ceil(16000 / (4096 x fill)) micro-batches, 5 at the default 0.9 and 8 at 0.5 (worked by hand)."""
    window = Window.from_lengths(np.full(16, 1000))
    base = PlanConfig(strategy="wlb", parallel=ParallelConfig(dp=1), max_tokens=4096, context=4096,
                      tokens_per_step=16000)
    counts = {}
    for fill in (None, 0.5):
        cfg = base if fill is None else msgspec.structs.replace(base, planner_options={"wlb": {"fill": fill}})
        plan, _ = make_planner(cfg).plan(window, PlannerState(), StepLayout(0, flush=True))
        counts[fill] = len(plan.ranks[0].micro_batches)
        auto = AutoPlanner(msgspec.structs.replace(cfg, strategy="auto"))
        auto.plan(window, PlannerState(), StepLayout(0, flush=True))
        wlb_counts = {c.micro_batches for c, _ in auto.last_scores if c.planner == "wlb"}
        assert wlb_counts == {None, 2 * counts[fill]}  # its default, and twice it (auto's ladder on small steps)
    assert counts == {None: 5, 0.5: 8}


def test_auto_and_the_report_runner_name_no_planner():
    """What they know of planners comes from the registry: no string constant in their code is a planner's name
    (docstrings aside)."""
    import ast
    from pathlib import Path

    import packloader.balancers.planners.auto as auto_mod
    import packloader.report.run as run_mod
    from packloader.balancers.planners.registry import available_strategies

    names = set(available_strategies())
    for mod in (auto_mod, run_mod):
        tree = ast.parse(Path(mod.__file__).read_text())
        docs = {id(n.body[0].value) for n in ast.walk(tree) if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef))
                and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        named = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and id(n) not in docs} & names
        # "auto" registers itself under its own name; nothing else
        assert named <= ({"auto"} if mod is auto_mod else set()), (mod.__name__, named)
