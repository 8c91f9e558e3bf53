"""PlanConfig.cp_mode: which context parallelism plans a step.

"dynamic" plans every step with `dynamic-cp`. "auto" plans each step twice when cp > 1, with the configured
strategy (fixed CP: every micro-batch sharded over the whole CP group) and with `dynamic-cp`, and keeps the one
whose slowest GPU's simulated step time per unit of work trained is lower (`planned_work`: what `auto` divides by,
so holding pieces back is not a speed-up by itself; ties to fixed CP, which every runtime runs);
at cp 1 it is fixed CP. Both are priced alike: the fixed plan's micro-batches pay their CP group's K/V all-gather
(`cost.cp_price`: the fixed plan's model carries its group's all-gather; a SlimPack DP-Merge group pays the rest, `fixed_with_comm`),
as the dynamic plan's subgroups do. The
choice is per step, so a run may mix both; StepPlan.cp_mode says which each step is. A step whose fixed-CP plan
does not fit memory (memory_over > 0) takes the per-document plan, whose GPUs hold max_tokens / cp tokens at once. Not the default under
strategy "auto": a dynamic plan needs a runtime that runs per-document subgroups, which the user opts into.
"""

from __future__ import annotations

import msgspec
import numpy as np

from packloader.balancers.cost.cp_price import fixed_with_comm
from packloader.balancers.cost.lookup import cost_model_for
from packloader.balancers.planners.doc_cp.planner import NAME, DynamicCPPlanner
from packloader.balancers.planners.doc_cp.price import DynamicCPCost
from packloader.balancers.planners.registry import Planner, StepLayout, Window, planner_spec
from packloader.balancers.sim.metrics import score_plan
from packloader.balancers.sim.verify import owned_segments
from packloader.contracts import PlanConfig, PlannerState, StepPlan

__all__ = ["CPModeChoice", "cp_mode_planner", "fixed_with_comm", "planned_work", "seconds_per_work"]


def planned_work(plan: StepPlan, cost: DynamicCPCost) -> float:
    """The work a plan trains: each of its segments' attention and linear time on one GPU (no floors, no CP),
    so a plan that holds pieces back (outlier delay) is not taken as faster for it (as `auto` scores). A DP-Merge
    micro-batch, listed by every rank of its dp_group, counts once (on its first rank)."""
    segs = [s for r, rank in enumerate(plan.ranks) for mb in rank.micro_batches
            if not mb.dp_group or mb.dp_group[0] == r for s in owned_segments(mb, r)]
    if not segs:
        return 0.0
    q = np.array([s.end - s.start for s in segs], dtype=np.int64)
    p = np.array([s.start - s.attend_from for s in segs], dtype=np.int64)
    return float(cost.estimate(q, p, np.ones(len(q), dtype=np.int64)).sum())


def seconds_per_work(plan: StepPlan, config: PlanConfig, model, cost: DynamicCPCost) -> float:
    s = score_plan(plan, model, config.parallel, max_tokens=config.max_tokens, schedule=config.schedule,
                   use_plan_costs=True)
    work = planned_work(plan, cost)
    return s.step_time / work if work > 0 else 0.0


class CPModeChoice:
    """cp_mode "auto": fixed CP or per-document CP, per step (module docstring)."""

    def __init__(self, config: PlanConfig, fixed: Planner, dynamic: DynamicCPPlanner, model) -> None:
        self.config = config
        self.fixed = fixed
        self.dynamic = dynamic
        self.model = model

    def plan(self, window: Window, state: PlannerState, layout: StepLayout | int) -> tuple[StepPlan, PlannerState]:
        fplan, fstate = self.fixed.plan(window, state, layout)
        if not all(mb.fwd_cost > 0 or not mb.segments for r in fplan.ranks for mb in r.micro_batches):
            return fplan, fstate  # an unpriced fixed plan (token-count planners) cannot be compared
        fplan = fixed_with_comm(fplan, self.dynamic.cost.comm, self.config.parallel.cp, self.model.profile.cp_traffic)
        dplan, dstate = self.dynamic.plan(window, state, layout)
        if fplan.memory_over > 0:  # no fixed-CP candidate fit; per-document CP holds max_tokens / cp per GPU
            return dplan, dstate
        cost = self.dynamic.cost
        if seconds_per_work(dplan, self.config, self.model, cost) < seconds_per_work(fplan, self.config, self.model, cost):
            return dplan, dstate
        return fplan, fstate


def cp_mode_planner(config: PlanConfig, model=None) -> Planner:
    """The planner PlanConfig.cp_mode asks for ("dynamic": dynamic-cp; "auto" at cp > 1: CPModeChoice)."""
    if config.cp_mode == "dynamic":
        return planner_spec(NAME).build(config)
    fixed = planner_spec(config.strategy).build(msgspec.structs.replace(config, cp_mode="fixed"), model)
    if config.parallel.cp <= 1:
        return fixed
    dynamic = planner_spec(NAME).build(config)
    return CPModeChoice(config, fixed, dynamic, model if model is not None else cost_model_for(config))  # type: ignore[arg-type]
