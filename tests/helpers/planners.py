"""Planners the tests share: DelayingPlanner and SlowPlanner (test planners built on the fixed one), and every
candidate of an `auto` planner planned on its own, everything flushed (so all plan the same work): the reference
the auto tests compare its choice with."""

from __future__ import annotations

import time

import msgspec
import numpy as np

from packloader.balancers.cost.lookup import cost_model_for
from packloader.balancers.planners.auto import AutoPlanner, Candidate
from packloader.balancers.planners.fixed import FixedPlanner
from packloader.balancers.planners.packing import Pieces
from packloader.balancers.planners.registry import StepLayout, Window
from packloader.contracts import CostProfile, PlanConfig, PlannerState, Poly, QueuedDoc, StepPlan


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


# Attention dominates: bins of many short pieces fill their tokens while staying the least loaded, so WLB-LLM's
# rule sends pieces to the fewest tokens' bin (the path wlb_pack's token heap serves)
ATTENTION_HEAVY = CostProfile(name="attention-heavy", tile=1, attn_fwd=Poly(1e-6, 0, 0), attn_bwd=Poly(2e-6, 0, 0),
                              lin_fwd=Poly(0, 1e-9, 1e-7), lin_bwd=Poly(0, 2e-9, 2e-7))


def wlb_reference(prof, lengths: list[int], nbins: int, cap: int) -> tuple[list[int], int]:
    """WLB-LLM Algorithm 1 written out: the least loaded bin if it has room, else the fewest tokens', else
    wait; ties to the lowest bin. Returns (bins, pieces that went to the fewest tokens' bin)."""
    def bin_time(a: float, n: int) -> float:
        return a + sum(p.a * n * n + p.b * n + p.c for p in (prof.lin_fwd, prof.lin_bwd))

    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    attn, tok, load, ref = [0.0] * nbins, [0] * nbins, [bin_time(0.0, 0)] * nbins, [-1] * len(lengths)
    to_fewest = 0
    for i in order:
        w = min(range(nbins), key=lambda b: (load[b], b))
        f = min(range(nbins), key=lambda b: (tok[b], b))
        b = w if tok[w] + lengths[i] <= cap else (f if tok[f] + lengths[i] <= cap else -1)
        if b < 0:
            continue
        to_fewest += b != w
        ref[i] = b
        attn[b] += sum(p.a * lengths[i] ** 2 + p.b * lengths[i] + p.c for p in (prof.attn_fwd, prof.attn_bwd))
        tok[b] += lengths[i]
        load[b] = bin_time(attn[b], tok[b])
    return ref, to_fewest
