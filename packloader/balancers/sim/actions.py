"""The action lists of a step: what each pipeline rank of each DP rank runs, in the order the simulator scored
(`simulator.simulate_step`: the schedule's rule, the plan's backward order for slice chains included), so a
trainer or an independent checker can run or replay exactly the schedule the plan was chosen for.

`step_actions(plan, ...)[dp_rank][pipeline_rank]` is a list of ``[op, micro_batch, stage]``: op ``"F"`` or
``"B"`` (the whole backward), micro_batch the position in the DP rank's micro-batches, stage the model chunk
in model order, 0..pp*vpp-1 (a pipeline rank s runs stages s, s + pp, ...; under plain 1F1B stage = s).
"""

from __future__ import annotations

from packloader.balancers.sim.simulator import SimResult, simulate_step
from packloader.contracts import ParallelConfig, StepPlan


def rank_actions(sim: SimResult) -> list[list[list]]:
    """Per pipeline rank, the simulated task order of one DP rank as [op, micro_batch, stage] lists."""
    out = []
    for s in range(sim.pp):
        acts = []
        for t in sim.ops[s].tolist():
            vu, isb = divmod(t, 2)
            vs, u = divmod(vu, sim.m)
            acts.append(["B" if isb else "F", u, vs])
        out.append(acts)
    return out


def step_actions(plan: StepPlan, model, parallel: ParallelConfig | None = None, *,
                 schedule: str = "1f1b") -> list[list[list[list]]]:
    """Per DP rank, per pipeline rank, the action list of a step (module docstring)."""
    sim = simulate_step(plan, model, parallel or ParallelConfig(dp=len(plan.ranks)), schedule=schedule)
    return [rank_actions(r) for r in sim.ranks]
