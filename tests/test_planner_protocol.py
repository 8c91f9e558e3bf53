"""One planner protocol: `auto`'s candidates are exactly the planners' own plans, and a planner registered from
outside is a strategy like any other (validated, planned, checked)."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from packloader.balancers.factory import make_planner
from packloader.balancers.planners.auto import AutoPlanner
from packloader.balancers.planners.base import PackingPlanner, StepLayout
from packloader.balancers.planners.hydraulis import HydraulisPlanner
from packloader.balancers.planners.packing import Packing, Pieces, whole_pieces_packing
from packloader.balancers.planners.registry import (
    _REGISTRY,
    Window,
    available_strategies,
    check_strategy,
    register_planner,
)
from packloader.balancers.sim.verify import verify_plan
from packloader.contracts import ParallelConfig, PlanConfig, PlannerState
from packloader.loader.state import validate_config


def _lengths(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.minimum(rng.lognormal(7.0, 1.3, n).astype(np.int64) + 1, 4096)


@pytest.mark.parametrize("pp,slicing", [(1, False), (2, True)])
def test_auto_candidates_are_the_planners_own_plans(pp, slicing):
    cfg = PlanConfig(strategy="auto", parallel=ParallelConfig(dp=2, pp=pp), max_tokens=4096, context=4096,
                     tokens_per_step=64 * 1024, allow_slicing=slicing)
    auto = AutoPlanner(cfg)
    window = Window.from_lengths(_lengths(60, pp))
    pieces = Pieces.of(window, PlannerState(), 0)
    checked = set()
    for cand in auto.candidates(pieces):
        got = auto.solve_candidate(cand, pieces, 0, False, True).costs(auto.model).to_step_plan(0)
        sub = msgspec.structs.replace(auto.sub_config, strategy=cand.planner, num_micro_batches=cand.micro_batches)
        if cand.planner == "hydraulis":  # auto runs it with one dispatch trial and three V values
            alone = HydraulisPlanner(sub, trials=1, v_limit=3)
        else:
            alone = make_planner(sub)
        want, _ = alone.plan(window, PlannerState(), 0)
        assert msgspec.to_builtins(got.ranks) == msgspec.to_builtins(want.ranks) or cand.planner == "fixed", cand
        if cand.planner == "fixed":  # fixed prices nothing: compare the segments
            def segments(p):
                return [[msgspec.to_builtins(mb.segments) for mb in r.micro_batches] for r in p.ranks]

            assert segments(got) == segments(want), cand
        checked.add(cand.planner)
    # verl's Karmarkar-Karp is a candidate at PP 1 only (issue 38)
    assert checked == ({"wlb", "hydraulis", "fixed", "slimpack"} if slicing else
                       {"wlb", "hydraulis", "fixed", "karmarkar_karp"})


class OnePerMicroBatch(PackingPlanner):
    """Piece i alone in micro-batch i, dealt round-robin: rank i % dp, position i // dp."""

    name = "one_per_mb_test"

    def __init__(self, config: PlanConfig) -> None:
        super().__init__(config, uses_model=False)

    def solve(self, pieces: Pieces, layout: StepLayout, model=None) -> Packing:
        dp = self.config.parallel.dp
        per_rank = max(1, -(-len(pieces) // dp))
        b = np.arange(per_rank * dp, dtype=np.int64)
        rank_mbs = np.empty((dp, per_rank), np.int64)
        rank_mbs[b % dp, b // dp] = b
        return whole_pieces_packing(pieces, np.arange(len(pieces), dtype=np.int64), rank_mbs, strategy=self.name)

    def priced(self, packing: Packing, step: int):
        return packing.to_step_plan(step)


@pytest.fixture
def registered():
    register_planner("one_per_mb_test", uses_model=False)(lambda config, options, model: OnePerMicroBatch(config))
    yield "one_per_mb_test"
    _REGISTRY.pop("one_per_mb_test")


def test_a_registered_planner_is_a_strategy_like_any_other(registered):
    raw = dict(strategy=registered, parallel=dict(dp=3), max_tokens=4096, context=4096, tokens_per_step=8192)
    cfg = validate_config(raw)
    assert registered in available_strategies()
    lengths = np.array([5, 4096, 17, 300, 9, 1000, 2], np.int64)
    window = Window.from_lengths(lengths, first_doc=10)
    plan, state = make_planner(cfg).plan(window, PlannerState(), 4)
    verify_plan(plan, window, cfg.max_tokens, final_state=state, dp=3)
    # written out by hand from the class docstring: doc 10+i alone in micro-batch i // 3 of rank i % 3
    want = [[[10 + i] for i in range(r, 9, 3) if i < 7] + ([[]] if r >= 1 else []) for r in range(3)]
    got = [[[s.doc for s in mb.segments] for mb in rank.micro_batches] for rank in plan.ranks]
    assert got == want


def test_strategy_names_come_from_the_registry(registered):
    with pytest.raises(ValueError, match="unknown planner strategy 'nope'"):
        validate_config(dict(strategy="nope", max_tokens=4096, context=4096))
    long_ctx = PlanConfig(strategy=registered, max_tokens=4096, context=8192)
    with pytest.raises(ValueError, match=f"strategy='{registered}', which does not slice"):
        check_strategy(long_ctx)
    check_strategy(msgspec.structs.replace(long_ctx, strategy="slimpack"))  # registered with slices=True
    assert {"auto", "slimpack"} <= set(available_strategies())
