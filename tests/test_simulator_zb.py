"""ZB-H1 in the simulator (issue 25, item 3): the backward split into the input gradient (B) and the weight
gradient (W). Checked against hand-worked schedules, the zero-bubble paper's step time for equal micro-batches,
torch.distributed.pipelining's own zero-bubble rank order, and what the action lists and scores carry."""

from __future__ import annotations

import json

import numpy as np
import pytest

from packloader.balancers.cost.model import CostModel
from packloader.balancers.sim.actions import step_actions
from packloader.balancers.sim.metrics import score_plan
from packloader.balancers.sim.simulator import simulate, simulate_step
from packloader.balancers.sim.weights import weight_times
from packloader.cli.main import main
from packloader.contracts import CostProfile, MicroBatch, ParallelConfig, Poly, RankPlan, Segment, StepPlan


def order(text: str, stage: int = 0) -> list[tuple[str, int, int]]:
    """'F0 B0 W0' -> [("F", 0, stage), ("B", 0, stage), ("W", 0, stage)]."""
    return [(t[0], int(t[1:]), stage) for t in text.split()]


def test_two_stages_by_hand():
    # F = 1, whole backward 2 (input gradient 1 + weight gradient 1). Stage 1 keeps one W back and runs it after
    # its last B, so stage 0's backward of micro-batch 1 starts at 5, not 7:
    #   stage 0: F0 0-1, F1 1-2, B0 3-4, W0 4-5, B1 5-6, W1 6-7
    #   stage 1: F0 1-2, B0 2-3, F1 3-4, B1 4-5, W0 5-6, W1 6-7          step 7 (1F1B: 9)
    r = simulate([1, 1], [2, 2], pp=2, schedule="zb-h1")
    assert r.order(0) == order("F0 F1 B0 W0 B1 W1")
    assert r.order(1) == order("F0 B0 F1 B1 W0 W1")
    start = {0: [(0, 3, 4), (1, 5, 6)], 1: [(1, 2, 5), (3, 4, 6)]}  # stage -> per micro-batch (F, B, W)
    for s, rows in start.items():
        for u, row in enumerate(rows):
            assert tuple(r.start[s, u]) == row, (s, u)
    assert r.step_time == 7.0
    assert simulate([1, 1], [2, 2], pp=2).step_time == 9.0


def test_slice_chain_by_hand():
    # micro-batch 1 holds a slice reading micro-batch 0's keys: backward order 1, 0, 2 on both stages; each
    # micro-batch's W after its own B, and B0 after B1 on a stage (the keys' gradients):
    #   stage 0: F0 0-1, F1 1-2, B1 4-5, W1 5-6, F2 6-7, B0 7-8, W0 8-9, B2 9-10, W2 10-11
    #   stage 1: F0 1-2, F1 2-3, B1 3-4, B0 4-5, W1 5-6, F2 7-8, B2 8-9, W0 9-10, W2 10-11     step 11 (1F1B: 13)
    r = simulate([1, 1, 1], [2, 2, 2], pp=2, schedule="zb-h1", slice_edges=[(0, 1)])
    assert r.order(0) == order("F0 F1 B1 W1 F2 B0 W0 B2 W2")
    assert r.order(1) == order("F0 F1 B1 B0 W1 F2 B2 W0 W2")
    assert [r.start[0, u, 1] for u in range(3)] == [7, 4, 9]
    assert [r.start[1, u, 2] for u in range(3)] == [9, 5, 10]
    assert r.step_time == 11.0
    assert simulate([1, 1, 1], [2, 2, 2], pp=2, slice_edges=[(0, 1)]).step_time == 13.0


@pytest.mark.parametrize("pp,m", [(2, 2), (3, 6), (4, 4), (4, 8), (4, 12)])
def test_equal_micro_batches_leave_the_papers_bubble(pp, m):
    # Qi et al., Zero Bubble Pipeline Parallelism: with T_F = T_B = T_W, ZB-H1 leaves (p - 1)(T_F + T_B - T_W)
    # of bubble against 1F1B's (p - 1)(T_F + T_B + T_W)
    one = np.ones(m)
    assert simulate(one, 2 * one, pp=pp, schedule="zb-h1").step_time == 3 * m + (pp - 1)
    assert simulate(one, 2 * one, pp=pp).step_time == 3 * m + 3 * (pp - 1)


@pytest.mark.parametrize("pp", [2, 3, 4])
def test_order_is_torchs_zero_bubble_rank_order(pp):
    """torch.distributed.pipelining's zero-bubble rank ops at one stage per rank (rank s keeps s Ws back)."""
    from torch.distributed.pipelining.schedules import _get_1f1b_rank_ops, _get_warmup_ops

    for m in range(1, 10):
        r = simulate(np.ones(m), 2 * np.ones(m), pp=pp, schedule="zb-h1")
        for s in range(pp):
            warm = _get_warmup_ops(s, 1, m, pp, m, multiply_factor=1)
            ops = _get_1f1b_rank_ops(1, pp, warm, m - warm, warm, s, lambda _, s=s: s, lambda _, s=s: s, s, True)
            want = [("B" if a.computation_type.value == "I" else a.computation_type.value, a.microbatch_index)
                    for a in ops if a is not None]
            assert [(op, u) for op, u, _ in r.order(s)] == want, (m, s)


def test_activations_and_key_gradients_live_until_w():
    # stage 1, micro-batches of 10 bytes: 1F1B frees each at its backward (peak 10); ZB-H1 holds both until
    # the two Ws at the end (peak 20). A slice edge's 5 bytes of key/value gradients: from B1 to W0.
    act = np.array([10.0, 10.0])
    assert simulate([1, 1], [2, 2], pp=2, act_bytes=act).peak_bytes[1] == 10
    r = simulate([1, 1], [2, 2], pp=2, schedule="zb-h1", act_bytes=act)
    assert r.peak_bytes[1] == 20
    assert list(r.mem_bytes[1, 1::2]) == [10, 10, 20, 20, 10, 0]  # after F0 B0 F1 B1 W0 W1
    k = simulate([1, 1], [2, 2], pp=2, schedule="zb-h1", slice_edges=[(0, 1)], kv_bytes=[5.0])
    # stage 1 runs F0 F1 B1 B0 W1 W0 (W0 is last: stage 1 keeps one W back)
    assert k.order(1) == order("F0 F1 B1 B0 W1 W0")
    assert list(k.mem_bytes[1, 1::2]) == [0, 0, 5, 5, 5, 0]


LIN = CostModel(CostProfile(name="lin", tile=1, attn_fwd=Poly(), attn_bwd=Poly(0, 0.5, 0), lin_fwd=Poly(0, 1.0, 0),
                            lin_bwd=Poly(0, 2.0, 0)))


def test_weight_gradient_is_half_the_linear_backward():
    # attention has no weights: the 0.5/token attention backward stays in B; a DP-Merge member's half share
    mbs = [MicroBatch(segments=[Segment(0, 0, 10, 0)]), MicroBatch(segments=[Segment(1, 0, 8, 0)], dp_group=[0, 1])]
    assert weight_times(mbs, [LIN]).tolist() == [[10.0, 4.0]]


def test_action_lists_carry_w_and_scores_use_the_split():
    mbs = [MicroBatch(segments=[Segment(d, 0, 10 + d, 0)]) for d in range(4)]
    plan = StepPlan(step=0, ranks=[RankPlan(micro_batches=mbs)])
    par = ParallelConfig(pp=2)
    acts = step_actions(plan, LIN, par, schedule="zb-h1")[0]
    assert [a[0] for a in acts[1][:4]] == ["F", "B", "F", "B"]
    for s, lst in enumerate(acts):
        assert sorted((op, u) for op, u, _ in lst) == sorted((op, u) for op in "FBW" for u in range(4))
        pos = {(op, u): k for k, (op, u, _) in enumerate(lst)}
        assert all(pos[("F", u)] < pos[("B", u)] < pos[("W", u)] for u in range(4))
    # the fast scoring path gives the full simulation's step time, with W = half the linear backward
    sim = simulate_step(plan, LIN, par, schedule="zb-h1")
    assert score_plan(plan, LIN, par, schedule="zb-h1").step_time == pytest.approx(sim.step_time)
    f = [LIN.microbatch_times(mb)[0] for mb in mbs]
    b = [LIN.microbatch_times(mb)[1] for mb in mbs]
    w = [2.0 * mb.num_tokens / 2 for mb in mbs]
    assert sim.step_time == pytest.approx(simulate(f, b, pp=2, schedule="zb-h1", wgt=w).step_time)
    assert sim.step_time < simulate_step(plan, LIN, par).step_time


@pytest.mark.parametrize("schedule", ["zb-h1", "auto"])
def test_plan_cli_writes_w_actions(tmp_path, schedule):
    lengths = np.random.default_rng(0).integers(50, 3000, 200)
    np.save(tmp_path / "l.npy", lengths)
    out = tmp_path / "p.jsonl"
    assert main(["plan", "--lengths", str(tmp_path / "l.npy"), "--dp", "2", "--pp", "2", "--max-tokens", "4096",
                 "--context", "4096", "--tokens-per-step", "40000", "--steps", "2", "--schedule", schedule,
                 "--out", str(out), "--quiet"]) == 0
    for line in out.read_text().splitlines():
        rec = json.loads(line)
        assert ("schedule" in rec) == (schedule == "auto")  # the planner's choice, written only under "auto"
        ops = "FBW" if rec.get("schedule", schedule) == "zb-h1" else "FB"
        for r, per_stage in enumerate(rec["actions"]):
            m = len(rec["ranks"][r])
            for s, lst in enumerate(per_stage):
                assert sorted((op, u) for op, u, _ in lst) == sorted((op, u) for op in ops for u in range(m))


def test_one_chunk_schedules_refuse_vpp():
    with pytest.raises(ValueError, match="needs schedule 'interleaved', 'zb-h1' .* or 'zb-v'"):
        simulate(np.ones(4), np.ones(4), pp=2, vpp=2, schedule="1f1b")


def test_pipeline_schedule_runs_zb_h1_as_input_and_weight_actions():
    from torch.distributed.pipelining.schedules import BACKWARD_INPUT, BACKWARD_WEIGHT

    from packloader.runtime.pipeline import simulated_actions

    acts = simulated_actions([MicroBatch(segments=[Segment(d, 0, 4, 0)]) for d in range(3)], 2, schedule="zb-h1")
    sim = simulate(np.ones(3), 2 * np.ones(3), pp=2, schedule="zb-h1")
    names = {BACKWARD_INPUT: "B", BACKWARD_WEIGHT: "W"}
    for s in range(2):
        assert [(names.get(a.computation_type, "F"), a.microbatch_index, a.stage_index // 2) for a in acts[s]] == sim.order(s)
