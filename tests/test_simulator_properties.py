"""Simulator invariants on random schedules (hypothesis)."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from packloader.balancers.sim.simulator import simulate

times = st.lists(st.floats(0.01, 10.0), min_size=1, max_size=16)


@settings(max_examples=150, deadline=None)
@given(times, st.integers(1, 6), st.sampled_from(["1f1b", "gpipe"]), st.floats(1.0, 3.0), st.data())
def test_step_time_bounds_and_monotonicity(f, pp, schedule, ratio, data):
    f = np.array(f)
    b = ratio * f
    m = len(f)
    edges = [(u, u + 1) for u in range(m - 1) if data.draw(st.booleans())]
    r = simulate(f, b, pp=pp, schedule=schedule, slice_edges=edges)
    work = f.sum() + b.sum()
    # each stage does all the work; each micro-batch crosses every stage twice; nothing beats serial
    assert r.step_time >= work - 1e-9
    assert r.step_time >= pp * (f + b).max() - 1e-9
    assert r.step_time <= pp * work + 1e-9
    assert np.allclose(r.busy, work)
    # tasks never overlap on a rank, and every dependency holds
    for s in range(pp):
        spans = sorted(zip(r.start[s].ravel(), r.finish[s].ravel()))
        assert all(a1 >= b0 - 1e-9 for (_, b0), (a1, _) in zip(spans, spans[1:]))
        for u in range(m):
            if s > 0:
                assert r.start[s, u, 0] >= r.finish[s - 1, u, 0] - 1e-9
                assert r.finish[s - 1, u, 1] - 1e-9 <= r.step_time
                assert r.start[s - 1, u, 1] >= r.finish[s, u, 1] - 1e-9
            assert r.start[s, u, 1] >= r.finish[s, u, 0] - 1e-9
        for a, c in edges:
            assert r.start[s, c, 0] >= r.finish[s, a, 0] - 1e-9
            assert r.start[s, a, 1] >= r.finish[s, c, 1] - 1e-9
    # making one task longer never makes the step shorter
    k = data.draw(st.integers(0, m - 1))
    f2 = f.copy()
    f2[k] += 1.0
    assert simulate(f2, b, pp=pp, schedule=schedule, slice_edges=edges).step_time >= r.step_time - 1e-9
