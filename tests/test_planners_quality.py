"""Planner quality against independent references: a brute-force optimum of the largest micro-batch cost on
small instances, the lower bound max(total / ranks, largest piece) on long-tail lengths, heterogeneous
Hydraulis ranks, and `auto` never slower (simulated) than the single planners it chooses among.

Costs here come from a direct transcription of the cost formula in `contracts.CostProfile` (not the numba
kernels the planners use)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from packloader.balancers.cost.lookup import cost_model_for
from packloader.balancers.cost.model import CostModel
from packloader.balancers.factory import make_planner
from packloader.balancers.planners.hydraulis import HydraulisPlanner
from packloader.balancers.planners.registry import StepLayout, Window
from packloader.balancers.planners.slimpack import SlimPackPlanner
from packloader.balancers.sim.metrics import score_plan
from packloader.balancers.sim.verify import verify_plan
from packloader.contracts import ParallelConfig, PlanConfig, PlannerState


def mb_cost(model: CostModel, segs, g: int = 1) -> float:
    """Forward + backward seconds of a micro-batch [(q, p), ...] by the CostProfile formula; run by a DP-Merge
    group of g ranks, each member's share (1/g of the attention, the linear part of n/g tokens)."""
    pr = model.profile
    tile = pr.tile
    attn = 0.0
    n = 0
    for q, p in segs:
        qt = math.ceil(q / tile) * tile if tile > 1 else q
        for poly in (pr.attn_fwd, pr.attn_bwd):
            attn += poly.a * (qt * qt + 2 * qt * p) + poly.b * qt + poly.c
        n += q
    x = n / g
    t = pr.lin_table
    if t is None:
        return attn / g + sum(poly.a * x * x + poly.b * x + poly.c for poly in (pr.lin_fwd, pr.lin_bwd))
    return attn / g + sum(float(np.interp(x, t.tokens, times)) if x <= t.tokens[-1] else times[-1] * x / t.tokens[-1]
                          for times in (t.fwd, t.bwd))  # a measured table: floor, interpolated, per token past it


def piece_work(model: CostModel, l: int) -> float:
    """A piece's own workload: its micro-batch cost alone minus the micro-batch floor."""
    return mb_cost(model, [(l, 0)]) - mb_cost(model, [])


def plan_mb_costs(model, plan):
    return [[mb_cost(model, [(s.end - s.start, s.start - s.attend_from) for s in mb.segments], len(mb.dp_group or [0]))
             for mb in r.micro_batches] for r in plan.ranks]


def brute_force_max_bin(model, lengths, bins, cap):
    """The smallest possible largest micro-batch cost over every assignment of pieces to `bins` bins."""
    best = math.inf
    for assign in itertools.product(range(bins), repeat=len(lengths)):
        if assign and assign[0] != 0:  # bins are interchangeable: the first piece goes to bin 0
            continue
        groups = [[] for _ in range(bins)]
        for l, b in zip(lengths, assign):
            groups[b].append(l)
        if any(sum(g) > cap for g in groups):
            continue
        best = min(best, max(mb_cost(model, [(l, 0) for l in g]) for g in groups))
    return best


# LPT-type greedy on additive costs is within 4/3 of the optimum; slimpack's Pack phase balances forward and
# backward relative to per-rank budgets after an LPT dispatch, so it gets a looser factor.
FACTORS = {"wlb": 4 / 3, "hydraulis": 4 / 3, "slimpack": 1.5}


@pytest.mark.parametrize("strategy", ["wlb", "hydraulis", "slimpack"])
def test_largest_micro_batch_within_factor_of_brute_force_optimum(strategy):
    rng = np.random.default_rng(1)
    worst = 0.0
    for trial in range(16):
        dp, v = [(1, 2), (2, 1), (1, 3), (3, 1), (2, 2)][trial % 5]
        n = int(rng.integers(4, 9 if dp * v <= 2 else 8 if dp * v == 3 else 7))
        lengths = rng.integers(300, 2500, n).tolist()
        if trial % 4 == 0:
            lengths[0] = 3900  # a dominant piece
        cap = 8192
        cfg = PlanConfig(strategy=strategy, parallel=ParallelConfig(dp=dp), max_tokens=cap, context=cap,
                         num_micro_batches=v, allow_slicing=False, model="llama2-7b")
        model = cost_model_for(cfg)
        # slimpack without DP-Merge: a merged piece takes a position of its own on its group's ranks, so V
        # would not be the V of the brute force
        planner = SlimPackPlanner(cfg, dp_merge=False) if strategy == "slimpack" else make_planner(cfg)
        plan, state = planner.plan(Window.from_lengths(np.array(lengths)), PlannerState(), StepLayout(0, flush=True))
        assert state.queued == []
        got = max(max(r) for r in plan_mb_costs(model, plan))
        assert sum(len(r.micro_batches) for r in plan.ranks) == dp * v
        opt = brute_force_max_bin(model, lengths, dp * v, cap)
        worst = max(worst, got / opt)
        assert got <= FACTORS[strategy] * opt * (1 + 1e-9), f"trial {trial}: {lengths} dp={dp} v={v}: {got} vs optimum {opt}"
    assert worst >= 1.0 - 1e-9  # nothing beats the optimum (checks the brute force too)


def longtail(n: int, seed: int) -> np.ndarray:
    """Lognormal body (median 1K) with a 2 % Pareto tail from 16K, capped at 64K: long-tail pretraining lengths."""
    rng = np.random.default_rng(seed)
    body = rng.lognormal(np.log(1000), 1.4, n)
    tail = 16384 * (1 + rng.pareto(1.2, n))
    x = np.where(rng.random(n) < 0.02, tail, body)
    return np.clip(np.rint(x), 16, 65536).astype(np.int64)


# slowest rank's work / max(total / ranks, largest piece) at PP 1 on long-tail data (measured: wlb 1.16, whose
# bins are dealt to ranks after packing; hydraulis and auto 1.0001; slimpack 1.01). slimpack and auto may slice
# and DP-merge, so for them the bound is total / ranks alone.
LB_FACTORS = {"wlb": 1.25, "hydraulis": 1.02, "slimpack": 1.05, "auto": 1.02}


@pytest.mark.parametrize("strategy", ["wlb", "hydraulis", "slimpack", "auto"])
def test_slowest_rank_near_lower_bound_on_long_tail(strategy):
    dp, cap = 8, 65536
    # analytic: the bound splits a micro-batch's time into a floor plus per-piece work, exact only for a linear
    # part that is affine in tokens (a measured table is not)
    cfg = PlanConfig(strategy=strategy, parallel=ParallelConfig(dp=dp), max_tokens=cap, context=cap,
                     tokens_per_step=dp * 4 * cap, allow_slicing=strategy in ("slimpack", "auto"), cost="analytic")
    model = cost_model_for(cfg)
    lengths = longtail(2500, 5)
    cum = np.cumsum(lengths)
    planner = make_planner(cfg)
    state = PlannerState()
    start = 0
    floor = mb_cost(model, [])
    ratios = []
    for step in range(2):
        end = int(np.searchsorted(cum, cum[start] - lengths[start] + cfg.tokens_per_step)) + 1
        w = Window.from_lengths(lengths[start:end], first_doc=start)
        start = end
        plan, state = planner.plan(w, state, StepLayout(step, flush=True))
        costs = plan_mb_costs(model, plan)
        # a rank's work: its micro-batches' costs without their floors (floors are the same per micro-batch)
        rank_work = [sum(c) - floor * len(c) for c in costs]
        works = [piece_work(model, int(l)) for l in w.length]
        bound = max(sum(works) / dp, max(works) if strategy != "slimpack" and strategy != "auto" else 0.0)
        ratios.append(max(rank_work) / bound)
        assert max(rank_work) >= bound * (1 - 1e-6) or strategy in ("slimpack", "auto")
    assert max(ratios) <= LB_FACTORS[strategy], ratios


def test_heterogeneous_hydraulis_ranks_follow_their_models_and_caps():
    """Two fast ranks and two twice-as-slow ones with a smaller cap: every rank within its own cap, and the
    slowest rank's time within 4/3 of the best achievable over all assignments (brute force, V = 1)."""
    base = PlanConfig(strategy="hydraulis", parallel=ParallelConfig(dp=4), max_tokens=8192, context=8192,
                      num_micro_batches=1, model="llama2-7b")
    fast = cost_model_for(base)
    slow = fast.scaled(2.0)
    models = [fast, fast, slow, slow]
    caps = [8192, 8192, 4096, 4096]
    planner = HydraulisPlanner(base, models=models, caps=caps)
    rng = np.random.default_rng(3)
    for trial in range(6):
        lengths = rng.integers(200, 4000, 7).tolist()
        plan, _ = planner.plan(Window.from_lengths(np.array(lengths)), PlannerState(), trial)
        verify_plan(plan, Window.from_lengths(np.array(lengths)), 8192, dp=4)
        times = []
        for r, rank in enumerate(plan.ranks):
            for mb in rank.micro_batches:
                assert mb.num_tokens <= caps[r]
                # the plan's own cost annotation uses the rank's model
                assert mb.fwd_cost + mb.bwd_cost == pytest.approx(mb_cost(models[r], [(s.end - s.start, 0) for s in mb.segments]))
            times.append(sum(mb_cost(models[r], [(s.end - s.start, 0) for s in mb.segments]) for mb in rank.micro_batches))
        best = math.inf
        for assign in itertools.product(range(4), repeat=len(lengths)):
            groups = [[l for l, a in zip(lengths, assign) if a == r] for r in range(4)]
            if any(sum(g) > caps[r] for r, g in enumerate(groups)):
                continue
            best = min(best, max(mb_cost(models[r], [(l, 0) for l in g]) for r, g in enumerate(groups)))
        assert max(times) <= 4 / 3 * best * (1 + 1e-9), (lengths, times, best)
        assert max(times) >= best * (1 - 1e-9)


@pytest.mark.parametrize("pp,slicing", [(4, True), (1, True), (4, False)])
def test_auto_is_never_slower_than_the_planners_it_chooses_among(pp, slicing):
    """Simulated (metrics.score_plan, from the StepPlan) step time of auto against wlb, slimpack and fixed
    planning the same flushed window with their defaults: auto's must not be worse beyond its tie tolerance
    than those whose simulated peak memory fits the H100 (auto only chooses among plans that fit; tp 8 so that
    llama3-8b fits at all)."""
    from packloader.balancers.cost.memory import MemoryModel
    from packloader.balancers.sim.simulator import simulate_step

    dp, cap = 4, 16384
    lengths = longtail(700, 9)
    lengths = np.minimum(lengths, cap if not slicing else 4 * cap)
    ctx = 4 * cap if slicing else cap
    window = None
    times, peaks = {}, {}
    for strategy in ["auto", "wlb", "slimpack", "fixed"]:
        if strategy == "slimpack" and not slicing:
            continue
        cfg = PlanConfig(strategy=strategy, parallel=ParallelConfig(dp=dp, pp=pp, tp=8), max_tokens=cap,
                         context=ctx if strategy in ("auto", "slimpack") else cap, allow_slicing=slicing)
        w = Window.from_lengths(lengths[:120])
        if cfg.context < ctx:  # planners that cannot slice get the same documents as context pieces
            if (w.length > cap).any():
                continue
        window = w
        plan, _ = make_planner(cfg).plan(window, PlannerState(), StepLayout(0, flush=True))
        memory = MemoryModel.for_preset(cfg.model, cfg.parallel)
        peaks[strategy] = simulate_step(plan, cost_model_for(cfg), cfg.parallel, memory=memory).peak_bytes
        times[strategy] = score_plan(plan, cost_model_for(cfg), cfg.parallel).step_time
    limit = (80 * 0.92 - 2) * 1024**3  # 80 GiB, 92 % usable, 2 GiB reserve
    assert peaks["auto"] <= limit, peaks
    others = [t for s, t in times.items() if s != "auto" and peaks[s] <= limit]
    assert others, (times, peaks)
    assert times["auto"] <= min(others) * 1.006, (times, peaks)


def test_auto_respects_the_memory_cap_of_a_profile(tmp_path):
    """A calibration profile with a memory cap (MaxLen) below --max-tokens: auto plans under the smaller."""
    from packloader.balancers.cost.profile_io import save_profile

    model = cost_model_for(PlanConfig(model="llama2-7b")).with_memory_cap(1024)
    path = tmp_path / "capped.json"
    save_profile(model.profile, path)
    cfg = PlanConfig(strategy="auto", parallel=ParallelConfig(dp=2, pp=2), max_tokens=4096, context=4096, model=str(path))
    lengths = np.array([3000, 900, 40, 700, 1200, 64, 2000])
    plan, state = make_planner(cfg).plan(Window.from_lengths(lengths), PlannerState(), StepLayout(0, flush=True))
    verify_plan(plan, Window.from_lengths(lengths), 1024, dp=2)
    assert max(mb.num_tokens for r in plan.ranks for mb in r.micro_batches) <= 1024
