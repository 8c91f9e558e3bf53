"""How cp_mode "auto" and the per-document CP benchmark price a fixed-CP plan (`dynamic_cp_choice.fixed_with_comm`):
every micro-batch pays its CP group's K/V all-gather, a SlimPack DP-Merge micro-batch (one piece run as context
parallelism over a group of DP ranks) that of all its group's GPUs, also at CP 1, as a per-document CP subgroup of
as many GPUs pays; and the work `auto` divides a plan's time by counts a DP-Merge micro-batch once. Hand-worked from the h100 device file's inter-node link (TP 8: every group of 2 or more GPUs
spans nodes) and the K/V bytes of llama3-8b's layers at TP 8."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from packloader.balancers.cost import presets
from packloader.balancers.cost.cp_comm import cp_comm_for
from packloader.balancers.cost.devices import load_device
from packloader.balancers.planners.doc_cp.choice import fixed_with_comm, planned_work
from packloader.balancers.planners.doc_cp.price import DynamicCPCost
from packloader.contracts import MicroBatch, ParallelConfig, PlanConfig, RankPlan, Segment, StepPlan


def allgather(n: int, gpus: int) -> float:
    """One all-gather of n tokens' K/V over `gpus` GPUs across nodes, per layer: gpus - 1 ring steps of latency
    and (gpus - 1) / gpus of the K/V received, by hand."""
    shape = presets.get_shape("llama3-8b")
    link = load_device("h100").cp_link
    kv = 2 * shape.kv_heads * (shape.hidden // shape.heads) * 2 / 8  # K and V, bf16, one TP rank's heads
    return shape.layers * ((gpus - 1) * link.inter_node_latency_us * 1e-6
                               + (gpus - 1) / gpus * n * kv / (link.inter_node_gbps * 1e9))


def plan_of(dp_group_size: int) -> StepPlan:
    """Four ranks: a 20000-token piece as a DP-Merge micro-batch of ranks 0 .. g-1 (listed by each; an empty
    micro-batch on the others), then a plain 1000-token one on every rank; costs 1 s forward and 2 s backward."""
    merged = MicroBatch(segments=[Segment(0, 0, 20000, 0)], dp_group=list(range(dp_group_size)), fwd_cost=1.0,
                        bwd_cost=2.0)
    plain = [MicroBatch(segments=[Segment(1 + r, 0, 1000, 0)], fwd_cost=1.0, bwd_cost=2.0) for r in range(4)]
    ranks = [RankPlan(micro_batches=[merged if r < dp_group_size else MicroBatch(segments=[]), plain[r]])
             for r in range(4)]
    return StepPlan(step=0, ranks=ranks, planner="slimpack")


@pytest.mark.parametrize(("cp", "group"), [(1, 3), (2, 2)])
def test_dynamic_cp_fixed_price_charges_dp_merge_groups_their_gather(cp, group):
    comm = cp_comm_for("llama3-8b", ParallelConfig(dp=4, cp=4, tp=8), device="h100")
    priced = fixed_with_comm(plan_of(group), comm, cp)
    merged = priced.ranks[0].micro_batches[0]
    plain = priced.ranks[0].micro_batches[1]
    assert merged.fwd_cost == pytest.approx(1.0 + allgather(20000, cp * group), rel=1e-9)
    assert merged.bwd_cost == pytest.approx(2.0 + allgather(20000, cp * group), rel=1e-9)
    assert plain.fwd_cost == pytest.approx(1.0 + (allgather(1000, cp) if cp > 1 else 0.0), rel=1e-9)
    assert allgather(20000, cp * group) > 0.005  # not a rounding error: milliseconds a micro-batch


def test_dynamic_cp_fixed_price_leaves_a_cp1_plan_without_dp_merge_as_is():
    comm = cp_comm_for("llama3-8b", ParallelConfig(dp=4, cp=4, tp=8), device="h100")
    plan = plan_of(1)
    plan = StepPlan(step=0, ranks=[RankPlan(micro_batches=[mb for mb in r.micro_batches if not mb.dp_group])
                                   for r in plan.ranks], planner="slimpack")
    assert fixed_with_comm(plan, comm, 1) is plan


def test_dynamic_cp_fixed_price_counts_a_dp_merge_micro_batch_once_in_the_planned_work():
    # the 20000-token piece is listed by ranks 0, 1 and 2 of its DP-Merge group: once in the work, as a plan that
    # lists it on one rank alone has it
    config = PlanConfig(strategy="auto", cp_mode="auto", parallel=ParallelConfig(dp=4, cp=2, tp=8), max_tokens=65536,
                        context=65536)
    cost = DynamicCPCost.for_config(msgspec.structs.replace(config, cp_mode="dynamic"))
    q = np.array([20000, 1000, 1000, 1000, 1000])
    by_hand = float(cost.estimate(q, np.zeros(5, np.int64), np.ones(5, np.int64)).sum())
    assert planned_work(plan_of(3), cost) == pytest.approx(by_hand, rel=1e-12)
    once = plan_of(1)
    assert planned_work(once, cost) == pytest.approx(by_hand, rel=1e-12)


def test_dynamic_cp_fixed_price_adds_only_what_the_models_price_lacks():
    """A plan priced by a cost model that carries its CP 2 group's all-gather (`CostProfile.cp_traffic` 2, what
    `load_cost_model` builds at cp 2): a plain micro-batch gets nothing more, a DP-Merge one of 2 ranks the gather
    over 4 GPUs less the one over 2 it already pays (by hand)."""
    comm = cp_comm_for("llama3-8b", ParallelConfig(dp=4, cp=4, tp=8), device="h100")
    priced = fixed_with_comm(plan_of(2), comm, 2, paid=2)
    merged, plain = priced.ranks[0].micro_batches
    assert merged.fwd_cost == pytest.approx(1.0 + allgather(20000, 4) - allgather(20000, 2), rel=1e-9)
    assert merged.bwd_cost == pytest.approx(2.0 + allgather(20000, 4) - allgather(20000, 2), rel=1e-9)
    assert (plain.fwd_cost, plain.bwd_cost) == (1.0, 2.0)
