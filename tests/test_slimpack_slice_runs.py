"""SlimPack keeps the slices of all sliced pieces of a rank in one run of linked packs from pack 0.

Why it matters: a run of packs linked by slices goes backward first-in-last-out, so the run's first backward
waits for its last forward to cross every pipeline stage. A run starting at pack 0 overlaps the pipeline
warm-up; a second run starting mid-step costs one more pipeline drain (seen as ranks ~8 % slower at twice the
micro-batches, and `auto` then preferring a less even wlb plan). Checked on the plan's segments with an
independent reading of which packs each sliced piece spans; the simulated cost of that one run is bounded by
one pipeline drain over the same packs without slice links."""

from __future__ import annotations

import numpy as np
import pytest

from packloader.balancers.planners.base import StepLayout
from packloader.balancers.planners.packing import Pieces
from packloader.balancers.planners.registry import Window
from packloader.balancers.planners.slimpack import SlimPackPlanner
from packloader.balancers.sim.simulator import simulate, slice_edges_of
from packloader.contracts import ParallelConfig, PlanConfig, PlannerState


def long_tail_window(seed: int, tokens: int, cap: int) -> Window:
    rng = np.random.default_rng(seed)
    out, have = [], 0
    while have < tokens:
        l = int(np.clip(rng.lognormal(np.log(1500), 1.5), 16, 4 * cap))
        if rng.random() < 0.02:
            l = int(rng.integers(cap // 2, 4 * cap))
        out.append(l)
        have += l
    docs, offs, lens = [], [], []
    for d, l in enumerate(out):  # pieces of at most `cap` tokens, as the loader cuts them
        for o in range(0, l, cap):
            docs.append(d)
            offs.append(o)
            lens.append(min(cap, l - o))
    return Window(np.array(docs, np.int64), np.array(offs, np.int64), np.array(lens, np.int64))


def sliced_spans(rank_plan) -> list[tuple[int, int]]:
    """(first, last) pack position of every piece split over more than one pack on this rank."""
    where: dict[tuple[int, int], list[int]] = {}
    for pos, mb in enumerate(rank_plan.micro_batches):
        for s in mb.segments:
            where.setdefault((s.doc, s.attend_from), []).append(pos)
    return sorted((min(p), max(p)) for p in where.values() if min(p) != max(p))


@pytest.mark.parametrize("seed", range(6))
def test_sliced_pieces_form_one_run_from_pack_zero(seed):
    cap = 65536
    cfg = PlanConfig(strategy="slimpack", parallel=ParallelConfig(dp=8, pp=4, tp=8), max_tokens=cap, context=cap,
                     tokens_per_step=4 << 20, model="llama3-8b")
    planner = SlimPackPlanner(cfg)
    window = long_tail_window(seed, 4 << 20, cap)
    pieces = Pieces.of(window, PlannerState(), 0)
    packing = planner.solve(pieces, StepLayout(0, micro_batches=32), planner.model).costs(planner.model)
    plan = packing.to_step_plan(0)
    for r, rp in enumerate(plan.ranks):
        if any(mb.dp_group for mb in rp.micro_batches):
            continue  # DP-Merge runs are placed by the group, not by the rank's own slicing
        spans = sliced_spans(rp)
        if not spans:
            continue
        assert spans[0][0] == 0, f"rank {r}: slices start at pack {spans[0][0]}"
        reach = spans[0][1]
        for a, b in spans[1:]:
            assert a <= reach, f"rank {r}: a second run of sliced packs starts at {a} (the first ends at {reach})"
            reach = max(reach, b)
        # and that one run costs at most one pipeline drain over the same packs simulated without the links
        # (FIFO backward): (pp - 1) stage-times of the heaviest micro-batch
        f = np.array([mb.fwd_cost for mb in rp.micro_batches])
        b = np.array([mb.bwd_cost for mb in rp.micro_batches])
        edges, _ = slice_edges_of(rp.micro_batches)
        linked = simulate(f, b, 4, slice_edges=edges).step_time
        unlinked = simulate(f, b, 4).step_time
        assert linked - unlinked <= 3 * float((f + b).max()), f"rank {r}: {linked:.3f} s linked, {unlinked:.3f} s not"
