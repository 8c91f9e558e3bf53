"""Empty micro-batches. Every DP rank runs the same number of micro-batches per step (Megatron's num_microbatches,
DeepSpeed's and the Trainer's gradient accumulation are one number for all ranks), so a rank with fewer pieces
than the fullest one must get empty slots; `auto` no longer makes more than that (`Packing.drop_empty_slots`).
The adapters' handling of the empty slots that remain is tested in the adapters' own test files."""

from __future__ import annotations

import numpy as np
import pytest

from packloader.balancers.offline import plan_run
from packloader.balancers.planners.auto import AutoPlanner
from packloader.balancers.planners.packing import Packing
from packloader.balancers.planners.registry import StepLayout, Window
from packloader.balancers.sim.verify import verify_plan
from packloader.contracts import ParallelConfig, PlanConfig, PlannerState


def packing(rows, filled, groups=None, backward_order=None) -> Packing:
    """A Packing whose micro-batch ids `filled` hold one one-token segment each (document = id)."""
    filled = np.array(sorted(filled), np.int64)
    return Packing(seg_doc=filled, seg_start=np.zeros_like(filled), seg_end=np.ones_like(filled),
                   seg_af=np.zeros_like(filled), seg_mb=filled, rank_mbs=np.array(rows, np.int64),
                   groups=groups or {}, backward_order=backward_order)


def test_drop_empty_slots_hand_worked():
    # rank 0: 0 and 2 filled (empty 1, 3); rank 1: 4 filled (empty 5, 6, 7); rank 2: 8, 9, 10 filled (empty 11).
    # The fullest rank (2) runs 3 filled, so every rank keeps 3 slots, each dropping its last empty one: 3, 7, 11.
    p = packing([[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]], [0, 2, 4, 8, 9, 10],
                backward_order=[[0, 3, 2, 1], None, [2, 1, 0, 3]])
    q = p.drop_empty_slots()
    assert q.rank_mbs.tolist() == [[0, 1, 2], [4, 5, 6], [8, 9, 10]]
    assert q.backward_order == [[0, 2, 1], None, [2, 1, 0]]
    plan = q.costs(AutoPlanner(PlanConfig()).model).to_step_plan(0)
    assert [sum(not mb.segments for mb in r.micro_batches) for r in plan.ranks] == [1, 2, 0]


def test_drop_empty_slots_keeps_dp_merge_positions_and_one_slot():
    # micro-batch 0 is DP-Merged over ranks 0 and 1 at position 0: only position 1 (empty on both) may go
    p = packing([[0, 1, 2], [0, 3, 4]], [0, 2], groups={0: [0, 1]})
    assert p.drop_empty_slots().rank_mbs.tolist() == [[0, 2], [0, 4]]
    # a step with nothing in it keeps one (empty) micro-batch per rank
    assert packing([[0, 1], [2, 3]], []).drop_empty_slots().rank_mbs.tolist() == [[0], [2]]
    # nothing to drop: the same object
    p = packing([[0, 1], [2, 3]], [0, 2, 3])
    assert p.drop_empty_slots() is p


def test_auto_dp3_pp2_four_full_pieces_two_empty():
    """Four pieces of max_tokens tokens on 3 DP ranks, no slicing: a micro-batch holds one piece, some rank runs
    two, so every rank runs two and the other two ranks have one empty micro-batch each: 2 of 6, by hand."""
    cfg = PlanConfig(strategy="auto", parallel=ParallelConfig(dp=3, pp=2), max_tokens=1024, context=1024,
                     tokens_per_step=4096, allow_slicing=False)
    w = Window.from_lengths(np.full(4, 1024))
    plan, state = AutoPlanner(cfg).plan(w, PlannerState(), StepLayout(0, flush=True))
    assert state.queued == []
    counts = [len(r.micro_batches) for r in plan.ranks]
    empty = sum(not mb.segments for r in plan.ranks for mb in r.micro_batches)
    assert counts == [2, 2, 2] and empty == 2


@pytest.mark.parametrize("slicing", [False, True])
def test_auto_dp3_pp2_long_tail_keeps_only_needed_empty_slots(slicing):
    """A long-tail run with few pieces per rank (where the issue saw 70 of 297 micro-batches empty): every step
    is a valid plan, and, counted by brute force over its ranks, holds no empty micro-batch that every rank could
    drop (without DP-Merge: some rank has none; with it: no position empty on every rank)."""
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(5, 1.1, 600).astype(np.int64), 1, 4000)
    cfg = PlanConfig(strategy="auto", parallel=ParallelConfig(dp=3, pp=2), max_tokens=1024, context=1024,
                     tokens_per_step=2048, allow_slicing=slicing)
    run = plan_run(lengths, cfg, steps=40)
    verify_plan(run.plans, run.windows, cfg.max_tokens, allow_slicing=slicing, final_state=run.final_state, dp=3)
    for plan in run.plans:
        empty = np.array([[not mb.segments for mb in r.micro_batches] for r in plan.ranks])
        if any(mb.dp_group for r in plan.ranks for mb in r.micro_batches):
            assert not empty.all(axis=0).any(), plan.step
        else:
            assert empty.sum(axis=1).min() == 0, (plan.step, empty.sum(axis=1))
