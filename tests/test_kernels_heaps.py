"""The wlb and Hydraulis packing kernels (binary heaps for many bins, scans for few) against plain-Python transcriptions of the papers' loops
(scan every bin for the least loaded one, ties to the lowest index): the same bins for every piece.

Costs for the references come from the CostProfile formula written out here (tile-rounded causal attention
plus linear work with a floor), not from the kernels' cost functions. Inputs are drawn from a few distinct
lengths so that equal loads (ties) are common."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st

from packloader.balancers.cost.lookup import cost_model_for
from packloader.balancers.planners.base import StepLayout
from packloader.balancers.planners.bins import HEAP_MIN_BINS
from packloader.balancers.planners.hydraulis import hydraulis_pack
from packloader.balancers.planners.wlb import wlb_pack
from packloader.contracts import ParallelConfig, PlanConfig

# The references write out the polynomial form, so the model is the analytic one (the measured profile's linear
# part is a table: tests/test_cost_measured.py checks it against its rows).
MODEL = cost_model_for(PlanConfig(strategy="wlb", parallel=ParallelConfig(dp=2, pp=2), max_tokens=4096, context=4096,
                                  cost="analytic"))


def attn(l: int) -> float:
    """Forward + backward attention seconds of a whole causal piece of l tokens (no prefix)."""
    pr = MODEL.profile
    q = math.ceil(l / pr.tile) * pr.tile if pr.tile > 1 else l
    return sum(p.a * q * q + p.b * q + p.c for p in (pr.attn_fwd, pr.attn_bwd))


def bin_time(a: float, n: int) -> float:
    pr = MODEL.profile
    return a + sum(p.a * n * n + p.b * n + p.c for p in (pr.lin_fwd, pr.lin_bwd))


def wlb_reference(lengths: list[int], nbins: int, cap: int) -> list[int]:
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])  # stable: ties in index order
    a = [0.0] * nbins
    tok = [0] * nbins
    load = [bin_time(0.0, 0)] * nbins
    out = [-1] * len(lengths)
    for i in order:
        l = lengths[i]
        w = min(range(nbins), key=lambda b: (load[b], b))
        f = min(range(nbins), key=lambda b: (tok[b], b))
        b = w if tok[w] + l <= cap else (f if tok[f] + l <= cap else -1)
        if b < 0:
            continue
        out[i] = b
        a[b] += attn(l)
        tok[b] += l
        load[b] = bin_time(a[b], tok[b])
    return out


def hydraulis_reference(lengths: list[int], rank: list[int], dp: int, v: int, cap: int | list[int]) -> list[int] | None:
    caps = cap if isinstance(cap, list) else [cap] * dp
    work = [bin_time(attn(l), l) - bin_time(0.0, 0) for l in lengths]
    order = sorted(range(len(lengths)), key=lambda i: -work[i])
    a = [0.0] * (dp * v)
    tok = [0] * (dp * v)
    load = [0.0] * (dp * v)
    out = [-1] * len(lengths)
    for i in order:
        l, r = lengths[i], rank[i]
        fits = [b for b in range(r * v, (r + 1) * v) if tok[b] + l <= caps[r]]
        if not fits:
            return None
        b = min(fits, key=lambda b: (load[b], b))
        out[i] = b
        a[b] += attn(l)
        tok[b] += l
        load[b] = bin_time(a[b], tok[b])
    return out


lengths_st = st.lists(st.sampled_from([1, 64, 100, 128, 700, 1024, 2048, 4000]), min_size=0, max_size=150)


@settings(max_examples=80, deadline=None)
@given(lengths_st, st.one_of(st.integers(1, 12), st.integers(HEAP_MIN_BINS - 2, HEAP_MIN_BINS + 40)),
       st.sampled_from([2048, 4096]))
def test_wlb_pack_matches_scan_reference(lengths, nbins, cap):
    got, _, tok = wlb_pack(MODEL.coeffs, np.array(lengths, np.int64), nbins, cap)
    assert got.tolist() == wlb_reference(lengths, nbins, cap)
    assert (tok <= cap).all()


@settings(max_examples=80, deadline=None)
@given(lengths_st, st.integers(1, 3), st.one_of(st.integers(1, 8), st.integers(HEAP_MIN_BINS // 4 - 1, HEAP_MIN_BINS // 4 + 12)),
       st.sampled_from([2048, 4096]), st.randoms(use_true_random=False))
def test_hydraulis_pack_matches_scan_reference(lengths, dp, v, cap, rnd):
    rank = [rnd.randrange(dp) for _ in lengths]
    caps = np.full(dp, cap, np.int64)
    got, _ = hydraulis_pack(np.ascontiguousarray(MODEL.coeffs[None, :]), np.zeros(dp, np.int64), caps,
                            np.array(lengths, np.int64), np.array(rank, np.int64), v)
    ref = hydraulis_reference(lengths, rank, dp, v, cap)
    if ref is None:
        assert (got == -1).all()
    else:
        assert got.tolist() == ref


@settings(max_examples=60, deadline=None)
@given(lengths_st, st.integers(2, 5), st.one_of(st.integers(1, 6), st.integers(HEAP_MIN_BINS // 4 - 1, HEAP_MIN_BINS // 4 + 4)),
       st.randoms(use_true_random=False))
def test_hydraulis_pack_with_a_cap_per_rank_matches_the_reference(lengths, dp, v, rnd):
    """Ranks with different caps (the scan takes each rank's cap once, packing rank by rank)."""
    rank = [rnd.randrange(dp) for _ in lengths]
    caps = [rnd.choice([2048, 4096, 8192]) for _ in range(dp)]
    got, _ = hydraulis_pack(np.ascontiguousarray(MODEL.coeffs[None, :]), np.zeros(dp, np.int64), np.array(caps, np.int64),
                            np.array(lengths, np.int64), np.array(rank, np.int64), v)
    ref = hydraulis_reference(lengths, rank, dp, v, caps)
    if ref is None:
        assert (got == -1).all()
    else:
        assert got.tolist() == ref


@settings(max_examples=40, deadline=None)
@example([1, 1, 161, 1458, 2638, 2638], 1, 1, 3, "measured")  # a measured table is not convex: the table bound
@given(st.lists(st.integers(1, 4096), min_size=1, max_size=120), st.integers(1, 4), st.sampled_from([1, 2, 4]),
       st.sampled_from([3, 24]), st.sampled_from(["analytic", "measured"]))
def test_hydraulis_v_bound_skips_only_losing_counts(lengths, dp, pp, v_limit, cost):
    """`HydraulisPlanner.solve` skips a V whose objective lower bound cannot beat the best so far: the plan
    must equal the one from packing every V of the window (the bound disabled)."""
    from packloader.balancers.planners.hydraulis import HydraulisPlanner
    from packloader.balancers.planners.packing import Pieces
    from packloader.balancers.planners.registry import Window
    from packloader.contracts import PlannerState

    cfg = PlanConfig(strategy="hydraulis", parallel=ParallelConfig(dp=dp, pp=pp), max_tokens=4096, context=4096,
                     cost=cost)
    pieces = Pieces.of(Window.from_lengths(np.array(lengths)), PlannerState(), 0)
    fast = HydraulisPlanner(cfg, trials=1, v_limit=v_limit)
    full = HydraulisPlanner(cfg, trials=1, v_limit=v_limit)
    full.v_bound = lambda pieces, rank, ra=None: None
    a, b = fast.solve(pieces, StepLayout(0), fast.model), full.solve(pieces, StepLayout(0), full.model)
    assert a.rank_mbs.shape == b.rank_mbs.shape
    assert a.seg_mb.tolist() == b.seg_mb.tolist()


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 20), st.integers(1, 4), st.data())
def test_backward_runs_kernel_matches_reference(num_slots, dp, data):
    """slimpack's numba backward orders (all ranks at once) against `slimpack.backward_runs`."""
    from packloader.balancers.planners.slimpack import backward_runs
    from packloader.balancers.planners.slimpack_kernels import backward_runs_ranks

    spans = data.draw(st.lists(st.tuples(st.integers(0, dp - 1), st.integers(0, num_slots - 1), st.integers(0, num_slots - 1)),
                               max_size=8))
    spans = [(r, min(a, b), max(a, b)) for r, a, b in spans]
    arr = np.array(spans, np.int64).reshape(-1, 3)
    order, has = backward_runs_ranks(num_slots, dp, arr[:, 0].copy(), arr[:, 1].copy(), arr[:, 2].copy())
    for r in range(dp):
        ref = backward_runs(num_slots, [(a, b) for rr, a, b in spans if rr == r])
        assert (order[r].tolist() if has[r] else None) == ref
