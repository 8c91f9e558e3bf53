"""Planners: a window of document lengths in, a balanced StepPlan out."""

from packloader.balancers.planners.registry import Planner, Window, available_strategies, make_planner, register_planner

__all__ = ["Planner", "Window", "available_strategies", "make_planner", "register_planner"]
