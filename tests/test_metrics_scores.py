"""Plan scores against figures worked out by hand, and the independent plan checker."""

import msgspec
import numpy as np
import pytest

from packloader.balancers.cost.model import CostModel, annotate_costs
from packloader.balancers.planners.registry import Window
from packloader.balancers.sim.metrics import PlanScores, RunScores, aggregate, drawn_steps, score_plan, score_plans
from packloader.balancers.sim.verify import PlanError, coverage, verify_plan
from packloader.contracts import (
    CostProfile,
    MicroBatch,
    ParallelConfig,
    PlanConfig,
    PlannerState,
    Poly,
    QueuedDoc,
    RankPlan,
    Segment,
    StepPlan,
)

# forward = 1 per token, backward = 2 per token, no attention, no floor: a micro-batch of n tokens costs 3n
LINEAR = CostModel(CostProfile(name="linear", tile=1, attn_fwd=Poly(), attn_bwd=Poly(), lin_fwd=Poly(0, 1.0, 0), lin_bwd=Poly(0, 2.0, 0)))


def mb(*segs):
    return MicroBatch(segments=[Segment(*s) for s in segs])


def two_rank_plan(step=2):
    # rank 0: docs 0 (4 tokens) and 1 (2 tokens) in two micro-batches; rank 1: docs 2 and 3 (3 tokens each)
    return StepPlan(
        step=step,
        ranks=[
            RankPlan(micro_batches=[mb((0, 0, 4, 0)), mb((1, 0, 2, 0))]),
            RankPlan(micro_batches=[mb((2, 0, 3, 0)), mb((3, 0, 3, 0))]),
        ],
    )


def test_scores_pp1_by_hand():
    s = score_plan(two_rank_plan(), LINEAR, ParallelConfig(dp=2), max_tokens=4)
    assert s.imbalance_ranks == pytest.approx([12 * 2 / 18, 1.0])
    assert s.imbalance == pytest.approx(4 / 3)
    assert s.imbalance_mean == pytest.approx((4 / 3 + 1) / 2)
    assert s.imbalance_global == pytest.approx(12 * 4 / 36)
    assert s.imbalance_fwd == pytest.approx(4 * 2 / 6)
    assert s.rank_times == [18.0, 18.0]
    assert s.dp_spread == 1.0
    assert s.step_time == 18.0 and s.work_bound == 18.0 and s.bound_time == 18.0
    assert s.efficiency == 1.0 and s.bubble_share == pytest.approx(0.0)
    assert s.fill_bound == 18.0 and s.efficiency_fill == 1.0  # PP 1: no fill to credit
    assert s.packing_efficiency == pytest.approx(12 / 16)
    assert s.tokens == 12 and s.tokens_split == 0 and s.micro_batches == 2
    assert not s.delay_known and s.tokens_delayed == 0


def test_scores_pp2_by_hand():
    s = score_plan(two_rank_plan(), LINEAR, ParallelConfig(dp=2, pp=2), max_tokens=4)
    # rank 0: f=[4,2], b=[8,4]: s0 F0[0,4] F1[4,6]; s1 F0[4,8] B0[8,16] F1[16,18] B1[18,22]; s0 B0[16,24] B1[24,28]
    # rank 1: equal micro-batches: (2 + 1) * 9 = 27
    assert s.rank_times == [28.0, 27.0]
    assert s.step_time == 28.0
    assert s.dp_spread == pytest.approx(28 / 27.5)
    # the no-bubble ideal: 36 of work per stage over 2 ranks, every GPU busy all the time
    assert s.bound_time == s.work_bound == pytest.approx(18)
    assert s.efficiency == pytest.approx(18 / 28) == pytest.approx(1 - s.bubble_share)
    # fill-credited: 18 x (m + pp - 1) / m = 18 x 3 / 2
    assert s.fill_bound == pytest.approx(18 * 3 / 2)
    assert s.efficiency_fill == pytest.approx(27 / 28)
    # 2 ranks x 2 stages x 18 busy out of 4 x 28
    assert s.bubble_share == pytest.approx(1 - 72 / 112)


def test_delays_from_a_mapping_and_from_planner_state():
    s = score_plan(two_rank_plan(step=2), LINEAR, ParallelConfig(dp=2), drawn={0: 0, 1: 1, 2: 2})
    # doc 0: 4 tokens 2 steps late; doc 1: 2 tokens 1 step late; docs 2, 3 on time (3 unknown = on time)
    assert s.delay_known
    assert s.tokens_delayed == 6
    assert s.delay_share == pytest.approx(0.5)
    assert s.delay_mean == pytest.approx((4 * 2 + 2 * 1) / 12)
    assert s.delay_max == 2
    st = PlannerState(queued=[QueuedDoc(doc=0, offset=0, length=4, drawn_step=1)])
    s2 = score_plan(two_rank_plan(step=2), LINEAR, ParallelConfig(dp=2), drawn=st)
    assert s2.tokens_delayed == 4 and s2.delay_max == 1
    arr = np.array([0, 2, 2, 2])
    s3 = score_plan(two_rank_plan(step=2), LINEAR, ParallelConfig(dp=2), drawn=arr)
    assert s3.tokens_delayed == 4 and s3.delay_max == 2


def test_split_tokens_count_whole_slice_chains():
    plan = StepPlan(step=0, ranks=[RankPlan(micro_batches=[mb((5, 0, 4, 0), (6, 0, 1, 0)), mb((5, 4, 8, 0))])])
    s = score_plan(plan, LINEAR, ParallelConfig(), max_tokens=8)
    assert s.tokens_split == 8 and s.docs_split == 1 and s.tokens == 9


def test_plan_costs_and_aggregate():
    plans = [two_rank_plan(step=0), two_rank_plan(step=1)]
    for p in plans:
        annotate_costs(p, LINEAR)
    per, run = score_plans(plans, LINEAR, ParallelConfig(dp=2, pp=2), max_tokens=4, use_plan_costs=True,
                           drawn={0: 0, 1: 0, 2: 0, 3: 0},
                           pieces=[(0, 0, 4), (1, 0, 2), (2, 0, 3), (3, 0, 3)])
    assert per[0].step_time == 28.0
    assert run.steps == 2 and run.tokens == 24
    assert run.efficiency == pytest.approx(36 / 56)
    assert run.efficiency_fill == pytest.approx(54 / 56) and run.fill_bound_total == pytest.approx(54)
    assert run.imbalance_max == pytest.approx(4 / 3)
    # step 1 trains everything one step late
    assert run.tokens_delayed == 12 and run.delay_share == pytest.approx(0.5) and run.delay_mean == pytest.approx(0.5)
    # every token appears twice over the run
    assert run.tokens_duplicated == 12 and run.tokens_dropped == 0
    assert isinstance(msgspec.json.decode(msgspec.json.encode(run), type=RunScores), RunScores)
    assert msgspec.json.decode(msgspec.json.encode(per[0]), type=PlanScores) == per[0]
    with pytest.raises(ValueError):
        aggregate([])


def test_drawn_steps_from_windows():
    w0 = Window.from_lengths(np.array([5, 6]), first_doc=0)
    w1 = Window.from_lengths(np.array([7]), first_doc=2)
    assert drawn_steps([w0, w1], first_step=3) == {0: 3, 1: 3, 2: 4}


def test_scores_run_on_a_real_planner_plan():
    from packloader.balancers.factory import make_planner

    cfg = PlanConfig(strategy="fixed", parallel=ParallelConfig(dp=2, pp=2), max_tokens=4096, context=4096)
    lengths = np.random.default_rng(0).integers(64, 4096, size=40)
    w = Window.from_lengths(lengths)
    plan, state = make_planner(cfg).plan(w, PlannerState(), 0)
    verify_plan(plan, w, 4096, final_state=state, dp=2)
    s = score_plan(plan, _tiny(), cfg.parallel, max_tokens=4096)
    assert 1.0 <= s.imbalance and 0 < s.efficiency <= 1.05 and 0 < s.packing_efficiency <= 1


def _tiny():
    from packloader.balancers.cost.resolve import load_cost_model

    return load_cost_model("tiny")


# --------------------------------------------------------------------------------------------- verify_plan

PIECES = [(0, 0, 4), (1, 0, 2), (2, 0, 3), (3, 0, 3)]


def test_verify_accepts_a_good_plan_and_counts():
    out = verify_plan(two_rank_plan(), PIECES, 4, dp=2)
    assert out == {"steps": 1, "tokens": 12, "micro_batches": 4, "slices": 0}


def test_verify_missing_duplicate_extra_tokens():
    p = two_rank_plan()
    p.ranks[1].micro_batches[1] = mb((3, 0, 2, 0))
    with pytest.raises(PlanError, match=r"1 tokens of the drawn pieces appear nowhere.*\(3, 2, 3\)"):
        verify_plan(p, PIECES, 4)
    p = two_rank_plan()
    p.ranks[1].micro_batches[1] = mb((3, 0, 3, 0), (0, 3, 4, 3))
    with pytest.raises(PlanError, match="more than once.*doc 0 tokens 3..3"):
        verify_plan(p, PIECES, 4)
    p = two_rank_plan()
    p.ranks[1].micro_batches[1] = mb((3, 0, 4, 0))
    with pytest.raises(PlanError, match=r"belong to no drawn piece.*\(3, 3, 4\)"):
        verify_plan(p, PIECES, 4)
    cov = coverage(two_rank_plan(), PIECES)
    assert cov.ok and cov.expected_tokens == cov.planned_tokens == 12


def test_verify_delayed_tokens_in_final_state_or_later_step():
    p = two_rank_plan()
    p.ranks[0].micro_batches[0] = mb((1, 0, 2, 0))
    p.ranks[0].micro_batches[1] = MicroBatch(segments=[])
    queued = PlannerState(queued=[QueuedDoc(doc=0, offset=0, length=4, drawn_step=2)])
    verify_plan(p, PIECES, 4, final_state=queued)
    with pytest.raises(PlanError, match="appear nowhere"):
        verify_plan(p, PIECES, 4)
    later = StepPlan(step=3, ranks=[RankPlan(micro_batches=[mb((0, 0, 4, 0))]), RankPlan(micro_batches=[MicroBatch(segments=[])])])
    verify_plan([p, later], PIECES, 4)
    with pytest.raises(PlanError, match="steps must increase"):
        verify_plan([later, p], PIECES, 4)


def test_verify_cap_counts_and_shapes():
    with pytest.raises(PlanError, match="holds 4 tokens, more than max_tokens=3"):
        verify_plan(two_rank_plan(), PIECES, 3)
    p = two_rank_plan()
    p.ranks[1].micro_batches.append(MicroBatch(segments=[]))
    with pytest.raises(PlanError, match=r"different numbers of micro-batches \[2, 3\]"):
        verify_plan(p, PIECES, 4)
    with pytest.raises(PlanError, match="expected dp=4"):
        verify_plan(two_rank_plan(), PIECES, 4, dp=4)
    p = two_rank_plan()
    p.ranks[0].backward_order = [0, 0]
    with pytest.raises(PlanError, match="not a permutation"):
        verify_plan(p, PIECES, 4)
    p = two_rank_plan()
    p.ranks[0].micro_batches[1] = mb((1, 2, 2, 2))
    with pytest.raises(PlanError, match="empty or reversed"):
        verify_plan(p, PIECES, 4)


def sliced_plan():
    # doc 0 (8 tokens) as two slices on rank 0; doc 1 whole on rank 1 with an empty partner micro-batch
    return StepPlan(step=0, ranks=[
        RankPlan(micro_batches=[mb((0, 0, 4, 0)), mb((0, 4, 8, 0))]),
        RankPlan(micro_batches=[mb((1, 0, 4, 0)), MicroBatch(segments=[])]),
    ])


def test_verify_slice_rules():
    pieces = [(0, 0, 8), (1, 0, 4)]
    assert verify_plan(sliced_plan(), pieces, 4)["slices"] == 1
    with pytest.raises(PlanError, match="slicing is not allowed"):
        verify_plan(sliced_plan(), pieces, 4, allow_slicing=False)
    # prefix on another rank
    p = sliced_plan()
    p.ranks[0].micro_batches[0], p.ranks[1].micro_batches[1] = MicroBatch(segments=[]), p.ranks[0].micro_batches[0]
    with pytest.raises(PlanError, match="no earlier micro-batch of this rank"):
        verify_plan(p, pieces, 4)
    # slices out of order
    p = sliced_plan()
    p.ranks[0].micro_batches.reverse()
    with pytest.raises(PlanError, match="no earlier micro-batch"):
        verify_plan(p, pieces, 4)
    # prefix in the same micro-batch
    p = StepPlan(step=0, ranks=[RankPlan(micro_batches=[mb((0, 0, 4, 0), (0, 4, 8, 0))])])
    with pytest.raises(PlanError, match="same micro-batch"):
        verify_plan(p, [(0, 0, 8)], 8)
    # attending across an independent context-window piece: doc 0 cut into pieces 0..4 and 4..8
    with pytest.raises(PlanError, match="across the start 4 of an independent piece"):
        verify_plan(sliced_plan(), [(0, 0, 4), (0, 4, 4), (1, 0, 4)], 4)
    # a chain with a wrong attend_from
    p = StepPlan(step=0, ranks=[RankPlan(micro_batches=[mb((0, 0, 2, 0)), mb((0, 2, 4, 0)), mb((0, 4, 8, 2))])])
    with pytest.raises(PlanError, match="share attend_from"):
        verify_plan(p, [(0, 0, 8)], 4)


def test_verify_dp_merge_group_counts_once_and_caps_per_rank():
    big = MicroBatch(segments=[Segment(9, 0, 8, 0)], dp_group=[0, 1])
    p = StepPlan(step=0, ranks=[RankPlan(micro_batches=[big]), RankPlan(micro_batches=[big])])
    verify_plan(p, [(9, 0, 8)], 4)
    with pytest.raises(PlanError, match="over 2 ranks, more than max_tokens=3"):
        verify_plan(p, [(9, 0, 8)], 3)
    bad = MicroBatch(segments=[Segment(9, 0, 8, 0)], dp_group=[1, 2])
    with pytest.raises(PlanError, match="dp_group"):
        verify_plan(StepPlan(step=0, ranks=[RankPlan(micro_batches=[bad]), RankPlan(micro_batches=[bad])]), [(9, 0, 8)], 4)


def test_fast_and_full_simulation_paths_agree():
    from packloader.balancers.cost.memory import MemoryModel

    rng = np.random.default_rng(3)
    ranks = []
    doc = 0
    for r in range(3):
        mbs = []
        for u in range(6):
            n = int(rng.integers(100, 3000))
            mbs.append(mb((doc, 0, n, 0)))
            doc += 1
        # a slice chain over micro-batches 1..3
        mbs[1] = mb((999 + r, 0, 500, 0))
        mbs[2] = mb((999 + r, 500, 900, 0), (doc, 0, 50, 0))
        mbs[3] = mb((999 + r, 900, 1500, 0))
        doc += 1
        ranks.append(RankPlan(micro_batches=mbs))
    plan = StepPlan(step=0, ranks=ranks)
    par = ParallelConfig(dp=3, pp=3)
    model = _tiny()
    fast = score_plan(plan, model, par)
    full = score_plan(plan, model, par, memory=MemoryModel.for_preset("tiny", par))
    assert fast.rank_times == pytest.approx(full.rank_times)
    assert fast.bubble_share == pytest.approx(full.bubble_share)
    assert full.peak_bytes > 0 and fast.tokens_split == full.tokens_split == 3 * 1500


def test_bubble_share_is_never_below_zero():
    """Micro-batches of 1, 1 and 4 tokens at 0.3 s per token on one GPU: no GPU is ever idle, but the busy time
    summed in another order than the step time rounds 2.2e-16 past it; the share is 0, not -2.2e-16."""
    tenth = CostModel(CostProfile(name="tenth", tile=1, attn_fwd=Poly(), attn_bwd=Poly(), lin_fwd=Poly(0, 0.1, 0),
                                  lin_bwd=Poly(0, 0.2, 0)))
    plan = StepPlan(step=0, ranks=[RankPlan(micro_batches=[mb((0, 0, 1, 0)), mb((1, 0, 1, 0)), mb((2, 0, 4, 0))])])
    s = score_plan(plan, tenth, ParallelConfig(dp=1), max_tokens=8)
    assert s.step_time == pytest.approx(1.8)
    assert s.bubble_share == 0.0
