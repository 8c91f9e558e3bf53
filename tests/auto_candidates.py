"""Every candidate of an `auto` planner planned on its own, everything flushed (so all plan the same work): the
reference the auto tests compare its choice with."""

from __future__ import annotations

from packloader.balancers.planners.auto import AutoPlanner, Candidate
from packloader.balancers.planners.packing import Pieces, cost_model_for
from packloader.balancers.planners.registry import Window
from packloader.contracts import PlanConfig, PlannerState, StepPlan


def candidate_plans(auto: AutoPlanner, cfg: PlanConfig, window: Window, state: PlannerState) -> list[tuple[Candidate, StepPlan]]:
    """(candidate, its StepPlan with costs) for every candidate that can plan the window."""
    model = cost_model_for(cfg)
    pieces = Pieces.of(window, state, 0)
    out = []
    for cand in auto.candidates(pieces):
        try:
            packing = auto.solve_candidate(cand, pieces, 0, True, True)
        except ValueError:
            continue
        out.append((cand, packing.costs(model).to_step_plan(0)))
    return out
