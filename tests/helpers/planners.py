"""Planners the tests share: DelayingPlanner and SlowPlanner (test planners built on the fixed one), and every
candidate of an `auto` planner planned on its own, everything flushed (so all plan the same work): the reference
the auto tests compare its choice with."""

from __future__ import annotations

import time

import msgspec
import numpy as np

from packloader.balancers.planners.auto import AutoPlanner, Candidate
from packloader.balancers.planners.fixed import FixedPlanner
from packloader.balancers.planners.packing import Pieces, cost_model_for
from packloader.balancers.planners.registry import StepLayout, Window
from packloader.contracts import PlanConfig, PlannerState, QueuedDoc, StepPlan


class DelayingPlanner:
    """The fixed planner, except that pieces longer than `threshold` drawn in a step wait for the next one (an
    outlier queue, as WLB-LLM keeps): a planner whose state must survive resume and be flushed at the epoch's end."""

    def __init__(self, config: PlanConfig, threshold: int = 100) -> None:
        self.config = config
        self.inner = FixedPlanner(config)
        self.threshold = threshold

    def plan(self, window: Window, state: PlannerState, layout: StepLayout | int):
        layout = StepLayout.of(layout)
        step, flush = layout.step, layout.flush
        keep = np.ones(len(window.doc), bool) if flush else window.length <= self.threshold
        held = [QueuedDoc(int(window.doc[i]), int(window.offset[i]), int(window.length[i]), step)
                for i in np.flatnonzero(~keep)]
        plan, _ = self.inner.plan(Window(window.doc[keep], window.offset[keep], window.length[keep]),
                                  PlannerState(queued=list(state.queued)), step)
        return msgspec.structs.replace(plan, delayed=[q.doc for q in held]), PlannerState(queued=held)


class SlowPlanner:
    """The fixed planner, taking `pause` seconds to plan the steps in `slow`: planning slower than torchdata's
    0.5 s thread join, as on a loaded machine."""

    def __init__(self, config: PlanConfig) -> None:
        self.inner, self.pause, self.slow = FixedPlanner(config), 0.0, range(0)

    def plan(self, window, state, layout):
        if StepLayout.of(layout).step in self.slow:
            time.sleep(self.pause)
        return self.inner.plan(window, state, layout)


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
