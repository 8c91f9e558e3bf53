"""The plan checker refuses each kind of broken plan, written by hand, with a message naming where, and accepts
the correct plan they were broken from."""

from __future__ import annotations

import numpy as np
import pytest

from packloader.balancers.planners.registry import Window
from packloader.balancers.sim.verify import PlanError, verify_plan
from packloader.contracts import MicroBatch, RankPlan, Segment, StepPlan

# doc 0: 10 tokens, one piece; doc 1: 8 tokens cut into independent pieces at 0 and 4; doc 2: 6 tokens
PIECES = Window(np.array([0, 1, 1, 2]), np.array([0, 0, 4, 0]), np.array([10, 4, 4, 6]))


def good() -> StepPlan:
    """Doc 0 sliced 0..5 then 5..10 on rank 0; doc 1's pieces and doc 2 on rank 1."""
    return StepPlan(step=0, ranks=[
        RankPlan(micro_batches=[MicroBatch(segments=[Segment(0, 0, 5, 0)]), MicroBatch(segments=[Segment(0, 5, 10, 0)])]),
        RankPlan(micro_batches=[MicroBatch(segments=[Segment(1, 0, 4, 0), Segment(1, 4, 8, 4)]),
                                MicroBatch(segments=[Segment(2, 0, 6, 0)])]),
    ])


def broken(edit) -> StepPlan:
    p = good()
    edit(p)
    return p


def test_the_correct_plan_passes():
    assert verify_plan(good(), PIECES, 8, dp=2) == {"steps": 1, "tokens": 24, "micro_batches": 4, "slices": 1}


CASES = {
    "uneven counts": (lambda p: p.ranks[1].micro_batches.pop(), {}, "different numbers of micro-batches"),
    "over the cap": (lambda p: None, {"max_tokens": 7}, "rank 1 micro-batch 0 holds 8 tokens, more than max_tokens=7"),
    "wrong dp": (lambda p: None, {"dp": 3}, "has 2 ranks, expected dp=3"),
    "slicing off": (lambda p: None, {"allow_slicing": False}, "rank 0 micro-batch 1: doc 0 tokens 5..9 are a slice"),
    "slice without prefix": (lambda p: setattr(p.ranks[0].micro_batches[1], "segments", [Segment(0, 6, 10, 0)]),
                             {}, "no earlier micro-batch of this rank in this step ends that document at 6"),
    "slice across a piece start": (lambda p: setattr(p.ranks[1].micro_batches[0], "segments",
                                                     [Segment(1, 0, 4, 0)]) or p.ranks[1].micro_batches[1].segments.append(
                                                         Segment(1, 4, 8, 0)),
                                   {}, "across the start 4 of an independent piece"),
    "prefix in the same micro-batch": (lambda p: setattr(p.ranks[0], "micro_batches", [
        MicroBatch(segments=[Segment(0, 0, 5, 0), Segment(0, 5, 10, 0)]), MicroBatch(segments=[])]),
        {}, "and its prefix sit in the same micro-batch"),
    "bad backward order": (lambda p: setattr(p.ranks[0], "backward_order", [0, 0]), {}, "is not a permutation"),
    "bad dp group": (lambda p: setattr(p.ranks[1].micro_batches[1], "dp_group", [0, 2]), {}, "dp_group [0, 2]"),
    "a token twice": (lambda p: p.ranks[1].micro_batches[1].segments.append(Segment(0, 0, 2, 0)), {},
                      "token coverage broken"),
    "a token missing": (lambda p: setattr(p.ranks[1].micro_batches[1], "segments", [Segment(2, 0, 5, 0)]), {},
                        "token coverage broken"),
    "reversed segment": (lambda p: setattr(p.ranks[1].micro_batches[1], "segments", [Segment(2, 6, 0, 0)]), {},
                         "is empty or reversed"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_broken_plan_is_refused(name):
    edit, kw, message = CASES[name]
    args = dict(max_tokens=8, dp=2) | kw
    with pytest.raises(PlanError, match=message.replace("[", r"\[").replace("]", r"\]")):
        verify_plan(broken(edit), PIECES, args.pop("max_tokens"), **args)


def test_steps_must_increase():
    with pytest.raises(PlanError, match="step 0 comes after step 0"):
        verify_plan([good(), good()], None, 8)
