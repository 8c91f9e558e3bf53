"""Planners: a window of document lengths in, a balanced StepPlan out."""

from packloader.balancers.planners.registry import Planner, Window, available_strategies, register_planner

__all__ = ["Planner", "Window", "available_strategies", "make_planner", "register_planner"]


def __getattr__(name: str):
    # the factory imports the per-document CP wing: loaded when first asked for, not with every balancers module
    if name == "make_planner":
        from packloader.balancers.factory import make_planner

        return make_planner
    raise AttributeError(f"module 'packloader.balancers' has no attribute {name!r}")
