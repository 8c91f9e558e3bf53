"""The pipeline simulator against schedules worked out by hand."""

import numpy as np
import pytest

from packloader.balancers.cost.memory import MemoryModel
from packloader.balancers.cost.model import CostModel
from packloader.balancers.sim.kernels import step_times_ranks
from packloader.balancers.sim.simulator import (
    default_backward_order,
    gpipe_formula,
    simulate,
    simulate_rank,
    simulate_step,
    slice_edges_of,
    step_time,
)
from packloader.contracts import CostProfile, MicroBatch, ParallelConfig, Poly, RankPlan, Segment, StepPlan


def test_1f1b_pp2_three_unequal_micro_batches_by_hand():
    # f = [1, 2, 1], b = [2, 3, 2] on both stages.
    # stage 0 runs F0 F1 B0 F2 B1 B2, stage 1 runs F0 B0 F1 B1 F2 B2:
    #   s0 F0 [0,1]  F1 [1,3]
    #   s1 F0 [1,2]  B0 [2,4]  F1 [4,6]  B1 [6,9]
    #   s0 B0 [4,6]  F2 [6,7]
    #   s1 F2 [9,10] B2 [10,12]
    #   s0 B1 [9,12] B2 [12,14]
    r = simulate([1, 2, 1], [2, 3, 2], pp=2)
    assert r.order(0) == [("F", 0, 0), ("F", 1, 0), ("B", 0, 0), ("F", 2, 0), ("B", 1, 0), ("B", 2, 0)]
    assert r.order(1) == [("F", 0, 0), ("B", 0, 0), ("F", 1, 0), ("B", 1, 0), ("F", 2, 0), ("B", 2, 0)]
    expect_start = {
        (0, 0, 0): 0, (0, 1, 0): 1, (1, 0, 0): 1, (1, 0, 1): 2, (1, 1, 0): 4, (1, 1, 1): 6,
        (0, 0, 1): 4, (0, 2, 0): 6, (1, 2, 0): 9, (1, 2, 1): 10, (0, 1, 1): 9, (0, 2, 1): 12,
    }
    for (s, u, isb), t in expect_start.items():
        assert r.start[s, u, isb] == t, (s, u, isb)
    assert r.step_time == 14
    assert np.allclose(r.busy, [11, 11])
    assert np.allclose(r.bubble, [3, 3])
    assert r.bubble_share == pytest.approx(6 / 28)


@pytest.mark.parametrize("m,pp", [(1, 1), (4, 1), (3, 2), (8, 4), (4, 4), (2, 4), (16, 8)])
def test_equal_micro_batches_match_the_formula(m, pp):
    f, b = 1.5, 3.25
    for schedule in ("1f1b", "gpipe"):
        r = simulate([f] * m, [b] * m, pp=pp, schedule=schedule)
        assert r.step_time == pytest.approx(gpipe_formula(m, pp, f, b)), schedule
        assert step_time(np.full(m, f), np.full(m, b), pp, schedule=schedule) == pytest.approx(r.step_time)


def test_interleaved_shrinks_the_bubble_by_vpp():
    # Megatron: (m + (pp - 1) / vpp) * (f + b) for m a multiple of pp and equal micro-batches
    for pp, vpp, m in [(2, 2, 8), (4, 2, 8), (4, 4, 16)]:
        r = simulate([1.0] * m, [2.0] * m, pp=pp, schedule="interleaved", vpp=vpp)
        assert r.step_time == pytest.approx((m + (pp - 1) / vpp) * 3.0)
        assert len(r.order(0)) == 2 * m * vpp


def test_imbalanced_pair_by_hand_and_versus_balanced():
    # f = [1, 3], b = [2, 6], pp = 2:
    #   s0 F0 [0,1] F1 [1,4]; s1 F0 [1,2] B0 [2,4] F1 [4,7] B1 [7,13]; s0 B0 [4,6] B1 [13,19]
    r = simulate([1, 3], [2, 6], pp=2)
    assert r.step_time == 19
    # the same work split evenly: (2 + 1) * (2 + 4) = 18
    assert simulate([2, 2], [4, 4], pp=2).step_time == 18


def test_per_stage_times():
    # stage 1 twice as slow on forward: GPipe, m=2: s0 F0 [0,1] F1 [1,2]; s1 F0 [1,3] F1 [3,5];
    # s1 B0 [5,6] B1 [6,7]; s0 B0 [6,7] B1 [7,8]
    fwd = np.array([[1.0, 1.0], [2.0, 2.0]])
    bwd = np.ones((2, 2))
    r = simulate(fwd, bwd, pp=2, schedule="gpipe")
    assert r.step_time == 8
    assert r.start[1, 1, 1] == 6 and r.start[0, 1, 1] == 7


def test_slices_run_forward_in_order_and_backward_last_slice_first():
    # micro-batches 0 and 1 hold two slices of one document; f = 1, b = 2 everywhere, pp = 2.
    # backward order [1, 0, 2]. Before its k-th backward a stage has run warm + k + 1 forwards (warm = pp-s-1),
    # or more when the backward's own forward comes later (injected forward).
    # stage 0: F0 F1 B1 F2 B0 B2; stage 1 (injects F1 before B1): F0 F1 B1 B0 F2 B2.
    #   s0 F0 [0,1] F1 [1,2]; s1 F0 [1,2] F1 [2,3] B1 [3,5] B0 [5,7]; s0 B1 [5,7] F2 [7,8] B0 [8,10]
    #   s1 F2 [8,9] B2 [9,11]; s0 B2 [11,13]
    edges = [(0, 1)]
    assert default_backward_order(3, np.array(edges)).tolist() == [1, 0, 2]
    r = simulate([1, 1, 1], [2, 2, 2], pp=2, slice_edges=edges)
    assert r.order(0) == [("F", 0, 0), ("F", 1, 0), ("B", 1, 0), ("F", 2, 0), ("B", 0, 0), ("B", 2, 0)]
    assert r.order(1) == [("F", 0, 0), ("F", 1, 0), ("B", 1, 0), ("B", 0, 0), ("F", 2, 0), ("B", 2, 0)]
    assert r.start[0, 0, 1] == 8 and r.start[1, 0, 1] == 5 and r.start[1, 2, 0] == 8
    assert r.step_time == 13
    # every backward of an earlier slice starts after the later slice's backward on the same stage
    for s in range(2):
        assert r.start[s, 0, 1] >= r.finish[s, 1, 1]
        assert r.start[s, 1, 0] >= r.finish[s, 0, 0]
    with pytest.raises(ValueError, match="key/value gradients"):
        simulate([1, 1, 1], [2, 2, 2], pp=2, slice_edges=edges, backward_order=[0, 1, 2])
    with pytest.raises(ValueError, match="earlier micro-batch"):
        simulate([1, 1, 1], [2, 2, 2], pp=2, slice_edges=[(1, 0)])


def test_chained_slices_default_order():
    # doc A in 0,1,2 (edges 0->1->2); doc B in 2,3 (edge 2->3); micro-batch 4 alone
    order = default_backward_order(5, np.array([(0, 1), (1, 2), (2, 3)]))
    assert order.tolist() == [3, 2, 1, 0, 4]


def test_memory_timeline_by_hand():
    act = np.array([10.0, 20.0, 30.0])
    r = simulate([1, 1, 1], [2, 2, 2], pp=2, act_bytes=act, static_bytes=[100.0, 50.0])
    # stage 0: F0 +10, F1 +20, B0 -10, F2 +30 -> 50 at its peak; stage 1 holds one at a time -> 30
    assert r.peak_bytes.tolist() == [150.0, 80.0]
    assert r.mem_bytes[0, -1] == 100.0  # all freed by the end
    assert list(r.mem_bytes[0, :8]) == [110, 110, 130, 130, 130, 120, 150, 150]
    g = simulate([1, 1, 1], [2, 2, 2], pp=2, schedule="gpipe", act_bytes=act)
    assert g.peak_bytes.tolist() == [60.0, 60.0]
    # key/value gradients of a slice edge live from the later slice's backward to the earlier one's end:
    # stage 1 runs F0 (10) F1 (30) B1 (+5 kv: 35, then -20: 15) B0 (-10 -5: 0) F2 (30) B2 (0)
    k = simulate([1, 1, 1], [2, 2, 2], pp=2, slice_edges=[(0, 1)], act_bytes=act, kv_bytes=[5.0])
    assert k.peak_bytes[1] == 35.0
    assert list(k.mem_bytes[1, :8]) == [10, 10, 30, 30, 35, 15, 15, 0]
    assert k.mem_bytes[1, -1] == 0.0


def test_batched_ranks_match_single_simulations():
    rng = np.random.default_rng(0)
    f = rng.random(8 * 12)
    b = 2.2 * f
    off = np.arange(0, 8 * 12 + 1, 12)
    got = step_times_ranks(4, 1, 0, f, b, 0.5 * b, off, 0.0)
    for r in range(8):
        assert got[r] == pytest.approx(simulate(f[off[r]:off[r + 1]], b[off[r]:off[r + 1]], pp=4).step_time)


def test_p2p_latency_adds_to_each_hop():
    # pp=3, one micro-batch: 3 forward hops and 3 backward hops with 2 stage boundaries each way
    r = simulate([1.0], [2.0], pp=3, p2p=0.5)
    assert r.step_time == pytest.approx(3 * 3 + 4 * 0.5)


PROF = CostModel(CostProfile(name="unit", tile=1, attn_fwd=Poly(0, 0, 0), attn_bwd=Poly(0, 0, 0),
                             lin_fwd=Poly(0, 1.0, 0), lin_bwd=Poly(0, 2.0, 0)))


def test_simulate_rank_from_a_plan_with_slices_and_memory():
    # doc 7 (12 tokens) sliced 0..6 | 6..12 over micro-batches 0 and 1; micro-batch 2 holds doc 8.
    mbs = [
        MicroBatch(segments=[Segment(7, 0, 6, 0)]),
        MicroBatch(segments=[Segment(7, 6, 12, 0)]),
        MicroBatch(segments=[Segment(8, 0, 6, 0)]),
    ]
    edges, prefix = slice_edges_of(mbs)
    assert edges.tolist() == [[0, 1]] and prefix.tolist() == [6]
    r = simulate_rank(RankPlan(micro_batches=mbs), PROF, ParallelConfig(pp=2))
    assert r.step_time == 13 * 6  # the slices case above, every time x6 tokens
    mm = MemoryModel.for_preset("tiny", ParallelConfig(pp=2))
    rm = simulate_rank(RankPlan(micro_batches=mbs), PROF, ParallelConfig(pp=2), memory=mm)
    assert rm.step_time == r.step_time
    assert rm.peak_bytes[0] > mm.static_bytes(0) + 6 * mm.activation_bytes_per_token(0)


def test_simulate_step_takes_the_slowest_rank():
    fast = RankPlan(micro_batches=[MicroBatch(segments=[Segment(0, 0, 4, 0)]), MicroBatch(segments=[Segment(1, 0, 4, 0)])])
    slow = RankPlan(micro_batches=[MicroBatch(segments=[Segment(2, 0, 8, 0)]), MicroBatch(segments=[Segment(3, 0, 4, 0)])])
    sim = simulate_step(StepPlan(step=0, ranks=[fast, slow]), PROF, ParallelConfig(pp=2, dp=2))
    # pp=2 GPipe-like fill: fast: (2+1) * 12 = 36; slow: s0 F0 [0,8] F1 [8,12]; s1 F0 [8,16] B0 [16,32]
    # F1 [32,36] B1 [36,44]; s0 B0 [32,48] B1 [48,56]
    assert sim.rank_times.tolist() == [36.0, 56.0]
    assert sim.step_time == 56.0
    assert sim.dp_spread == pytest.approx(56 / 46)


def test_deadlock_free_on_random_slice_layouts():
    rng = np.random.default_rng(1)
    for _ in range(200):
        m = int(rng.integers(1, 12))
        pp = int(rng.integers(1, 5))
        edges = [(u, u + 1) for u in range(m - 1) if rng.random() < 0.4]
        f = rng.random(m) + 0.1
        r = simulate(f, 2 * f, pp=pp, slice_edges=edges)
        lower = (f.sum() * 3)
        assert r.step_time >= lower - 1e-9


def test_batched_sliced_fast_path_matches_simulate():
    from packloader.balancers.sim.kernels import step_times_ranks_sliced

    rng = np.random.default_rng(2)
    for pp, vpp, kind, sched in [(1, 1, 0, "1f1b"), (4, 1, 0, "1f1b"), (3, 1, 1, "gpipe"), (2, 2, 2, "interleaved"),
                                  (4, 1, 3, "zb-h1")]:
        R, m = 6, 8
        f = rng.random(R * m) + 0.05
        b = 2.5 * f
        off = np.arange(0, R * m + 1, m)
        e_src, e_dst, e_off = [], [], [0]
        per_rank = []
        for r in range(R):
            edges = [(u, u + 1) for u in range(m - 1) if rng.random() < 0.35]
            per_rank.append(edges)
            e_src += [a for a, _ in edges]
            e_dst += [c for _, c in edges]
            e_off.append(len(e_src))
        got = step_times_ranks_sliced(pp, vpp, kind, f, b, 0.5 * b, off, np.array(e_off), np.array(e_src, dtype=np.int64),
                                      np.array(e_dst, dtype=np.int64), 0.0)
        for r in range(R):
            ref = simulate(f[off[r]:off[r + 1]], b[off[r]:off[r + 1]], pp=pp, vpp=vpp, schedule=sched,
                           slice_edges=per_rank[r] or None)
            assert got[r] == pytest.approx(ref.step_time)
            o = default_backward_order(m, np.array(per_rank[r]).reshape(-1, 2))
            from packloader.balancers.sim.kernels import backward_order_kernel

            e = np.array(per_rank[r], dtype=np.int64).reshape(-1, 2)
            assert backward_order_kernel(m, e[:, 0].copy(), e[:, 1].copy()).tolist() == o.tolist()


def test_per_stage_models_put_the_head_on_the_last_stage():
    from packloader.balancers.cost.presets import analytic_stage_profiles, get_shape, stage_layers

    assert stage_layers(get_shape("llama3-8b"), 5) == [7, 7, 6, 6, 6]
    par = ParallelConfig(pp=4)
    stages = [CostModel(p) for p in analytic_stage_profiles(get_shape("llama3-8b"), par)]
    assert stages[3].coeffs[8] > stages[0].coeffs[8] == stages[1].coeffs[8]
    mbs = [MicroBatch(segments=[Segment(i, 0, 2048, 0)]) for i in range(6)]
    r = simulate_rank(RankPlan(micro_batches=mbs), None, par, stage_models=stages)
    # the last stage is the bottleneck: its busy time is the largest
    assert r.busy.argmax() == 3
    assert r.step_time > simulate_rank(RankPlan(micro_batches=mbs), stages[0], par).step_time


def test_interleaved_runs_every_multiple_of_pp_and_explains_the_rest():
    for pp in range(1, 6):
        for vpp in (2, 3):
            for m in range(pp, 4 * pp + 1, pp):
                r = simulate(np.ones(m), 2 * np.ones(m), pp=pp, vpp=vpp, schedule="interleaved")
                assert r.step_time == pytest.approx((m + (pp - 1) / vpp) * 3)
    with pytest.raises(RuntimeError, match="multiple of pp"):
        simulate(np.ones(7), 2 * np.ones(7), pp=5, vpp=2, schedule="interleaved")


def test_a_long_slice_chain_costs_about_one_extra_fill():
    # 16 equal micro-batches, the first 9 one document's slices: the backward wave of the chain runs back
    # to back; the cost over the unsliced schedule stays within one pipeline fill and drain
    pp, m, f, b = 4, 16, 1.0, 2.0
    plain = simulate([f] * m, [b] * m, pp=pp).step_time
    chained = simulate([f] * m, [b] * m, pp=pp, slice_edges=[(u, u + 1) for u in range(8)]).step_time
    assert plain == gpipe_formula(m, pp, f, b)
    assert plain <= chained <= plain + (pp - 1) * (f + b)
