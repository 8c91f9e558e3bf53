"""`auto`'s micro-batch count search and its bounded slice runs (issue 25): the choice checked against every
candidate planned on its own and simulated plan by plan, peaks against the plan-level simulator with the
device's memory, and the bounded runs read back from the plan's backward order."""

from __future__ import annotations

import numpy as np
import pytest

from packloader.balancers.cost.lookup import cost_model_for
from packloader.balancers.cost.memory import memory_model_for
from packloader.balancers.planners.auto import AutoPlanner, Candidate
from packloader.balancers.planners.packing import Pieces
from packloader.balancers.planners.registry import StepLayout, Window, planner_spec
from packloader.balancers.planners.slimpack import backward_runs, default_packs
from packloader.balancers.sim.metrics import score_plan
from packloader.balancers.sim.simulator import simulate_step
from packloader.contracts import ParallelConfig, PlanConfig, PlannerState

GiB = 1024**3


def long_pieces_window(seed: int = 0) -> Window:
    """12 context-length pieces and 100 short documents: slimpack slices every long piece, and each rank's
    slices form one run of linked packs whose activations stay alive until its first backward."""
    rng = np.random.default_rng(seed)
    return Window.from_lengths(np.concatenate([np.full(12, 65536), rng.integers(500, 4000, 100)]))


def config(window: Window, memory_gib: float | None = None) -> PlanConfig:
    return PlanConfig(parallel=ParallelConfig(dp=2, pp=4, tp=8), max_tokens=65536, context=65536,
                      tokens_per_step=int(window.length.sum()), memory_gib=memory_gib)


def reference(plan, cfg: PlanConfig) -> tuple[float, float]:
    """(step time, peak bytes of one GPU) of a StepPlan from the plan-level simulator with the config's device."""
    memory = memory_model_for(cfg.model, cfg.parallel, cfg.schedule, "h100", cfg.memory_gib)
    sim = simulate_step(plan, cost_model_for(cfg), cfg.parallel, schedule=cfg.schedule, memory=memory)
    return sim.step_time, sim.peak_bytes


def test_slimpack_counts_climb_to_8x_in_a_pipeline_only():
    window = long_pieces_window()
    pieces = Pieces.of(window, PlannerState(), 0)
    auto = AutoPlanner(config(window))
    base = default_packs(pieces.total_tokens / 2, -(-len(pieces) // 2), 4, 65536)
    counts = [c.micro_batches for c in auto.candidates(pieces) if c.planner == "slimpack"]
    assert counts == [None, 2 * base, 4 * base, 8 * base] and planner_spec("slimpack").auto.pipeline_ladder == (2, 4, 8)
    flat = AutoPlanner(PlanConfig(parallel=ParallelConfig(dp=2, pp=1, tp=8), max_tokens=65536, context=65536))
    assert [c.micro_batches for c in flat.candidates(pieces) if c.planner == "slimpack"][1:] == [2 * default_packs(
        pieces.total_tokens / 2, -(-len(pieces) // 2), 1, 65536)]


def test_choice_is_the_fastest_count_that_fits():
    """Every slimpack count of the ladder planned on its own and scored by the plan-level simulator: auto's
    plan is as fast as the fastest of them (within its tolerance), and it fits the H100."""
    window = long_pieces_window()
    cfg = config(window)
    state = PlannerState()
    auto = AutoPlanner(cfg)
    plan, _ = auto.plan(window, state, StepLayout(0, flush=True))
    pieces = Pieces.of(window, state, 0)
    times = []
    for cand in (c for c in auto.candidates(pieces) if c.planner == "slimpack"):
        packing = AutoPlanner(cfg).solve_candidate(cand, pieces, 0, True, True)
        times.append(reference(packing.drop_empty_slots().to_step_plan(0), cfg)[0])
    t, peak = reference(plan, cfg)
    assert t <= min(times) * 1.005 + 1e-12 and t < times[0]  # more than the default count pays here
    assert peak <= auto.mem_limit
    # against the no-bubble ideal the 8x count closes most of the 1F1B fill left at the default
    assert score_plan(plan, cost_model_for(cfg), cfg.parallel).efficiency > 0.9


def runs_of(order: list[int]) -> list[int]:
    """Lengths of the reversed runs in a backward order (a run is visited last pack first)."""
    out, k = [], 0
    while k < len(order):
        n, top = 1, order[k]
        while k + n < len(order) and order[k + n] == top - n:
            n += 1
        out.append(n)
        k += n
    return out


@pytest.mark.parametrize("memory_gib", [46.0, 33.0])
def test_bounded_runs_keep_slicing_where_one_run_does_not_fit(memory_gib):
    """With less device memory than one run per rank needs (about 46-52 GiB here) auto still slices, with
    shorter runs, instead of taking whole 64K pieces: its plan fits by the plan-level simulator, is faster than
    every whole-piece candidate that fits, and no run is longer than half the rank's packs."""
    window = long_pieces_window()
    cfg = config(window, memory_gib)
    state = PlannerState()
    auto = AutoPlanner(cfg)
    plan, _ = auto.plan(window, state, StepLayout(0, flush=True))
    t, peak = reference(plan, cfg)
    limit = (memory_gib * 0.92 - 2) * GiB  # by hand: MemoryModel's defaults
    assert auto.mem_limit == pytest.approx(limit)
    assert peak <= limit and plan.memory_over == 0.0
    assert any(sg.attend_from < sg.start for r in plan.ranks for mb in r.micro_batches for sg in mb.segments)
    assert auto.last_choice.planner == "slimpack" and auto.last_choice.run_share > 0
    # every unbounded slimpack count is over the limit, so the fallback was needed
    pieces = Pieces.of(window, state, 0)
    for cand in (c for c in auto.candidates(pieces) if c.planner == "slimpack"):
        packing = AutoPlanner(cfg).solve_candidate(cand, pieces, 0, True, True)
        assert reference(packing.drop_empty_slots().to_step_plan(0), cfg)[1] > limit
    whole = []
    for name in ("wlb", "hydraulis", "fixed"):
        packing = AutoPlanner(cfg).solve_candidate(Candidate(name, None), pieces, 0, True, True)
        wt, wp = reference(packing.drop_empty_slots().to_step_plan(0), cfg)
        if wp <= limit:
            whole.append(wt)
    assert all(t < w for w in whole)
    m = len(plan.ranks[0].micro_batches)
    for r in plan.ranks:
        assert r.backward_order is not None
        assert max(runs_of(r.backward_order)) <= max(4, int(auto.last_choice.run_share * m)) + m // 8


def test_runs_of_reads_a_backward_order():
    assert runs_of(backward_runs(6, [(0, 2), (4, 5)])) == [3, 1, 2]
