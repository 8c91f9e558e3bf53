"""The one protocol every planner solves through, and the one `plan()` they share.

A planner's work is `solve(pieces, layout, model) -> Packing`: the step's pieces (queued ones first), what the
step must fit (`StepLayout`) and the cost model it balances for, in; array answer out. `PackingPlanner.plan` turns
that into the loader's contract (a StepPlan with costs, and the state to carry), the same way for every planner,
and `auto` composes candidates by calling `solve` on each.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol, Union

from packloader.balancers.cost.model import CostModel
from packloader.balancers.cost.resolve import RankCosts
from packloader.balancers.planners.packing import Packing, Pieces, carried_extra, cost_model_for, wants_flush
from packloader.balancers.planners.registry import Window
from packloader.contracts import PlanConfig, PlannerState, StepPlan

Model = Union[CostModel, RankCosts]  # one model for every DP rank, or one (and a token cap) per rank


@dataclass(frozen=True)
class StepLayout:
    """What one step's packing must fit besides its pieces."""

    step: int
    flush: bool = False  # plan every piece now (end of epoch): nothing held back by choice
    micro_batches: int | None = None  # per DP rank; None: the planner's own choice (or config.num_micro_batches)


class Solver(Protocol):
    name: str
    config: PlanConfig

    def solve(self, pieces: Pieces, layout: StepLayout, model: Model) -> Packing: ...


class PackingPlanner:
    """Base of the planners: `plan` (the Planner contract) through `solve`, with the planner's own model."""

    name: ClassVar[str]
    config: PlanConfig
    model: Model

    def __init__(self, config: PlanConfig) -> None:
        self.config = config
        self.model = cost_model_for(config)

    def solve(self, pieces: Pieces, layout: StepLayout, model: Model) -> Packing:
        raise NotImplementedError

    def plan(self, window: Window, state: PlannerState, step: int) -> tuple[StepPlan, PlannerState]:
        packing = self.solve(Pieces.of(window, state, step), StepLayout(step, wants_flush(state)), self.model)
        packing.extra = carried_extra(state)
        return self.priced(packing, step), packing.state()

    def priced(self, packing: Packing, step: int) -> StepPlan:
        """The packing as a StepPlan with every micro-batch's forward and backward cost."""
        return packing.costs(self.model).to_step_plan(step)
