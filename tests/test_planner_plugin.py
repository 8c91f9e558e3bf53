"""A planner added from outside the package in one file (tests/plugins/round_robin.py) is a strategy of the
library, of `auto`, of `packloader plan` and of `packloader report` (`--plugin`), with its options reachable from
PlanConfig.planner_options; nothing in packloader names it."""

from __future__ import annotations

import dataclasses
import json
import sys

import msgspec
import numpy as np
import pytest

from packloader.balancers.factory import make_planner
from packloader.balancers.planners.auto import AutoPlanner
from packloader.balancers.planners.registry import _REGISTRY, StepLayout, Window, load_plugins, report_strategies
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


def test_auto_and_the_report_name_no_planner():
    """What `auto` and every report module know of planners comes from the registry: no string constant in their
    code is a planner's name (docstrings aside), and none imports a planner's own module."""
    import ast
    from pathlib import Path

    import packloader.balancers.planners.auto as auto_mod
    import packloader.report as report_pkg
    from packloader.balancers.planners.registry import planner_specs

    specs = planner_specs()
    names = {s.name for s in specs}
    planner_modules = {s.factory.__module__ for s in specs}
    files = [Path(auto_mod.__file__), *sorted(Path(report_pkg.__file__).parent.glob("*.py"))]
    assert len(files) > 8  # advice, build, run, table, ... all read
    for path in files:
        tree = ast.parse(path.read_text())
        docs = {id(n.body[0].value) for n in ast.walk(tree) if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef))
                and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        named = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and id(n) not in docs} & names
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        # "auto" registers itself under its own name; nothing else
        mine = path == Path(auto_mod.__file__)
        assert named <= ({"auto"} if mine else set()), (path.name, named)
        assert not (imported & planner_modules) - ({auto_mod.__name__} if mine else set()), (path.name, imported & planner_modules)


PROBE = "rank_costs_probe_test"


@pytest.fixture
def probe():
    """A planner of heterogeneous ranks registered from outside, first in the report's order: Hydraulis' factory,
    recording the cost model it is given."""
    from packloader.balancers.planners.registry import planner_spec, register_planner

    seen = []
    hyd = planner_spec("hydraulis")

    def make(config, options, model):
        seen.append(model)
        return hyd.factory(config, options, model)

    register_planner(PROBE, options=hyd.options, rank_costs=True, report_order=0, summary="probe")(make)
    yield seen
    _REGISTRY.pop(PROBE, None)


def test_grouping_advice_plans_with_the_registrys_rank_costs_planner(probe):
    """The report's grouping advice asks the registry which planner plans heterogeneous ranks: a plugin that says
    it does (and comes first) gets every grouping, with a cost model and cap per rank, and plans what
    HydraulisPlanner(models=, caps=) plans directly (the advice's code before the registry knew)."""
    from packloader.balancers.cost.cp_comm import cp_comm_for
    from packloader.balancers.cost.resolve import RankCosts, load_cost_model
    from packloader.balancers.planners.hydraulis import HydraulisPlanner
    from packloader.balancers.planners.registry import rank_costs_planner
    from packloader.balancers.sim.metrics import score_plans
    from packloader.report.advice import grouping_candidates, merged_model, with_group_traffic
    from packloader.report.draw import draw_steps
    from packloader.report.run import run_planner

    cap = 8192
    cfg = PlanConfig(strategy="wlb", parallel=ParallelConfig(dp=4), max_tokens=cap, context=cap, model="tiny",
                     tokens_per_step=4 * 3 * cap)
    rng = np.random.default_rng(5)
    draw = draw_steps(np.clip(rng.lognormal(7, 1.2, 400), 16, cap).astype(np.int64), cfg.tokens_per_step, cap, 2)
    model = load_cost_model("tiny", cfg.parallel)
    comm = cp_comm_for("tiny", cfg.parallel, device=cfg.device)
    assert rank_costs_planner().name == PROBE
    cands = grouping_candidates(cfg, draw, model, None, None)
    # dp 4 by hand: groups of 2 (one, with 2 plain ranks; two) and one group of 4
    assert [(c.groups[0].count, c.groups[0].gpus_per_group, len(c.groups)) for c in cands] == [(1, 2, 2), (2, 2, 1), (1, 4, 1)]
    assert {c.planner for c in cands} == {PROBE} and all(c.step_time_total > 0 for c in cands)
    ranked = [m for m in probe if isinstance(m, RankCosts)]
    assert [m.caps for m in ranked[:1]] == [[2 * cap, cap, cap]]
    for (g, k), cand in zip([(2, 1), (2, 2), (4, 1)], cands):
        plain = 4 - k * g
        models, caps = [merged_model(model, g)] * k + [model] * plain, [cap * g] * k + [cap] * plain
        sub = msgspec.structs.replace(cfg, strategy="hydraulis", parallel=ParallelConfig(dp=k + plain))
        direct = run_planner(lambda: HydraulisPlanner(sub, models=models, caps=caps), "hydraulis", sub, draw, warmup=False)
        assert direct.ok
        # each merged micro-batch also pays its CP group's K/V all-gather (cp 1 x g GPUs)
        plans = [with_group_traffic(p, models, k, comm, g) for p in direct.plans]
        _, agg = score_plans(plans, models, sub.parallel, max_tokens=cap, schedule=cfg.schedule,
                             drawn=draw.doc_step, use_plan_costs=True)
        assert cand.step_time_total == pytest.approx(agg.step_time_total, rel=1e-12)
    # without a planner of heterogeneous ranks there is no grouping advice
    saved = dict(_REGISTRY)
    try:
        for name, spec in saved.items():
            _REGISTRY[name] = dataclasses.replace(spec, rank_costs=False)
        assert rank_costs_planner() is None and grouping_candidates(cfg, draw, model, None, None) == []
    finally:
        _REGISTRY.update(saved)
