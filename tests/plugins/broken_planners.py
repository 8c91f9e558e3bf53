"""Planners registered from outside packloader that break the planner contract, each in one way, as issue 35
found them trained unchecked: the shipped `fixed` planner's plan, edited after it is made. Importing this module
registers them (`packloader plan --plugin plugins.broken_planners`; tests/test_plan_contract.py)."""

from __future__ import annotations

import msgspec

from packloader import register_planner
from packloader.balancers.planners.registry import planner_spec
from packloader.contracts import MicroBatch, RankPlan, Segment


def _mbs(plan):
    return [mb for r in plan.ranks for mb in r.micro_batches]


def drop_piece(plan):
    """The first micro-batch's first segment left out."""
    mb = next(mb for mb in _mbs(plan) if mb.segments)
    mb.segments = mb.segments[1:]
    return plan


def duplicate_piece(plan):
    """The first segment listed a second time, in the last micro-batch."""
    mbs = _mbs(plan)
    first = next(mb for mb in mbs if mb.segments).segments[0]
    mbs[-1].segments = [*mbs[-1].segments, first]
    return plan


def one_micro_batch(plan):
    """Every segment of the step in rank 0's first micro-batch (over the cap), the other slots empty."""
    segs = [s for mb in _mbs(plan) for s in mb.segments]
    m = len(plan.ranks[0].micro_batches)
    ranks = [RankPlan(micro_batches=[MicroBatch(segments=[]) for _ in range(m)]) for _ in plan.ranks]
    ranks[0].micro_batches[0] = MicroBatch(segments=segs)
    return msgspec.structs.replace(plan, ranks=ranks)


def unequal_counts(plan):
    """Rank 0 one empty micro-batch more than the others."""
    plan.ranks[0].micro_batches.append(MicroBatch(segments=[]))
    return plan


def slice_out_of_order(plan):
    """A whole document of 2 or more tokens cut into two slices, the later one in an earlier micro-batch."""
    mbs = [mb for mb in plan.ranks[0].micro_batches]
    k, j = next((k, j) for k, mb in enumerate(mbs) for j, s in enumerate(mb.segments) if s.end - s.start >= 2)
    s = mbs[k].segments[j]
    mid = (s.start + s.end) // 2
    mbs[k].segments[j] = Segment(s.doc, s.start, mid, s.start)
    mbs.insert(0, MicroBatch(segments=[Segment(s.doc, mid, s.end, s.start)]))
    for r in plan.ranks[1:]:
        r.micro_batches.insert(0, MicroBatch(segments=[]))
    plan.ranks[0].micro_batches = mbs
    return plan


BROKEN = {"drop_piece": drop_piece, "duplicate_piece": duplicate_piece, "one_micro_batch": one_micro_batch,
          "unequal_counts": unequal_counts, "slice_out_of_order": slice_out_of_order}


class Edited:
    """The `fixed` planner, its every plan edited by `edit`."""

    def __init__(self, inner, edit) -> None:
        self.inner, self.edit, self.config = inner, edit, inner.config

    def plan(self, window, state, layout):
        plan, after = self.inner.plan(window, state, layout)
        return self.edit(plan), after


def _register(name: str, edit) -> None:
    fixed = planner_spec("fixed")

    @register_planner(f"broken_{name}", options=fixed.options, uses_model=fixed.uses_model, slices=True,
                      report_order=None, summary=f"fixed, then {name} (a test plugin that breaks the contract)")
    def _make(config, options, model):
        return Edited(fixed.factory(config, options, model), edit)


for _name, _edit in BROKEN.items():
    _register(_name, _edit)
