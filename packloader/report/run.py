"""Run planners by name over the same drawn steps, as the loader would (the planner's state carried from step to
step), timing each step's planning. A strategy that fails to import or raises is kept with its error, so the
report shows it as skipped instead of dying."""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass, field
from typing import Callable

import msgspec
import numpy as np

from packloader.balancers.factory import make_planner
from packloader.balancers.planners.contract import check_step_plan, rank_caps
from packloader.balancers.planners.registry import Planner, StepLayout, Window, planner_spec
from packloader.contracts import PlanConfig, PlannerState, StepPlan
from packloader.report.draw import Draw


def role_of(name: str) -> str:
    """A registered planner's role ("baseline": another tool's packer); "packloader" for an unknown name."""
    try:
        return planner_spec(name).role
    except ValueError:
        return "packloader"


def describe(name: str) -> str:
    """The one-line summary of a registered planner for the report (its name when it has none)."""
    try:
        return planner_spec(name).summary or name
    except ValueError:
        return name


@dataclass
class StrategyRun:
    name: str
    config: PlanConfig
    plans: list[StepPlan] = field(default_factory=list)
    plan_seconds: list[float] = field(default_factory=list)
    final_state: PlannerState = field(default_factory=PlannerState)
    queued_at_end: int = 0  # tokens still queued after the last drawn step, before draining
    drain_steps: int = 0  # extra flushed steps (no new documents) that trained what was still queued
    error: str | None = None  # one line: why the strategy was skipped
    traceback: str = ""
    memory_summary: str = ""  # auto: the candidates its memory check dropped, with their peaks

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def role(self) -> str:
        return role_of(self.name)


def _one_line(e: BaseException) -> str:
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {msg}"[:300]


def run_planner(
    planner_factory: Callable[[], Planner],
    name: str,
    config: PlanConfig,
    draw: Draw,
    *,
    steps: int | None = None,
    warmup: bool = True,
    tick: Callable[[], None] | None = None,
    drain: bool = True,
    max_drain_steps: int = 8,
) -> StrategyRun:
    """Plan the first `steps` (default all) drawn steps with fresh planners from `planner_factory`. With
    `warmup`, one throw-away planner plans step 0 first so one-time costs (numba compilation, caches) are not
    counted as planning time. With `drain`, what a planner still holds after the last step (outlier delay) is
    planned in extra flushed steps with no new documents, as the loader does at the end of an epoch, so every
    strategy trains the same tokens and their times compare. Each plan is checked against the planner contract
    (`check_step_plan`, outside the timing; a planner with a cap per rank is held to each).
    Errors, a broken contract among them, are caught and recorded."""
    run = StrategyRun(name, config)
    windows = draw.windows[: steps or len(draw.windows)]
    try:
        if warmup and windows:
            planner_factory().plan(windows[0], PlannerState(), 0)
        planner = planner_factory()
        caps = rank_caps(planner)
        state = PlannerState()
        for k, w in enumerate(windows):
            t0 = time.perf_counter()
            plan, after = planner.plan(w, state, k)
            run.plan_seconds.append(time.perf_counter() - t0)
            check_step_plan(plan, w, state, after, config, k, planner=name, caps=caps)
            state = after
            run.plans.append(plan)
            if tick is not None:
                tick()
        run.queued_at_end = sum(q.length for q in state.queued)
        run.memory_summary = getattr(planner, "memory_summary", lambda: "")()
        empty = Window(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64))
        k = len(windows)
        while drain and state.queued and run.drain_steps < max_drain_steps:
            t0 = time.perf_counter()
            plan, after = planner.plan(empty, state, StepLayout(k, flush=True))
            run.plan_seconds.append(time.perf_counter() - t0)
            check_step_plan(plan, empty, state, after, config, k, planner=name, caps=caps)
            state = after
            run.plans.append(plan)
            run.drain_steps += 1
            k += 1
        run.final_state = state
    except Exception as e:  # a strategy that raises is reported as skipped, with its reason
        run.error = _one_line(e)
        run.plans, run.plan_seconds = [], []
        run.traceback = traceback.format_exc()
    return run


def run_strategy(name: str, config: PlanConfig, draw: Draw, **kw) -> StrategyRun:
    """`run_planner` for a registered strategy name; an unknown or broken one comes back with `error` set."""
    try:
        cfg = msgspec.structs.replace(config, strategy=name)
    except Exception as e:
        return StrategyRun(name, config, error=_one_line(e))
    try:
        make_planner(cfg)  # fails here when the strategy's module does not import
    except Exception as e:
        return StrategyRun(name, cfg, error=_one_line(e))
    return run_planner(lambda: make_planner(cfg), name, cfg, draw, **kw)
