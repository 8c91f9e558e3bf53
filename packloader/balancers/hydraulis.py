"""Hydraulis (seed 003): two-stage sequence assignment.

Stage one (section 6.2, Algorithm 1 of Appendix D.2) dispatches the step's pieces across DP ranks (Hydraulis'
pipelines): over several trials, pieces in a random order (trial 0: longest first) each go to the rank that
keeps the largest lower bound of Eq. 2, ``sum T(l) + T(max l) * (PP - 1)``, smallest; the best trial wins.
T is the cost model's forward + backward time of a piece (the paper's a*l^2 + b*l + c fit). Trials are random
permutations from a generator seeded by (config.seed, step), so every rank computes the same dispatch.

Stage two (section 6.1, Eq. 1) packs each rank's pieces into V micro-batches minimising
``max micro-batch time * (PP - 1 + V)`` under the token cap (MaxLen = max_tokens), longest workload first into
the least loaded micro-batch. V is enumerated within Appendix C's pruning window
``[max(sum l / MaxLen, 1), min(sum l / UtilLen, U)]``, UtilLen being the micro-batch size at which the cost
model's linear part reaches 85 % of its asymptotic efficiency (floor / slope). The packloader contract asks
for one V on every DP rank, so the enumeration scores each V by its slowest rank.

Heterogeneous ranks: `HydraulisPlanner(config, models=[...], caps=[...])` takes one cost model and token cap
per DP rank (Hydraulis' heterogeneous pipelines); the kernels take the profiles as a (K, NUM_COEFFS) array.
Nothing is delayed; queued pieces from another planner's state are planned first like any other.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from packloader.balancers.assemble import Packing, Pieces, carried_extra, check_cap, cost_model_for, whole_pieces_packing
from packloader.balancers.cost import LIN_BWD, LIN_FWD, CostModel, annotate_costs, doc_time_split
from packloader.balancers.kernels import hydraulis_dispatch, hydraulis_pack
from packloader.balancers.registry import Planner, Window, register_planner
from packloader.contracts import PlanConfig, PlannerState, StepPlan

UTIL_THRESHOLD = 0.85  # Appendix C: the efficiency at which a micro-batch counts as fully utilised
MAX_V_CANDIDATES = 24


def util_len(model: CostModel, threshold: float = UTIL_THRESHOLD) -> int:
    """Tokens at which lin(n) / n is within `threshold` of its slope: slope*n / (slope*n + floor) >= threshold."""
    c = model.coeffs
    slope = float(c[LIN_FWD + 1] + c[LIN_BWD + 1])
    floor = float(c[LIN_FWD + 2] + c[LIN_BWD + 2])
    if slope <= 0.0 or floor <= 0.0:
        return 1
    return max(1, math.ceil(threshold / (1.0 - threshold) * floor / slope))


def v_candidates(lo: int, hi: int, limit: int = MAX_V_CANDIDATES) -> list[int]:
    """Every V in [lo, hi] when few, else `limit` of them spaced logarithmically (both ends included)."""
    if hi - lo + 1 <= limit:
        return list(range(lo, hi + 1))
    # np.geomspace(lo, hi, limit) written out (the same values; numpy's call costs ~0.1 ms per step)
    a, b = math.log10(lo), math.log10(hi)
    step = (b - a) / (limit - 1)
    pts = [float(lo)] + [10.0 ** (k * step + a) for k in range(1, limit - 1)] + [float(hi)]
    return sorted({int(round(x)) for x in pts})


class HydraulisPlanner:
    name = "hydraulis"

    def __init__(self, config: PlanConfig, *, models: Sequence[CostModel] | None = None, caps: Sequence[int] | None = None,
                 trials: int | None = None, work_budget: float = 1e7, v_limit: int = MAX_V_CANDIDATES) -> None:
        self.config = config
        dp = config.parallel.dp
        self.models = list(models) if models is not None else [cost_model_for(config)] * dp
        if len(self.models) != dp:
            raise ValueError(f"{len(self.models)} cost models for {dp} DP ranks")
        profiles: dict[int, int] = {}
        rows = []
        self.rank_profile = np.empty(dp, np.int64)
        for r, m in enumerate(self.models):
            k = profiles.setdefault(id(m), len(rows))
            if k == len(rows):
                rows.append(m.coeffs)
            self.rank_profile[r] = k
        self.coeffs = np.ascontiguousarray(np.stack(rows))
        self.caps = np.array(caps if caps is not None else [config.max_tokens] * dp, np.int64)
        self.trials = trials
        self.work_budget = work_budget
        self.v_limit = v_limit

    def num_trials(self, n: int) -> int:
        """Paper: T = 100. Fewer at scale so one step stays within ~work_budget rank evaluations."""
        if self.trials is not None:
            return self.trials
        return int(min(100, max(2, self.work_budget // max(1, n * self.config.parallel.dp))))

    def dispatch(self, pieces: Pieces, step: int) -> np.ndarray:
        cfg = self.config
        seed = (cfg.seed * 1_000_003 + step) % (2**32)
        rank, _ = hydraulis_dispatch(self.coeffs, self.rank_profile, self.caps, pieces.length, cfg.parallel.pp, self.num_trials(len(pieces)), seed)
        return rank

    def v_bound(self, pieces: Pieces, rank: np.ndarray):
        """A lower bound of the Eq. (1) objective for a given V, before packing: on each rank the largest
        micro-batch takes at least its largest piece plus the floor, and at least the mean, (its pieces' work
        + V floors) / V; times (PP - 1 + V). Valid when the linear part is convex (a bin of n tokens costs at
        least its pieces' own shares, a*n^2 >= sum a*l^2); None otherwise. Lets `solve` skip a V (at the top of
        Appendix C's window: hundreds of micro-batches, each a floor) without changing which V wins."""
        c = self.coeffs
        if (c[:, LIN_FWD] < 0).any() or (c[:, LIN_BWD] < 0).any():
            return None
        dp, pp = self.config.parallel.dp, self.config.parallel.pp
        work = np.empty(len(pieces), np.float64)
        prof = self.rank_profile[rank]
        for k in range(len(c)):
            at = prof == k
            if at.any():
                f, b = doc_time_split(c[k], np.ascontiguousarray(pieces.length[at]))
                work[at] = f + b
        tot = np.bincount(rank, weights=work, minlength=dp)
        big = np.zeros(dp, np.float64)
        np.maximum.at(big, rank, work)
        floor = c[self.rank_profile, LIN_FWD + 2] + c[self.rank_profile, LIN_BWD + 2]

        def bound(v: int) -> float:
            return float(np.maximum(big + floor, (tot + v * floor) / v).max()) * (pp - 1 + v)

        return bound

    def solve(self, pieces: Pieces, step: int, num_micro_batches: int | None = None) -> Packing:
        cfg = self.config
        dp, pp = cfg.parallel.dp, cfg.parallel.pp
        check_cap(pieces, int(self.caps.max()), self.name)
        n = len(pieces)
        rank = self.dispatch(pieces, step) if n else np.zeros(0, np.int64)
        fixed_v = num_micro_batches or cfg.num_micro_batches
        if fixed_v:
            cands = [fixed_v]
        else:
            tokens = np.bincount(rank, weights=pieces.length, minlength=dp)
            counts = np.bincount(rank, minlength=dp)
            lo = max(1, int(np.max(np.ceil(tokens / self.caps)))) if n else 1
            ul = min(util_len(m) for m in self.models)
            hi = max(lo, int(np.max(np.minimum(tokens // ul, counts)))) if n else 1
            cands = v_candidates(lo, hi, self.v_limit)
        best = None
        bound = self.v_bound(pieces, rank) if len(cands) > 1 and n else None
        for v in cands:
            if best is not None and bound is not None and bound(v) * (1.0 - 1e-9) >= best[0]:
                continue  # its objective cannot beat the best so far: the same V wins without packing this one
            assign, load = hydraulis_pack(self.coeffs, self.rank_profile, self.caps, pieces.length, rank, v)
            if n and assign[0] < 0:
                continue
            obj = float(load.max()) * (pp - 1 + v)
            if best is None or obj < best[0]:
                best = (obj, v, assign)
        v = max(cands)
        while best is None:  # nothing in the window fits: more micro-batches until the cap allows
            v += 1
            assign, load = hydraulis_pack(self.coeffs, self.rank_profile, self.caps, pieces.length, rank, v)
            if assign[0] >= 0:
                best = (0.0, v, assign)
        _, v, assign = best
        rank_mbs = np.arange(dp * v, dtype=np.int64).reshape(dp, v)
        return whole_pieces_packing(pieces, assign, rank_mbs, strategy=self.name)

    def plan(self, window: Window, state: PlannerState, step: int) -> tuple[StepPlan, PlannerState]:
        packing = self.solve(Pieces.of(window, state, step), step)
        packing.extra = carried_extra(state)
        if len(self.coeffs) == 1:
            return packing.costs(self.models[0]).to_step_plan(step), packing.state()
        return annotate_costs(packing.to_step_plan(step), self.models), packing.state()


@register_planner("hydraulis")
def _make(config: PlanConfig) -> Planner:
    return HydraulisPlanner(config)
