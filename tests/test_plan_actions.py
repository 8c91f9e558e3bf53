"""The action lists `packloader plan` writes (issue 25): hand-worked plain 1F1B schedules, a slice chain's
first-in-last-out backward, and every record of a planned run checked for what a pipeline needs."""

from __future__ import annotations

import json

import numpy as np
import pytest

from packloader.balancers.cost.model import CostModel
from packloader.balancers.sim.actions import step_actions
from packloader.cli.main import main
from packloader.contracts import CostProfile, MicroBatch, ParallelConfig, Poly, RankPlan, Segment, StepPlan

LINEAR = CostModel(CostProfile(name="linear", tile=1, attn_fwd=Poly(), attn_bwd=Poly(), lin_fwd=Poly(0, 1.0, 0), lin_bwd=Poly(0, 2.0, 0)))


def acts(text: str, stage: int) -> list[list]:
    """'F0 F1 B0' -> [["F", 0, stage], ["F", 1, stage], ["B", 0, stage]]."""
    return [[t[0], int(t[1:]), stage] for t in text.split()]


def whole_docs(m: int) -> list[MicroBatch]:
    return [MicroBatch(segments=[Segment(d, 0, 100 + d, 0)]) for d in range(m)]


def test_plain_1f1b_by_hand():
    # pp 2, 4 micro-batches: stage 0 warms up with one forward, stage 1 with none (Megatron's 1F1B)
    plan = StepPlan(step=0, ranks=[RankPlan(micro_batches=whole_docs(4)), RankPlan(micro_batches=whole_docs(4))])
    got = step_actions(plan, LINEAR, ParallelConfig(dp=2, pp=2))
    want = [acts("F0 F1 B0 F2 B1 F3 B2 B3", 0), acts("F0 B0 F1 B1 F2 B2 F3 B3", 1)]
    assert got == [want, want]


def test_fewer_micro_batches_than_stages_by_hand():
    # pp 4, 2 micro-batches: the warm-up (pp - 1 - s forwards) is cut at m
    plan = StepPlan(step=0, ranks=[RankPlan(micro_batches=whole_docs(2))])
    got = step_actions(plan, LINEAR, ParallelConfig(dp=1, pp=4))
    assert got == [[acts("F0 F1 B0 B1", 0), acts("F0 F1 B0 B1", 1), acts("F0 F1 B0 B1", 2), acts("F0 B0 F1 B1", 3)]]


def test_slice_chain_backward_by_hand():
    # micro-batch 1 holds a slice attending to micro-batch 0's keys: its backward runs first (the plan's order
    # 1, 0, 2, 3); stage 1 must run F1 before B1 even though 1F1B would issue B0 first
    mbs = [MicroBatch(segments=[Segment(0, 0, 100, 0)]), MicroBatch(segments=[Segment(0, 100, 200, 0)]),
           MicroBatch(segments=[Segment(1, 0, 50, 0)]), MicroBatch(segments=[Segment(2, 0, 50, 0)])]
    plan = StepPlan(step=0, ranks=[RankPlan(micro_batches=mbs, backward_order=[1, 0, 2, 3])])
    got = step_actions(plan, LINEAR, ParallelConfig(dp=1, pp=2))
    assert got == [[acts("F0 F1 B1 F2 B0 F3 B2 B3", 0), acts("F0 F1 B1 B0 F2 B2 F3 B3", 1)]]


@pytest.mark.parametrize("strategy,pp", [("slimpack", 2), ("auto", 4), ("fixed", 1)])
def test_plan_cli_writes_every_ranks_actions(tmp_path, strategy, pp):
    """Every record: per DP rank and pipeline rank, each micro-batch's forward and backward once on that
    rank's stage, forwards in micro-batch order, backwards in the plan's backward order (default: forward
    order), and no backward before its own forward."""
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(np.log(800), 1.5, 300), 1, 20000).astype(np.int64)
    lengths[7] = 0
    np.save(tmp_path / "l.npy", lengths)
    out = tmp_path / "p.jsonl"
    assert main(["plan", "--lengths", str(tmp_path / "l.npy"), "--dp", "2", "--pp", str(pp), "--max-tokens", "8192",
                 "--context", "8192", "--tokens-per-step", "60000", "--steps", "3", "--strategy", strategy,
                 "--out", str(out), "--quiet"]) == 0
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert recs
    for rec in recs:
        assert len(rec["actions"]) == len(rec["ranks"]) == 2
        orders = rec.get("backward_order") or [None, None]
        for r, (per_stage, mbs) in enumerate(zip(rec["actions"], rec["ranks"])):
            m = len(mbs)
            assert len(per_stage) == pp
            for s, lst in enumerate(per_stage):
                assert all(stage == s for _, _, stage in lst)
                assert [u for op, u, _ in lst if op == "F"] == list(range(m))
                assert [u for op, u, _ in lst if op == "B"] == (orders[r] if orders[r] is not None else list(range(m)))
                pos = {(op, u): k for k, (op, u, _) in enumerate(lst)}
                assert all(pos[("F", u)] < pos[("B", u)] for u in range(m))
