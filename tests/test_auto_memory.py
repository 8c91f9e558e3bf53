"""`auto` under the device's memory: its plans' peaks recomputed independently with the plan-level simulator
(`simulator.simulate_step` with the preset's `memory.MemoryModel`, as the report computes them) against the H100
budget worked out by hand (80 GiB x 0.92 usable - 2 GiB reserve = 71.6 GiB)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.planners import candidate_plans

from packloader.balancers.cost.lookup import cost_model_for
from packloader.balancers.cost.memory import MemoryModel
from packloader.balancers.cost.profile_io import save_profile
from packloader.balancers.planners.auto import TOLERANCE, AutoPlanner
from packloader.balancers.planners.packing import Pieces
from packloader.balancers.planners.packing_measures import slice_edges_prefix
from packloader.balancers.planners.registry import StepLayout, Window
from packloader.balancers.sim.metrics import score_plan
from packloader.balancers.sim.peaks import packing_peaks
from packloader.balancers.sim.simulator import simulate_step
from packloader.contracts import ParallelConfig, PlanConfig, PlannerState

GiB = 1024**3
H100_LIMIT = (80 * 0.92 - 2) * GiB  # by hand: MemoryModel's defaults on an 80 GiB device


def long_tail(n: int, seed: int, cap: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = np.where(rng.random(n) < 0.05, 16384 * (1 + rng.pareto(1.2, n)), rng.lognormal(np.log(1000), 1.6, n))
    return np.clip(np.rint(x), 16, cap).astype(np.int64)


def reference_peak(plan, cfg: PlanConfig) -> float:
    """Peak bytes of one GPU of a StepPlan, simulated plan by plan (the report's computation)."""
    memory = MemoryModel.for_preset(cfg.model, cfg.parallel, schedule=cfg.schedule)
    return simulate_step(plan, cost_model_for(cfg), cfg.parallel, schedule=cfg.schedule, memory=memory).peak_bytes


def unconstrained(cfg: PlanConfig) -> AutoPlanner:
    """auto as it chose before the memory check: the fastest candidate, whatever its memory."""
    auto = AutoPlanner(cfg)
    auto.memory, auto.mem_limit = None, None
    return auto


def candidate_table(auto: AutoPlanner, cfg: PlanConfig, window: Window, state: PlannerState):
    """Every candidate planned on its own with everything flushed (so all plan the same work): (candidate,
    simulated step time, peak bytes)."""
    model = cost_model_for(cfg)
    return [(cand, score_plan(plan, model, cfg.parallel).step_time, reference_peak(plan, cfg))
            for cand, plan in candidate_plans(auto, cfg, window, state)]


def test_budget_is_the_hand_worked_h100_limit():
    auto = AutoPlanner(PlanConfig(parallel=ParallelConfig(dp=2, pp=2, tp=2), max_tokens=32768, context=32768))
    assert auto.mem_limit == pytest.approx(H100_LIMIT, rel=1e-12)


def test_large_cap_choice_fits_memory_where_the_fastest_does_not():
    cfg = PlanConfig(parallel=ParallelConfig(dp=2, pp=2, tp=4), max_tokens=65536, context=65536)
    window = Window.from_lengths(long_tail(100, 1, 65536))
    state = PlannerState()
    free, _ = unconstrained(cfg).plan(window, state, StepLayout(0, flush=True))
    assert reference_peak(free, cfg) > H100_LIMIT, "the test needs a fastest plan that does not fit"
    auto = AutoPlanner(cfg)
    plan, _ = auto.plan(window, state, StepLayout(0, flush=True))
    assert reference_peak(plan, cfg) <= H100_LIMIT
    assert plan.memory_over == 0.0
    # and it is the fastest of the candidates that fit (per planned work, within auto's tie tolerance)
    rows = candidate_table(auto, cfg, window, state)
    fitting = [t for c, t, p in rows if p <= H100_LIMIT]
    assert fitting and len(fitting) < len(rows)
    model = cost_model_for(cfg)
    chosen = score_plan(plan, model, cfg.parallel).step_time
    assert chosen <= min(fitting) * (1 + TOLERANCE) + 1e-12, (auto.last_choice, chosen, rows)


@pytest.mark.parametrize("cap", [2048, 4096])
def test_small_cap_choice_is_unchanged(cap):
    cfg = PlanConfig(parallel=ParallelConfig(dp=2, pp=2, tp=2), max_tokens=cap, context=cap)
    window = Window.from_lengths(long_tail(60, 1, cap))
    state = PlannerState()
    free, _ = unconstrained(cfg).plan(window, state, StepLayout(0, flush=True))
    assert reference_peak(free, cfg) <= H100_LIMIT, "the test needs a fastest plan that fits"
    plan, _ = AutoPlanner(cfg).plan(window, state, StepLayout(0, flush=True))
    assert plan == free


def test_nothing_fits_picks_the_lowest_peak_and_records_it():
    # tp 1 and 32K micro-batches of llama3-8b: even one micro-batch in flight outgrows an H100 stage
    cfg = PlanConfig(parallel=ParallelConfig(dp=2, pp=2), max_tokens=32768, context=32768)
    window = Window.from_lengths(long_tail(40, 2, 32768))
    state = PlannerState()
    auto = AutoPlanner(cfg)
    plan, _ = auto.plan(window, state, StepLayout(0, flush=True))
    peak = reference_peak(plan, cfg)
    assert plan.memory_over == pytest.approx(peak / H100_LIMIT, rel=1e-9)
    rows = candidate_table(auto, cfg, window, state)
    assert all(p > H100_LIMIT for *_, p in rows)
    assert peak <= min(p for *_, p in rows) * (1 + 1e-9)


@pytest.mark.parametrize("schedule,vpp,dp,merge", [("1f1b", 1, 3, False), ("1f1b", 1, 4, True), ("gpipe", 1, 2, False),
                                                   ("interleaved", 2, 2, False), ("zb-v", 2, 2, False),
                                                   ("zb-h1", 2, 2, False)])
def test_array_peaks_match_plan_simulation(schedule, vpp, dp, merge):
    """auto's batched peaks (slices, FILO backward orders, DP-Merge groups) against simulate_step per rank."""
    cfg = PlanConfig(parallel=ParallelConfig(dp=dp, pp=2, tp=2, vpp=vpp), max_tokens=2048 if merge else 4096, context=32768,
                     schedule=schedule, num_micro_batches=4 if vpp > 1 else None)
    auto = AutoPlanner(cfg)
    model = cost_model_for(cfg)
    memory = MemoryModel.for_preset(cfg.model, cfg.parallel, schedule=schedule)
    # one document longer than a rank's share makes slimpack merge DP ranks (the DP-Merge case)
    lengths = np.array([16000, 300, 200, 900, 50]) if merge else np.concatenate([[30000], long_tail(30, 3, 20000)])
    pieces = Pieces.of(Window.from_lengths(lengths), PlannerState(), 0)
    seen_slices = seen_merge = 0
    for cand in auto.candidates(pieces):
        try:
            packing = auto.solve_candidate(cand, pieces, 0, True, True)
        except ValueError:
            continue
        packing.costs(model)
        plan = packing.to_step_plan(0)
        ref = simulate_step(plan, model, cfg.parallel, schedule=schedule, memory=memory)
        got = packing_peaks(packing, memory, 2, vpp, auto.kind, slice_edges_prefix(packing))
        want = np.stack([r.peak_bytes for r in ref.ranks])
        np.testing.assert_allclose(got, want, rtol=1e-9)
        seen_slices += bool((packing.seg_af < packing.seg_start).any())
        seen_merge += bool(packing.groups)
    assert seen_slices, "the test needs a candidate with slices"
    if merge:
        assert seen_merge, "the test needs a DP-Merge micro-batch"


def test_profile_json_skips_the_memory_check(tmp_path):
    path = tmp_path / "profile.json"
    save_profile(cost_model_for(PlanConfig(parallel=ParallelConfig(dp=2, pp=2, tp=2))).profile, path)
    cfg = PlanConfig(parallel=ParallelConfig(dp=2, pp=2, tp=2), max_tokens=32768, context=32768, model=str(path))
    auto = AutoPlanner(cfg)
    assert auto.memory is None and auto.mem_limit is None
    window = Window.from_lengths(long_tail(60, 1, 32768))
    plan, _ = auto.plan(window, PlannerState(), StepLayout(0, flush=True))
    assert plan.memory_over == 0.0


@pytest.mark.parametrize("tp,cap,n", [(8, 65536, 300), (2, 32768, 200)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_deferred_candidates_never_beat_the_choice(tp, cap, n, seed):
    """In a pipeline with slicing, auto plans slimpack's default count and wlb at 2x only when slimpack at 2x
    does not fit (AutoPlanner.deferred). Whether it fits or not (tp 8 / tp 2), its choice must be as fast as the
    fastest of all candidates that fit, each planned on its own and simulated plan by plan."""
    cfg = PlanConfig(parallel=ParallelConfig(dp=4, pp=4, tp=tp), max_tokens=cap, context=cap)
    window = Window.from_lengths(long_tail(n, seed, cap))
    state = PlannerState()
    auto = AutoPlanner(cfg)
    plan, _ = auto.plan(window, state, StepLayout(0, flush=True))
    rows = candidate_table(auto, cfg, window, state)
    assert any(auto.deferred(c, [r[0] for r in rows]) for c, _, _ in rows), "the test needs deferred candidates"
    fitting = [t for c, t, p in rows if p <= H100_LIMIT]
    chosen = score_plan(plan, cost_model_for(cfg), cfg.parallel).step_time
    assert fitting and chosen <= min(fitting) * (1 + TOLERANCE) + 1e-12, (auto.last_choice, rows)
