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

from packloader.balancers.planners.packing import FLUSH, flush_state
from packloader.balancers.planners.registry import Planner, Window, make_planner
from packloader.contracts import PlanConfig, PlannerState, StepPlan
from packloader.report.draw import Draw

# What users run today (the list) and what packloader offers, in the order the report shows them.
BASELINES = ("concat", "fixed", "multipack", "karmarkar_karp")
PACKLOADER = ("wlb", "hydraulis", "slimpack", "auto")
DESCRIPTIONS = {
    "concat": "concatenate and chunk (Megatron GPT dataset)",
    "fixed": "best-fit-decreasing by tokens (NeMo, TRL)",
    "multipack": "multipack across ranks (Axolotl)",
    "karmarkar_karp": "Karmarkar-Karp by workload (verl)",
    "multipack_openchat2023": "multipack, 2023 allocator (OpenChat)",
    "karmarkar_karp_verl_legacy": "Karmarkar-Karp by tokens (verl before PR 3605)",
    "wlb": "WLB-LLM: workload packing + outlier delay",
    "hydraulis": "Hydraulis: cost-aware dispatch + packing",
    "slimpack": "SlimPack: slices + asymmetric balance",
    "auto": "packloader auto: best plan by simulation",
}


def role_of(name: str) -> str:
    return "baseline" if name in BASELINES else "packloader"


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
    strategy trains the same tokens and their times compare. Errors are caught and recorded."""
    run = StrategyRun(name, config)
    windows = draw.windows[: steps or len(draw.windows)]
    try:
        if warmup and windows:
            planner_factory().plan(windows[0], PlannerState(), 0)
        planner = planner_factory()
        state = PlannerState()
        for k, w in enumerate(windows):
            t0 = time.perf_counter()
            plan, state = planner.plan(w, state, k)
            run.plan_seconds.append(time.perf_counter() - t0)
            run.plans.append(plan)
            if tick is not None:
                tick()
        run.queued_at_end = sum(q.length for q in state.queued)
        run.memory_summary = getattr(planner, "memory_summary", lambda: "")()
        empty = Window(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64))
        k = len(windows)
        while drain and state.queued and run.drain_steps < max_drain_steps:
            t0 = time.perf_counter()
            plan, state = planner.plan(empty, flush_state(state), k)
            run.plan_seconds.append(time.perf_counter() - t0)
            run.plans.append(plan)
            run.drain_steps += 1
            k += 1
        state = msgspec.structs.replace(state, extra={a: b for a, b in state.extra.items() if a != FLUSH})
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
