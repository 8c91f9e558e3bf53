"""Whole planner runs over windows cut here (not the loader's code), and the seeded long-tail lengths they plan:
what the planner property tests run, in the test process and in a fresh interpreter."""

from __future__ import annotations

import msgspec
import numpy as np

from packloader.balancers.factory import make_planner
from packloader.balancers.planners.registry import StepLayout, Window
from packloader.contracts import ParallelConfig, PlanConfig, PlannerState

PLANNERS = ["wlb", "hydraulis", "slimpack", "auto"]


def cut(first_doc: int, lengths, context: int) -> Window:
    """Documents first_doc.. cut into independent context pieces (written here, not the loader's code)."""
    doc, off, ln = [], [], []
    for i, l in enumerate(lengths):
        for o in range(0, int(l), context):
            doc.append(first_doc + i)
            off.append(o)
            ln.append(min(context, int(l) - o))
    return Window(np.array(doc, np.int64), np.array(off, np.int64), np.array(ln, np.int64))


def run_planner(cfg: PlanConfig, step_lengths: list[list[int]], planner=None):
    """Plan one window per entry of step_lengths (doc ids consecutive), flushing at the last step."""
    planner = planner or make_planner(cfg)
    state = PlannerState()
    plans, windows, first = [], [], 0
    for s, lens in enumerate(step_lengths):
        w = cut(first, lens, cfg.context)
        first += len(lens)
        windows.append(w)
        plan, state = planner.plan(w, state, StepLayout(s, flush=s == len(step_lengths) - 1))
        plans.append(plan)
    return plans, windows, state


def longtail(n: int, seed: int, cap: int) -> list[int]:
    rng = np.random.default_rng(seed)
    body = rng.lognormal(np.log(cap / 16), 1.2, n)
    tail = cap / 2 * (1 + rng.pareto(1.2, n))
    x = np.where(rng.random(n) < 0.05, tail, body)
    return np.clip(np.rint(x), 1, 3 * cap).astype(np.int64).tolist()


def steps_of(lengths: list[int], per_step: int) -> list[list[int]]:
    out, cur, tot = [], [], 0
    for l in lengths:
        cur.append(l)
        tot += l
        if tot >= per_step:
            out.append(cur)
            cur, tot = [], 0
    if cur:
        out.append(cur)
    return out


def encoded_run(strategy: str) -> bytes:
    """One seeded run's plans, JSON-encoded: compared between this process and a fresh one."""
    cfg = PlanConfig(strategy=strategy, parallel=ParallelConfig(dp=3, pp=2), max_tokens=1024,
                     context=2048 if strategy in ("slimpack", "auto") else 1024,
                     tokens_per_step=3 * 1024 * 2, seed=5)
    lengths = longtail(120, 3, 1024)
    plans, _, _ = run_planner(cfg, steps_of(lengths, cfg.tokens_per_step))
    return msgspec.json.encode(plans)
