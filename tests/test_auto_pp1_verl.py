"""Issue 38 part 3: at PP 1 `auto` never trails verl's Karmarkar-Karp under the judge the benchmarks use (the
no-bubble ideal over the simulated step, `sim.metrics.score_plans`). verl's plan is built here from verl's own
functions (tests/reference, vendored), not from packloader's re-implementation."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import verl_seqlen_balancing as verl

from packloader.balancers.cost.lookup import cost_model_for
from packloader.balancers.draw import draw_windows
from packloader.balancers.factory import make_planner
from packloader.balancers.planners.packing import Pieces, whole_pieces_packing
from packloader.balancers.planners.registry import StepLayout
from packloader.balancers.sim.metrics import score_plans
from packloader.contracts import ParallelConfig, PlanConfig, PlannerState

CAP = 65536
DP = 16


def long_tail(n: int, seed: int, alpha: float, tail: float) -> np.ndarray:
    """Lognormal body and a Pareto tail clipped at the cap (verl keeps sequences whole)."""
    rng = np.random.default_rng(seed)
    body = rng.lognormal(np.log(1500), 1.6, n)
    long = 32768 * (1 + rng.pareto(alpha, n))
    return np.clip(np.rint(np.where(rng.random(n) < tail, long, body)), 16, CAP).astype(np.int64)


def verl_step(pieces: Pieces, step: int):
    """verl's two levels from its own functions: DP ranks by workload with equal sizes (padded with empty items,
    as its trainer pads the batch), then each rank's micro-batches by workload, one more until all fit the cap."""
    lengths = pieces.length
    n = len(lengths)
    work = verl.calculate_workload(torch.as_tensor(lengths)).tolist()
    pad = -n % DP
    ranks = verl.get_seqlen_balanced_partitions(work + [0] * pad, DP, True)
    ranks = [[i for i in r if i < n] for r in ranks]
    m = max(max(1, verl.ceildiv(int(lengths[r].sum()), CAP)) for r in ranks)
    while True:
        piece_mb = np.full(n, -1, np.int64)
        ok = True
        for d, r in enumerate(ranks):
            k = min(m, len(r))
            parts = verl.get_seqlen_balanced_partitions([work[i] for i in r], k, False) if k else []
            for j, p in enumerate(parts):
                idx = [r[i] for i in p]
                ok &= int(lengths[idx].sum()) <= CAP
                piece_mb[idx] = d * m + j
        if ok:
            break
        m += 1
    rank_mbs = (np.arange(DP)[:, None] * m + np.arange(m)[None, :]).astype(np.int64)
    return whole_pieces_packing(pieces, piece_mb, rank_mbs, strategy="verl").to_step_plan(step)


@settings(max_examples=6, deadline=None, derandomize=True)
@given(seed=st.integers(0, 10**6), alpha=st.sampled_from([1.05, 1.2, 1.5]), tail=st.sampled_from([0.01, 0.03, 0.08]),
       tps=st.sampled_from([1 << 20, 2 << 20]))
def test_auto_at_least_verl_at_pp1(seed, alpha, tail, tps):
    cfg = PlanConfig(strategy="auto", parallel=ParallelConfig(dp=DP, pp=1, tp=8), max_tokens=CAP, context=CAP,
                     tokens_per_step=tps, model="llama3-8b", cost="measured")
    lengths = long_tail(4 * tps // 3000, seed, alpha, tail)
    windows = draw_windows(lengths, tps, CAP, 2, incomplete=False).windows
    assert windows
    planner, model = make_planner(cfg), cost_model_for(cfg)
    for i, w in enumerate(windows):
        pieces = Pieces.of(w, PlannerState(), i)
        mine, _ = planner.plan(w, PlannerState(), StepLayout(i, flush=True))
        theirs = verl_step(pieces, i)
        (a,), _ = score_plans([mine], model, cfg.parallel, max_tokens=CAP)
        (b,), _ = score_plans([theirs], model, cfg.parallel, max_tokens=CAP)
        assert a.efficiency >= b.efficiency - 1e-9, (seed, alpha, tail, tps, i, a.efficiency, b.efficiency)


def test_kk_is_a_candidate_only_at_pp1():
    for pp, expected in ((1, True), (2, False)):
        cfg = PlanConfig(strategy="auto", parallel=ParallelConfig(dp=4, pp=pp, tp=1), max_tokens=8192,
                         context=8192, tokens_per_step=65536, model="llama3-8b", cost="measured")
        planner = make_planner(cfg)
        pieces = Pieces.of(draw_windows(long_tail(200, 1, 1.2, 0.03) // 8, 65536, 8192, 1,
                                        incomplete=False).windows[0], PlannerState(), 0)
        names = {c.planner for c in planner.candidates(pieces)}
        assert ("karmarkar_karp" in names) is expected, (pp, names)


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
