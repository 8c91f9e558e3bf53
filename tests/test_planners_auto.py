"""`auto`'s array shortcuts against the slower reference code they replace: its slice edges against the
simulator's `slice_edges_of` on the plan, its numba best-fit decreasing against `fixed.best_fit_decreasing`,
and its choice against simulating every candidate's StepPlan with `metrics.score_plan`."""

from __future__ import annotations

import numpy as np
from helpers.planners import candidate_plans
from hypothesis import given, settings
from hypothesis import strategies as st

from packloader.balancers.cost.lookup import cost_model_for
from packloader.balancers.planners.auto import AutoPlanner
from packloader.balancers.planners.fixed import best_fit_decreasing, bfd_pack
from packloader.balancers.planners.packing import Pieces
from packloader.balancers.planners.packing_measures import slice_edges, slice_edges_prefix
from packloader.balancers.planners.registry import StepLayout, Window
from packloader.balancers.sim.metrics import score_plan
from packloader.balancers.sim.simulator import slice_edges_of
from packloader.contracts import ParallelConfig, PlanConfig, PlannerState


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 300), min_size=0, max_size=40), st.sampled_from([300, 512]), st.integers(1, 12))
def test_bfd_kernel_matches_fixed_reference(lengths, cap, bins):
    lengths = np.array(lengths, np.int64)
    ref = best_fit_decreasing(lengths, cap, bins)
    got, ok = bfd_pack(lengths, cap, bins)
    assert ok == (ref is not None)
    if ok:
        assert got.tolist() == ref.tolist()


@settings(max_examples=20, deadline=None)
@given(st.lists(st.integers(1, 3000), min_size=1, max_size=30), st.sampled_from([1, 2, 3]), st.sampled_from([1, 2, 4]),
       st.sampled_from([None, 3, 6]))
def test_slice_edges_match_simulator_reference(lengths, dp, pp, nmb):
    cfg = PlanConfig(strategy="auto", parallel=ParallelConfig(dp=dp, pp=pp), max_tokens=512, context=3000,
                     num_micro_batches=nmb)
    auto = AutoPlanner(cfg)
    pieces = Pieces.of(Window.from_lengths(np.array(lengths)), PlannerState(), 0)
    packing = auto.solvers["slimpack"].solve(pieces, StepLayout(0, micro_batches=nmb), auto.model)
    plan = packing.costs(auto.model).to_step_plan(0)
    offs, src, dst = slice_edges(packing)
    _, _, _, pre = slice_edges_prefix(packing)
    for r, rank in enumerate(plan.ranks):
        ref, ref_pre = slice_edges_of(rank.micro_batches)
        mine = sorted(zip(src[offs[r]:offs[r + 1]].tolist(), dst[offs[r]:offs[r + 1]].tolist()))
        assert mine == sorted(map(tuple, ref.tolist())), f"rank {r}"
        sl = slice(offs[r], offs[r + 1])
        mine3 = sorted(zip(src[sl].tolist(), dst[sl].tolist(), pre[sl].tolist()))
        assert mine3 == sorted(zip(*ref.T.tolist(), ref_pre.tolist())) if len(ref) else not mine3, f"rank {r}"


def test_auto_picks_the_fastest_candidate_by_plan_simulation():
    """Re-simulate every candidate's StepPlan with metrics.score_plan: auto's pick is within its tie tolerance
    of the fastest (per unit of planned work, as auto scores)."""
    rng = np.random.default_rng(4)
    lengths = np.clip(rng.lognormal(np.log(800), 1.5, 150), 16, 8192).astype(np.int64)
    cfg = PlanConfig(strategy="auto", parallel=ParallelConfig(dp=4, pp=4), max_tokens=8192, context=8192)
    auto = AutoPlanner(cfg)
    model = cost_model_for(cfg)
    state = PlannerState()
    window = Window.from_lengths(lengths)
    times = {cand: score_plan(plan, model, cfg.parallel).step_time
             for cand, plan in candidate_plans(auto, cfg, window, state)}
    assert len(times) >= 3
    plan, _ = auto.plan(window, state, StepLayout(0, flush=True))
    chosen = score_plan(plan, model, cfg.parallel).step_time
    assert chosen <= min(times.values()) * 1.006, (auto.last_choice, chosen, times)


def test_plan_costs_match_the_cost_model_for_dp_merge_micro_batches():
    """Packing.costs fills DP-Merge costs with array code; CostModel.microbatch_times is the reference."""
    cfg = PlanConfig(strategy="slimpack", parallel=ParallelConfig(dp=4, pp=2), max_tokens=2048, context=16384)
    from packloader.balancers.factory import make_planner

    plan, _ = make_planner(cfg).plan(Window.from_lengths(np.array([16000, 300, 200, 900, 50])), PlannerState(), 0)
    model = cost_model_for(cfg)
    merged = 0
    for rank in plan.ranks:
        for mb in rank.micro_batches:
            merged += bool(mb.dp_group and len(mb.dp_group) > 1)
            f, b = model.microbatch_times(mb)
            assert np.allclose([mb.fwd_cost, mb.bwd_cost], [f, b], rtol=1e-12)
    assert merged > 0, "the test needs a DP-Merge micro-batch"
