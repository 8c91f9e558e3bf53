"""The fixed BFD baseline honours the planner contract (checked independently of its own bookkeeping)."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from packloader.balancers.factory import make_planner
from packloader.balancers.planners.registry import Window
from packloader.contracts import ParallelConfig, PlanConfig, PlannerState


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 512), min_size=1, max_size=60), st.integers(1, 4))
def test_fixed_covers_every_token_once_and_respects_cap(lengths, dp):
    cfg = PlanConfig(strategy="fixed", parallel=ParallelConfig(dp=dp), max_tokens=512, context=512)
    window = Window.from_lengths(np.array(lengths), first_doc=10)
    plan, state = make_planner(cfg).plan(window, PlannerState(), 0)
    assert state.queued == []
    counts = {len(r.micro_batches) for r in plan.ranks}
    assert len(plan.ranks) == dp and len(counts) == 1
    seen = np.zeros(sum(lengths), dtype=int)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    for r in plan.ranks:
        for mb in r.micro_batches:
            assert sum(s.end - s.start for s in mb.segments) <= 512
            for s in mb.segments:
                assert s.attend_from == s.start
                seen[starts[s.doc - 10] + s.start : starts[s.doc - 10] + s.end] += 1
    assert (seen == 1).all()
