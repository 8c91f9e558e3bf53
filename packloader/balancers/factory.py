"""PlanConfig -> planner. It sits above the planners (none imports it), so choosing per-document CP here needs no
lazy import back into them: that lazy import closed an import cycle through the registry when it lived there."""

from __future__ import annotations

from packloader.balancers.cost.model import CostModel
from packloader.balancers.planners.doc_cp.choice import cp_mode_planner
from packloader.balancers.planners.registry import Planner, planner_spec
from packloader.contracts import PlanConfig


def asks_for_pool(config: PlanConfig) -> bool:
    """Whether the config opts into per-document CP (cp_mode "dynamic" or "auto"), whose plans need a runtime that
    runs per-document CP subgroups."""
    return config.cp_mode != "fixed"


def make_planner(config: PlanConfig, model: CostModel | None = None) -> Planner:
    """The configured strategy's planner, `model` injected (default: the config's own, `cost_model_for`); with
    config.cp_mode "dynamic" or "auto", per-document CP's (`planners.doc_cp.choice`)."""
    if asks_for_pool(config) and not planner_spec(config.strategy).cp_pool:
        return cp_mode_planner(config, model)
    return planner_spec(config.strategy).build(config, model)
