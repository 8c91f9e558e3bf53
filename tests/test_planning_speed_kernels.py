"""The planners' fast paths at DP 1024 (issue 25: heaps instead of a scan of every rank, counting sorts instead
of merge sorts) against plain-Python transcriptions of the loops they replace: the same choices, ties to the
lowest index.

Costs for the dispatch references are integers (sums exact in floating point), so equal bounds are common and
the tie rules are what is checked; lengths are drawn from a few values for the same reason."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.planners import ATTENTION_HEAVY, wlb_reference
from hypothesis import given, settings
from hypothesis import strategies as st

from packloader.balancers.cost.coeffs import LIN_BWD, LIN_FWD, doc_time_split
from packloader.balancers.cost.lookup import cost_model_for
from packloader.balancers.planners.bins import desc_order, desc_order_by
from packloader.balancers.planners.hydraulis_kernels import _dispatch_longest_first, _dispatch_trial, hydraulis_dispatch
from packloader.balancers.planners.slimpack_kernels import lpt_dispatch
from packloader.balancers.planners.wlb import deal_bins
from packloader.contracts import ParallelConfig, PlanConfig


def dispatch_reference(lengths: list[int], t_sum: list[float], t_full: list[float], d: int, pp: int) -> list[int]:
    """Hydraulis Algorithm 1 as written: pieces longest first (ties in index order), each to the rank whose
    largest bound over all ranks, max_k (sum T + T(max l) * (PP - 1)), is smallest after taking it; ties to the
    rank whose own bound is smaller, then the lowest rank."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    cc, ee, lmax = [0.0] * d, [0.0] * d, [0] * d
    out = [-1] * len(lengths)
    for i in order:
        l = lengths[i]
        best = None
        for j in range(d):
            own = cc[j] + t_sum[i] + (ee[j] if lmax[j] >= l else t_full[i] * (pp - 1))
            worst = max([own] + [cc[k] + ee[k] for k in range(d) if k != j])
            key = (worst, own, j)
            best = key if best is None or key < best else best
        j = best[2]
        out[i] = j
        cc[j] += t_sum[i]
        if l > lmax[j]:
            lmax[j] = l
            ee[j] = t_full[i] * (pp - 1)
    return out


lengths_st = st.lists(st.sampled_from([0, 1, 3, 8, 64, 100, 700, 1024, 4000]), min_size=0, max_size=120)


@settings(max_examples=80, deadline=None)
@given(lengths_st, st.integers(1, 9), st.sampled_from([1, 2, 4]), st.integers(0, 5))
def test_longest_first_heap_dispatch_matches_algorithm_1(lengths, d, pp, floor):
    lengths_a = np.array(lengths, np.int64)
    t_sum = [float(l * l // 64 + 3 * l) for l in lengths]  # integer seconds: exact sums
    t_full = [t + floor for t in t_sum]
    ref = dispatch_reference(lengths, t_sum, t_full, d, pp)
    order = np.argsort(-lengths_a, kind="stable")
    bufs = lambda: (np.empty(len(lengths), np.int64), np.empty(d), np.empty(d), np.empty(d, np.int64))  # noqa: E731
    heap = bufs()
    _dispatch_longest_first(order, lengths_a, np.array(t_sum), np.array(t_full), pp, *heap)
    scan = bufs()
    _dispatch_trial(order, lengths_a, np.full(d, 1 << 20, np.int64), np.zeros(d, np.int64),
                    np.array([t_sum]), np.array([t_full]), pp, *scan)
    assert heap[0].tolist() == ref
    assert scan[0].tolist() == ref


def test_heap_dispatch_matches_the_scan_on_a_dp1024_draw():
    """The measured H100 costs (floating point) on the benchmark's kind of step: the kernel with the heap
    (trial 0 on identical ranks) gives the same ranks as the scan of every rank."""
    model = cost_model_for(PlanConfig(strategy="hydraulis", parallel=ParallelConfig(dp=1024, tp=8), max_tokens=65536,
                                      context=65536))
    rng = np.random.default_rng(3)
    lengths = np.minimum(np.rint(rng.lognormal(np.log(1000), 1.6, 40_000)).astype(np.int64) + 1, 65536)
    lengths[:700] = 65536  # whole context-window pieces: equal bounds on many ranks
    d = 1024
    for pp in (1, 4):
        coeffs = np.ascontiguousarray(model.coeffs[None, :])
        fast, _ = hydraulis_dispatch(coeffs, np.zeros(d, np.int64), np.full(d, 65536, np.int64), lengths, pp, 1, 0)
        f, b = doc_time_split(model.coeffs, lengths)
        t = f + b
        floor = float(model.coeffs[LIN_FWD + 2] + model.coeffs[LIN_BWD + 2])  # as the kernel adds it
        scan = np.empty(len(lengths), np.int64)
        _dispatch_trial(np.argsort(-lengths, kind="stable"), lengths, np.full(d, 65536, np.int64), np.zeros(d, np.int64),
                        np.array([t]), np.array([t + floor]), pp, scan, np.empty(d), np.empty(d), np.empty(d, np.int64))
        assert (fast == scan).all()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 70), min_size=0, max_size=200), st.booleans())
def test_counting_orders_equal_the_stable_argsort(lengths, wide):
    a = np.array(lengths, np.int64) * (1 << 22 if wide else 1)  # wide: past the counting span, merge sort
    assert desc_order(a).tolist() == np.argsort(-a, kind="stable").tolist()
    key = ((a % 7) * 1.5 + (a > 30)).astype(np.float64)  # a function of the length, not monotone, with ties
    assert desc_order_by(key, a).tolist() == np.argsort(-key, kind="stable").tolist()


def lpt_reference(work: list[float], dp: int, merge_share: float) -> tuple[list[int], list[list[int]]]:
    order = sorted(range(len(work)), key=lambda i: -work[i])
    load = [0.0] * dp
    rank, groups = [-1] * len(work), [[] for _ in work]
    for i in order:
        g = min(max(-(-work[i] // merge_share), 2), dp) if dp > 1 and work[i] > merge_share else 1
        if g > 1:
            grp = sorted(sorted(range(dp), key=lambda r: (load[r], r))[: int(g)])
            for r in grp:
                load[r] += work[i] / g
            groups[i] = grp
        else:
            r = min(range(dp), key=lambda r: (load[r], r))
            rank[i] = r
            load[r] += work[i]
    return rank, groups


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from([1, 2, 3, 5, 8, 40]), min_size=0, max_size=150), st.integers(1, 12),
       st.sampled_from([np.inf, 30.0, 10.0]))
def test_lpt_dispatch_matches_the_scan(lengths, dp, merge_share):
    lengths_a = np.array(lengths, np.int64)
    work = (lengths_a * 2 + lengths_a % 3).astype(np.float64)  # a function of the length
    rank, members, offs = lpt_dispatch(work, dp, merge_share, lengths_a)
    ref_rank, ref_groups = lpt_reference(work.tolist(), dp, merge_share)
    assert rank.tolist() == ref_rank
    assert [members[offs[i]:offs[i + 1]].tolist() for i in range(len(lengths))] == ref_groups


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from([0.0, 1.0, 2.0, 3.5, 7.0]), min_size=0, max_size=60), st.integers(1, 8))
def test_deal_bins_matches_the_scan(costs, dp):
    per_rank = max(1, -(-len(costs) // dp))
    cost = np.array(costs + [0.0] * (dp * per_rank - len(costs)))
    rank, pos = deal_bins(cost, dp, per_rank)
    load, count = [0.0] * dp, [0] * dp
    for b in sorted(range(len(cost)), key=lambda b: -cost[b]):
        r = min((r for r in range(dp) if count[r] < per_rank), key=lambda r: (load[r], r))
        assert (rank[b], pos[b]) == (r, count[r])
        load[r] += cost[b]
        count[r] += 1


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 65536), min_size=1, max_size=200), st.integers(1, 6), st.sampled_from([1, 4]),
       st.integers(1, 40), st.randoms(use_true_random=False))
def test_hydraulis_table_bound_is_below_every_packing(lengths, dp, pp, v, rnd):
    """The bound that lets hydraulis skip a micro-batch count under the measured (non-convex) linear table never
    exceeds the objective of the packing it skips: max micro-batch time x (PP - 1 + V), packed for real."""
    from packloader.balancers.planners.hydraulis import HydraulisPlanner, hydraulis_pack
    from packloader.balancers.planners.packing import Pieces
    from packloader.balancers.planners.registry import Window
    from packloader.contracts import PlannerState

    cfg = PlanConfig(strategy="hydraulis", parallel=ParallelConfig(dp=dp, pp=pp, tp=8), max_tokens=65536,
                     context=65536)
    planner = HydraulisPlanner(cfg, trials=1)
    pieces = Pieces.of(Window.from_lengths(np.array(lengths)), PlannerState(), 0)
    ra = planner.arrays()
    rank = np.array([rnd.randrange(dp) for _ in lengths], np.int64)
    bound = planner.v_bound(pieces, rank, ra)
    assert bound is not None  # the measured profile: the table bound
    assign, load = hydraulis_pack(ra.coeffs, ra.rank_profile, ra.caps, pieces.length, rank, v)
    if assign[0] >= 0:
        assert bound(v) <= float(load.max()) * (pp - 1 + v) * (1 + 1e-12)


@settings(max_examples=20, deadline=None)
@given(st.lists(st.integers(1, 3000), min_size=1, max_size=40), st.sampled_from([1, 2, 3]), st.integers(0, 3))
def test_slice_edges_with_sparse_document_ids(lengths, dp, shift):
    """slice_edges_kernel finds the segment a slice continues by a flag per document id where the step's ids
    are dense, by a sorted search where they are not: ids spread 10^6 apart give the same edges."""
    from packloader.balancers.planners.base import StepLayout
    from packloader.balancers.planners.packing import Pieces, slice_edges_kernel
    from packloader.balancers.planners.registry import Window
    from packloader.balancers.planners.slimpack import SlimPackPlanner
    from packloader.contracts import PlannerState

    cfg = PlanConfig(strategy="slimpack", parallel=ParallelConfig(dp=dp), max_tokens=512, context=3000)
    planner = SlimPackPlanner(cfg)
    pk = planner.solve(Pieces.of(Window.from_lengths(np.array(lengths)), PlannerState(), 0), StepLayout(0),
                       planner.model)
    dense = slice_edges_kernel(pk.seg_doc + shift, pk.seg_start, pk.seg_end, pk.seg_af, pk.seg_mb, pk.rank_mbs)
    sparse = slice_edges_kernel(pk.seg_doc * 10**6 + shift, pk.seg_start, pk.seg_end, pk.seg_af, pk.seg_mb,
                                pk.rank_mbs)
    assert [a.tolist() for a in dense] == [a.tolist() for a in sparse]


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(1, 3000), min_size=1, max_size=60), st.sampled_from([1, 2, 5]),
       st.sampled_from(["slimpack", "wlb", "hydraulis"]), st.sampled_from([None, 4]))
def test_one_stage_step_time_equals_the_simulator(lengths, dp, strategy, nmb):
    """At PP 1 under 1F1B the step time is summed for ranks without slice edges and simulated for the others:
    bit for bit the simulator's on every rank."""
    from packloader.balancers.factory import make_planner
    from packloader.balancers.planners.base import StepLayout
    from packloader.balancers.planners.packing import Pieces
    from packloader.balancers.planners.packing_measures import slice_edges_prefix
    from packloader.balancers.planners.registry import Window
    from packloader.balancers.planners.schedule_choice import packing_step_time
    from packloader.balancers.sim.kernels import SCHEDULES, step_times_ranks_sliced
    from packloader.contracts import PlannerState

    cfg = PlanConfig(strategy=strategy, parallel=ParallelConfig(dp=dp), max_tokens=512 if strategy == "slimpack" else 3000,
                     context=3000, num_micro_batches=nmb)
    planner = make_planner(cfg)
    pk = planner.solve(Pieces.of(Window.from_lengths(np.array(lengths)), PlannerState(), 0), StepLayout(0),
                       planner.model).costs(planner.model)
    edges = slice_edges_prefix(pk)
    got = packing_step_time(pk, edges, cfg.parallel, SCHEDULES["1f1b"], planner.model)
    d, v = pk.rank_mbs.shape
    order = pk.rank_mbs.ravel()
    f, b = np.ascontiguousarray(pk.mb_fwd[order]), np.ascontiguousarray(pk.mb_bwd[order])
    ref = step_times_ranks_sliced(1, 1, SCHEDULES["1f1b"], f, b, np.zeros_like(b), np.arange(d + 1) * v, *edges[:3], 0.0)
    assert got == float(ref.max())


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(1, 3000), min_size=1, max_size=60), st.sampled_from([1, 2, 5]),
       st.sampled_from(["slimpack", "wlb", "hydraulis"]))
def test_one_stage_peaks_equal_the_simulator(lengths, dp, strategy):
    """At PP 1 under 1F1B peak memory is stepped through for ranks without slices and simulated for the others:
    bit for bit the simulator's on every rank."""
    from packloader.balancers.cost.memory import memory_model_for
    from packloader.balancers.factory import make_planner
    from packloader.balancers.planners.base import StepLayout
    from packloader.balancers.planners.packing import Pieces
    from packloader.balancers.planners.packing_measures import slice_edges_prefix
    from packloader.balancers.planners.registry import Window
    from packloader.balancers.sim.peaks import packing_peaks, peaks_ranks_sliced, stage_bytes
    from packloader.contracts import PlannerState

    cfg = PlanConfig(strategy=strategy, parallel=ParallelConfig(dp=dp, tp=8), max_tokens=512 if strategy == "slimpack"
                     else 3000, context=3000)
    planner = make_planner(cfg)
    pk = planner.solve(Pieces.of(Window.from_lengths(np.array(lengths)), PlannerState(), 0), StepLayout(0),
                       planner.model).costs(planner.model)
    memory = memory_model_for(cfg.model, cfg.parallel, cfg.schedule, cfg.device, cfg.memory_gib)
    edges = slice_edges_prefix(pk)
    got = packing_peaks(pk, memory, 1, 1, 0, edges)
    d, v = pk.rank_mbs.shape
    order = pk.rank_mbs.ravel()
    tokens = np.bincount(pk.seg_mb, weights=(pk.seg_end - pk.seg_start).astype(np.float64),
                         minlength=pk.num_micro_batches)
    for m, grp in pk.groups.items():  # DP-Merge: each member holds its share
        tokens[m] /= len(grp)
    tokens = tokens[order]
    bo, has = np.zeros(d * v, np.int64), np.zeros(d, np.bool_)
    for r, o in enumerate(pk.backward_order or []):
        if o is not None:
            bo[r * v:(r + 1) * v], has[r] = o, True
    act, trans, kv, static = stage_bytes(memory, 1)
    ref = peaks_ranks_sliced(1, 1, 0, pk.mb_fwd[order], pk.mb_bwd[order], tokens, act, trans, kv, np.arange(d + 1) * v,
                             edges[0], edges[1], edges[2], edges[3].astype(np.float64), bo, has)
    assert got.tolist() == (ref + static[None, :]).tolist()


def test_wlb_pack_builds_its_token_heap_after_misses_and_matches_the_scan():
    """wlb_pack finds the fewest-tokens bin by a scan until the least loaded bin has lacked room SCAN_MISSES
    times, then from a heap. Under a cost where attention dominates, bins of many short pieces fill their
    tokens while staying the least loaded, so hundreds of short pieces miss there and go to the bin with the
    fewest tokens instead: both paths are taken, and the bins equal those of WLB-LLM's loop written out."""
    from packloader.balancers.cost.model import CostModel
    from packloader.balancers.planners.bins import HEAP_MIN_BINS
    from packloader.balancers.planners.wlb import SCAN_MISSES, wlb_pack

    prof = ATTENTION_HEAVY
    coeffs = CostModel(prof).coeffs
    nbins, cap = HEAP_MIN_BINS + 4, 4096
    lengths = [1000] * 150 + [10] * 40_000
    ref, to_fewest = wlb_reference(prof, lengths, nbins, cap)
    got, _, _ = wlb_pack(coeffs, np.array(lengths, np.int64), nbins, cap)
    assert to_fewest > 10 * SCAN_MISSES  # the heap path chose bins
    assert got.tolist() == ref


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 4), st.integers(1, 5), st.integers(0, 60), st.booleans(), st.randoms(use_true_random=False))
def test_step_plan_groups_segments_as_listed(dp, v, n, merge, rnd):
    """Packing.to_step_plan (segments grouped by a counting sort, built with map, sliced per micro-batch, garbage
    collection paused) gives each micro-batch its segments in their order in the arrays, as a loop of appends
    does; DP-Merge groups, costs and backward orders carried; collection back as it was."""
    import gc

    from packloader.balancers.planners.packing import Packing
    from packloader.contracts import Segment

    groups = {0: list(range(dp))} if merge and dp > 1 else {}
    rank_mbs = np.arange(dp * v, dtype=np.int64).reshape(dp, v)
    if groups:  # micro-batch 0 on every rank, the others renumbered 1..
        rank_mbs = np.concatenate([np.zeros((dp, 1), np.int64), 1 + np.arange(dp * (v - 1)).reshape(dp, v - 1)], 1)
    nmb = int(rank_mbs.max()) + 1
    mb = np.array([rnd.randrange(nmb) for _ in range(n)], np.int64)
    if rnd.random() < 0.3:
        mb = np.sort(mb)  # already grouped: no sort
    cols = [np.array([rnd.randrange(1000) for _ in range(n)], np.int64) for _ in range(3)]
    start, length = cols[1], cols[2] + 1
    order = [list(range(v))[::-1] if r % 2 else None for r in range(dp)]
    pk = Packing(seg_doc=cols[0], seg_start=start, seg_end=start + length, seg_af=start, seg_mb=mb, rank_mbs=rank_mbs,
                 groups=groups, backward_order=order, mb_fwd=np.arange(nmb, dtype=float), mb_bwd=np.ones(nmb))
    enabled = rnd.random() < 0.8
    (gc.enable if enabled else gc.disable)()
    try:
        plan = pk.to_step_plan(7)
        assert gc.isenabled() == enabled
    finally:
        gc.enable()
    want: list[list] = [[] for _ in range(nmb)]
    for k in range(n):
        want[mb[k]].append(Segment(int(cols[0][k]), int(start[k]), int(start[k] + length[k]), int(start[k])))
    assert plan.step == 7 and len(plan.ranks) == dp
    for r, rp in enumerate(plan.ranks):
        assert rp.backward_order == order[r]
        for j, m in enumerate(rank_mbs[r].tolist()):
            got = rp.micro_batches[j]
            assert got.segments == want[m]
            assert (got.fwd_cost, got.bwd_cost) == (float(m), 1.0)
            assert got.dp_group == groups.get(m)
    bad = Packing(seg_doc=cols[0], seg_start=start, seg_end=start + length, seg_af=start, seg_mb=mb + nmb,
                  rank_mbs=rank_mbs)
    if n:  # a segment in a micro-batch no rank lists: refused, not written past the arrays
        with pytest.raises(ValueError, match="micro-batch"):
            bad.to_step_plan(0)
