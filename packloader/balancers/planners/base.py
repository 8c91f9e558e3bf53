"""The base every shipped planner derives from, and the one `plan()` they share.

A planner's work is `solve(pieces, layout, model) -> Packing`: the step's pieces (queued ones first), what the
step must fit (`StepLayout`: step, flush, micro-batch count) and the cost model it balances for, in; array
answer out. `PackingPlanner.plan` (the `Planner` protocol of the registry) turns that into the loader's contract
(a StepPlan with costs, and the state to carry), the same way for every planner, and `auto` composes candidates
by calling `solve` on each. The cost model is injected by whoever builds the planner (the registry entry).
"""

from __future__ import annotations

from typing import ClassVar, Union

from packloader.balancers.cost.lookup import cost_model_for
from packloader.balancers.cost.model import CostModel
from packloader.balancers.cost.resolve import RankCosts
from packloader.balancers.planners.packing import Packing, Pieces
from packloader.balancers.planners.registry import StepLayout, Window
from packloader.contracts import PlanConfig, PlannerState, StepPlan

Model = Union[CostModel, RankCosts]  # one model for every DP rank, or one (and a token cap) per rank

__all__ = ["Model", "PackingPlanner", "StepLayout"]


class PackingPlanner:
    """Base of the planners: `plan` (the Planner contract) through `solve`, with the injected cost model (None
    for a planner that plans by token counts only)."""

    name: ClassVar[str]
    config: PlanConfig
    model: Model | None

    def __init__(self, config: PlanConfig, model: Model | None = None, *, uses_model: bool = True) -> None:
        self.config = config
        self.model = (model if model is not None else cost_model_for(config)) if uses_model else None

    def solve(self, pieces: Pieces, layout: StepLayout, model: Model) -> Packing:
        raise NotImplementedError

    def plan(self, window: Window, state: PlannerState, layout: StepLayout | int) -> tuple[StepPlan, PlannerState]:
        layout = StepLayout.of(layout)
        packing = self.solve(Pieces.of(window, state, layout.step), layout, self.model)
        packing.extra = dict(state.extra)
        return self.priced(packing, layout.step), packing.state()

    def priced(self, packing: Packing, step: int) -> StepPlan:
        """The packing as a StepPlan with every micro-batch's forward and backward cost."""
        return packing.costs(self.model).to_step_plan(step)
