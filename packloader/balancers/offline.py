"""Planning a whole run from a lengths array, as a loader would draw it: the library side of `packloader plan`.

Steps are drawn by `balancers.draw.draw_windows` (doc id = position in the array, empty documents skipped). The
last step (after `steps` steps, or when the documents run out) is planned with a flush, so every token of every
drawn document appears exactly once over the run and nothing stays queued.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from packloader.balancers.draw import draw_windows
from packloader.balancers.factory import make_planner
from packloader.balancers.planners.config_rules import validate_config
from packloader.balancers.planners.contract import check_step_plan, rank_caps
from packloader.balancers.planners.registry import StepLayout, Window
from packloader.contracts import PlanConfig, PlannerState, StepPlan


@dataclass
class PlanRun:
    plans: list[StepPlan]
    windows: list[Window]
    final_state: PlannerState


def plan_run(lengths: np.ndarray, config: PlanConfig, steps: int, planner=None) -> PlanRun:
    """Plan every step of a run; the last one flushes whatever the planner still holds. Without a `planner`
    object, `config` is validated as the loader validates it and the registry's planner is used. Each step's plan
    is checked against the planner contract (`check_step_plan`: a PlanContractError, a ValueError, names the
    planner and what broke)."""
    if planner is None:
        config = validate_config(config)
        planner = make_planner(config)
    windows = draw_windows(lengths, config.tokens_per_step, config.context, steps).windows
    state = PlannerState()
    plans = []
    caps = rank_caps(planner)  # a planner given a cap per DP rank is held to each
    for s, w in enumerate(windows):
        layout = StepLayout(s, flush=s == len(windows) - 1)
        plan, after = planner.plan(w, state, layout)
        check_step_plan(plan, w, state, after, config, layout, caps=caps)
        plans.append(plan)
        state = after
    if state.queued:  # a planner that ignores the flush: keep planning empty windows until it lets go
        empty = Window(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64))
        for s in range(len(windows), len(windows) + 16):
            plan, after = planner.plan(empty, state, StepLayout(s, flush=True))
            check_step_plan(plan, empty, state, after, config, s, caps=caps)
            plans.append(plan)
            state = after
            if not state.queued:
                break
        else:
            raise RuntimeError(f"planner {config.strategy!r} still holds {len(state.queued)} pieces after flushing")
    return PlanRun(plans, windows, state)


def plan_record(plan: StepPlan, actions: list | None = None) -> dict:
    """One JSON line of `packloader plan`: {"step", "ranks": [[[doc, start, end, attend_from], ...] per
    micro-batch] per rank, "costs": [[fwd, bwd] per micro-batch] per rank, "memory_over", ...}; with `actions`
    (`sim.actions.step_actions`), "actions": [per DP rank: [per pipeline rank: [[op, micro_batch, stage], ...]]].
    A per-document CP plan has "cp_mode": "dynamic", one entry of "ranks" per GPU of the DP x CP pool, and "cp":
    [size, first GPU] of each segment, aligned with "ranks".

    A DP-Merge micro-batch is written once, under the first rank of its group, and as an empty micro-batch at
    the same position of the other members; "dp_groups" lists [rank, position, [ranks]] for each."""
    ranks = []
    costs = []
    groups = []
    written: set = set()
    for r, rank in enumerate(plan.ranks):
        mbs = []
        cs = []
        for i, mb in enumerate(rank.micro_batches):
            cs.append([mb.fwd_cost, mb.bwd_cost])
            if mb.dp_group and len(mb.dp_group) > 1:
                key = (tuple(mb.dp_group), i, tuple(mb.segments))
                if key in written:
                    mbs.append([])
                    continue
                written.add(key)
                groups.append([r, i, list(mb.dp_group)])
            mbs.append([[s.doc, s.start, s.end, s.attend_from] for s in mb.segments])
        ranks.append(mbs)
        costs.append(cs)
    rec: dict = {"step": plan.step, "ranks": ranks, "costs": costs, "memory_over": plan.memory_over}
    if groups:
        rec["dp_groups"] = groups
    orders = [rank.backward_order for rank in plan.ranks]
    if any(o is not None for o in orders):
        rec["backward_order"] = orders
    if plan.delayed:
        rec["delayed"] = plan.delayed
    if plan.cp_mode == "dynamic":  # per-document CP: "ranks" lists pool GPUs (dp_rank x cp + cp_rank)
        rec["cp_mode"] = "dynamic"
        rec["cp"] = [[[[c.size, c.first] for c in (mb.cp or [])] for mb in rank.micro_batches] for rank in plan.ranks]
    if plan.schedule:  # chosen by the planner (schedule "auto")
        rec["schedule"] = plan.schedule
    if actions is not None:
        rec["actions"] = actions
    return rec
