"""The report's grouping advice pays its CP traffic: every micro-batch of a merged group (cp x g GPUs running it as
context parallelism) pays the K/V all-gather of that CP group before the grouping is compared with the
homogeneous layout, and a grouping whose traffic eats its gain is not advised."""

from __future__ import annotations

import numpy as np
import pytest

from packloader.balancers.cost.cp_comm import CPComm, cp_comm_for
from packloader.balancers.cost.devices import CPLink
from packloader.balancers.cost.resolve import load_cost_model
from packloader.balancers.sim.metrics import score_plans
from packloader.contracts import MicroBatch, ParallelConfig, PlanConfig, RankPlan, Segment, StepPlan
from packloader.report.advice import (
    advise_grouping,
    grouping_candidates,
    merged_model,
    traffic_note,
    with_group_traffic,
)
from packloader.report.draw import draw_steps
from packloader.report.run import run_strategy


def test_a_merged_micro_batch_pays_the_all_gather_of_its_cp_group():
    """Hand-worked: llama3-8b at pp=2, tp=2 on an H100 board, cp=1 and a group of g=2 ranks: a 10,000-token
    micro-batch on the merged rank pays, forward and backward each, 16 layers x 1 ring step x 8 us of latency plus
    (1/2) x 10,000 tokens x 32,768 bytes (K and V, 1,024 wide, bf16, half per TP GPU, 16 layers) at 360 GB/s;
    the plain rank's micro-batch pays nothing."""
    par = ParallelConfig(dp=3, pp=2, tp=2)
    model = load_cost_model("llama3-8b", par)
    big = merged_model(model, 2)
    comm = cp_comm_for("llama3-8b", par, device="h100")
    by_hand = 16 * 8e-6 + 0.5 * 10_000 * (2 * 1024 * 2 / 2 * 16) / 360e9
    assert comm.times(10_000, 2) == pytest.approx((by_hand, by_hand), rel=1e-12)
    merged = MicroBatch(segments=[Segment(0, 0, 6_000, 0), Segment(1, 0, 4_000, 0)])
    plain = MicroBatch(segments=[Segment(2, 0, 3_000, 0)])
    plan = StepPlan(step=0, ranks=[RankPlan(micro_batches=[merged]), RankPlan(micro_batches=[plain])])
    out = with_group_traffic(plan, [big, model], 1, comm, 1 * 2)
    f0, b0 = big.microbatch_times(merged)
    assert out.ranks[0].micro_batches[0].fwd_cost == pytest.approx(f0 + by_hand, rel=1e-12)
    assert out.ranks[0].micro_batches[0].bwd_cost == pytest.approx(b0 + by_hand, rel=1e-12)
    f1, b1 = model.microbatch_times(plain)
    assert (out.ranks[1].micro_batches[0].fwd_cost, out.ranks[1].micro_batches[0].bwd_cost) == (f1, b1)
    assert plan.ranks[0].micro_batches[0].fwd_cost == 0.0  # the plan itself is left as it was


@pytest.fixture(scope="module")
def long_tail():
    cap = 32768
    cfg = PlanConfig(strategy="hydraulis", parallel=ParallelConfig(dp=4, pp=2, tp=2), max_tokens=cap, context=cap,
                     model="llama3-8b", tokens_per_step=4 * 3 * cap)
    rng = np.random.default_rng(0)
    lengths = np.minimum((rng.pareto(1.1, 3000) + 1) * 300, cap).astype(np.int64)
    draw = draw_steps(lengths, cfg.tokens_per_step, cfg.context, 2)
    model = load_cost_model("llama3-8b", cfg.parallel)
    homo = run_strategy("hydraulis", cfg, draw, warmup=False)
    _, agg = score_plans(homo.plans, model, cfg.parallel, max_tokens=cap, schedule=cfg.schedule, drawn=draw.doc_step)
    return cfg, draw, model, agg.step_time_total


def _link(comm: CPComm, **kw) -> CPComm:
    return CPComm(comm.kv_bytes_per_token, comm.layers, comm.tp, CPLink(**kw), comm.exchange)


def test_a_grouping_whose_traffic_exceeds_its_gain_is_not_advised(long_tail):
    """One group of 2 ranks (CP=2, 64K cap) beside 2 plain ranks: with a free link (ideal CP) it beats the
    homogeneous hydraulis layout and is advised; over a 2 GB/s link its all-gathers cost more than it gains and
    it is not, with a note saying no grouping is faster; the H100 board's link lies between."""
    cfg, draw, model, homo = long_tail
    real = cp_comm_for("llama3-8b", cfg.parallel, device="h100")
    gains = {}
    for name, comm in [("free", _link(real, intra_node_gbps=1e9, intra_node_latency_us=0.0)), ("h100", real),
                       ("slow", _link(real, intra_node_gbps=2.0))]:
        (cand,) = grouping_candidates(cfg, draw, model, None, homo, max_candidates=1, comm=comm)
        assert cand.groups[0].cp == 2 and len(cand.groups) == 2 and cand.step_time_total > 0
        gains[name] = cand.gain_vs_homogeneous
        pick, notes = advise_grouping([cand], homo)
        if name == "slow":
            assert pick is None and notes == ["no grouping simulates faster than the homogeneous layout once its CP "
                                              "traffic is priced"]
        else:
            assert pick is cand and notes == []
    assert gains["free"] >= gains["h100"] > gains["slow"]  # (the merged rank may have slack for the h100's traffic)
    assert gains["free"] > 1.0 > gains["slow"]


def test_the_note_says_what_prices_the_traffic():
    cfg = PlanConfig(parallel=ParallelConfig(dp=4), model="llama3-8b")
    assert "cp_link" in traffic_note(cfg) and "packloader calibrate --cp" in traffic_note(cfg)
    assert "(llama3-8b's K/V)" in traffic_note(cfg)
    assert "(llama3-8b's K/V: profile.json carries no model shape)" in traffic_note(
        PlanConfig(parallel=ParallelConfig(dp=4), model="profile.json"))
