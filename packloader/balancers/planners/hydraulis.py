"""Hydraulis (the paper "Hydraulis: Balancing Large Transformer Model Training via Co-designing Parallel
Strategies and Data Assignment"): two-stage sequence assignment.

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
per DP rank (Hydraulis' heterogeneous pipelines), as does a RankCosts injected as its model (its registry entry's
`rank_costs`, which the report's grouping advice looks up); the kernels take the profiles as a (K, NUM_COEFFS) array.
Nothing is delayed; queued pieces from another planner's state are planned first like any other.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import msgspec
import numpy as np
from numba import njit

from packloader.balancers.cost.coeffs import LIN_BWD, LIN_FWD, LIN_KNOTS, doc_time_split
from packloader.balancers.cost.model import CostModel, annotate_costs
from packloader.balancers.cost.resolve import RankCosts
from packloader.balancers.planners.base import Model, PackingPlanner, StepLayout
from packloader.balancers.planners.bins import HEAP_MIN_BINS, _add_piece, _empty_bin_loads, _heap_pop, _heap_push
from packloader.balancers.planners.packing import Packing, Pieces, check_cap, whole_pieces_packing
from packloader.balancers.planners.registry import AutoUse, Planner, register_planner
from packloader.contracts import PlanConfig, StepPlan

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


@dataclass(frozen=True)
class RankArrays:
    """A model per DP rank as the kernels take it: distinct coefficient rows, each rank's row, token caps."""

    models: list[CostModel]
    rank_profile: np.ndarray
    coeffs: np.ndarray
    caps: np.ndarray


class HydraulisPlanner(PackingPlanner):
    name = "hydraulis"

    def __init__(self, config: PlanConfig, *, models: Sequence[CostModel] | None = None, caps: Sequence[int] | None = None,
                 trials: int | None = None, work_budget: float = 1e7, v_limit: int = MAX_V_CANDIDATES,
                 model: CostModel | None = None) -> None:
        super().__init__(config, model)
        dp = config.parallel.dp
        if models is not None or caps is not None:  # a model and a token cap per DP rank (heterogeneous ranks)
            ms = list(models) if models is not None else [self.model] * dp
            if len(ms) != dp:
                raise ValueError(f"{len(ms)} cost models for {dp} DP ranks")
            self.model = RankCosts(ms, list(caps) if caps is not None else [config.max_tokens] * dp)
        self._arrays: tuple[Model, RankArrays] | None = None
        self.trials = trials
        self.work_budget = work_budget
        self.v_limit = v_limit

    def arrays(self, model: Model | None = None) -> RankArrays:
        """`model` (default: the planner's own) per DP rank; kept for the last model seen."""
        model = self.model if model is None else model
        if self._arrays is not None and self._arrays[0] is model:
            return self._arrays[1]
        dp = self.config.parallel.dp
        if isinstance(model, RankCosts):
            models, caps = list(model.models), list(model.caps)
            if len(models) != dp:
                raise ValueError(f"{len(models)} cost models for {dp} DP ranks")
        else:
            models, caps = [model] * dp, [self.config.max_tokens] * dp
        profiles: dict[int, int] = {}
        rows = []
        rank_profile = np.empty(dp, np.int64)
        for r, m in enumerate(models):
            k = profiles.setdefault(id(m), len(rows))
            if k == len(rows):
                rows.append(m.coeffs)
            rank_profile[r] = k
        out = RankArrays(models, rank_profile, np.ascontiguousarray(np.stack(rows)), np.array(caps, np.int64))
        self._arrays = (model, out)
        return out

    def num_trials(self, n: int) -> int:
        """Paper: T = 100. Fewer at scale so one step stays within ~work_budget rank evaluations."""
        if self.trials is not None:
            return self.trials
        return int(min(100, max(2, self.work_budget // max(1, n * self.config.parallel.dp))))

    def dispatch(self, pieces: Pieces, step: int, ra: RankArrays | None = None) -> np.ndarray:
        cfg = self.config
        ra = ra or self.arrays()
        seed = (cfg.seed * 1_000_003 + step) % (2**32)
        rank, _ = hydraulis_dispatch(ra.coeffs, ra.rank_profile, ra.caps, pieces.length, cfg.parallel.pp, self.num_trials(len(pieces)), seed)
        return rank

    def v_bound(self, pieces: Pieces, rank: np.ndarray, ra: RankArrays | None = None):
        """A lower bound of the Eq. (1) objective for a given V, before packing: on each rank the largest
        micro-batch takes at least its largest piece plus the floor, and at least the mean, (its pieces' work
        + V floors) / V; times (PP - 1 + V). Valid when the linear part is convex (a bin of n tokens costs at
        least its pieces' own shares, a*n^2 >= sum a*l^2); None otherwise, and None for a measured linear
        table, which need not be convex (the H100 backward rows are not even monotone). Lets `solve` skip a V (at
        the top of Appendix C's window: hundreds of micro-batches, each a floor) without changing which V wins."""
        ra = ra or self.arrays()
        c = ra.coeffs
        if (c[:, LIN_FWD] < 0).any() or (c[:, LIN_BWD] < 0).any() or (c[:, LIN_KNOTS] > 0).any():
            return None
        dp, pp = self.config.parallel.dp, self.config.parallel.pp
        work = np.empty(len(pieces), np.float64)
        prof = ra.rank_profile[rank]
        for k in range(len(c)):
            at = prof == k
            if at.any():
                f, b = doc_time_split(c[k], np.ascontiguousarray(pieces.length[at]))
                work[at] = f + b
        tot = np.bincount(rank, weights=work, minlength=dp)
        big = np.zeros(dp, np.float64)
        np.maximum.at(big, rank, work)
        floor = c[ra.rank_profile, LIN_FWD + 2] + c[ra.rank_profile, LIN_BWD + 2]

        def bound(v: int) -> float:
            return float(np.maximum(big + floor, (tot + v * floor) / v).max()) * (pp - 1 + v)

        return bound

    def solve(self, pieces: Pieces, layout: StepLayout, model: Model) -> Packing:
        cfg = self.config
        dp, pp = cfg.parallel.dp, cfg.parallel.pp
        ra = self.arrays(model)
        check_cap(pieces, int(ra.caps.max()), self.name)
        n = len(pieces)
        rank = self.dispatch(pieces, layout.step, ra) if n else np.zeros(0, np.int64)
        fixed_v = layout.micro_batches or cfg.num_micro_batches
        if fixed_v:
            cands = [fixed_v]
        else:
            tokens = np.bincount(rank, weights=pieces.length, minlength=dp)
            counts = np.bincount(rank, minlength=dp)
            lo = max(1, int(np.max(np.ceil(tokens / ra.caps)))) if n else 1
            ul = min(util_len(m) for m in ra.models)
            hi = max(lo, int(np.max(np.minimum(tokens // ul, counts)))) if n else 1
            cands = v_candidates(lo, hi, self.v_limit)
        best = None
        bound = self.v_bound(pieces, rank, ra) if len(cands) > 1 and n else None
        for v in cands:
            if best is not None and bound is not None and bound(v) * (1.0 - 1e-9) >= best[0]:
                continue  # its objective cannot beat the best so far: the same V wins without packing this one
            assign, load = hydraulis_pack(ra.coeffs, ra.rank_profile, ra.caps, pieces.length, rank, v)
            if n and assign[0] < 0:
                continue
            obj = float(load.max()) * (pp - 1 + v)
            if best is None or obj < best[0]:
                best = (obj, v, assign)
        v = max(cands)
        while best is None:  # nothing in the window fits: more micro-batches until the cap allows
            v += 1
            assign, load = hydraulis_pack(ra.coeffs, ra.rank_profile, ra.caps, pieces.length, rank, v)
            if assign[0] >= 0:
                best = (0.0, v, assign)
        _, v, assign = best
        rank_mbs = np.arange(dp * v, dtype=np.int64).reshape(dp, v)
        return whole_pieces_packing(pieces, assign, rank_mbs, strategy=self.name)

    def priced(self, packing: Packing, step: int) -> StepPlan:
        ra = self.arrays()
        if len(ra.coeffs) == 1:
            return packing.costs(ra.models[0]).to_step_plan(step)
        return annotate_costs(packing.to_step_plan(step), ra.models)


class HydraulisOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """HydraulisPlanner's knobs (PlanConfig.planner_options["hydraulis"])."""

    trials: int | None = None  # dispatch trials (None: as many as work_budget allows)
    work_budget: float = 1e7  # pieces x trials the dispatch may spend
    v_limit: int = MAX_V_CANDIDATES  # most micro-batch counts V tried


@register_planner("hydraulis", options=HydraulisOptions, summary="Hydraulis: cost-aware dispatch + packing",
                  report_order=20, rank_costs=True, auto=AutoUse(order=20, whole_pieces=True, options={"trials": 1, "v_limit": 3},
                                                options_at_scale={"trials": 1, "v_limit": 2}))
def _make(config: PlanConfig, options: HydraulisOptions, model: Model) -> Planner:
    return HydraulisPlanner(config, model=model, **msgspec.structs.asdict(options))


# ------------------------------------------------------------------------------------------------ Hydraulis


@njit(cache=True)
def _dispatch_trial(perm, lengths, caps, rank_profile, t_sum, t_full, pp, assign, cc, ee, lmax):
    """One greedy pass of `hydraulis_dispatch` in the order `perm`: fills `assign`, returns the objective (the
    largest bound over ranks)."""
    d = rank_profile.shape[0]
    n = lengths.shape[0]
    cc[:] = 0.0
    ee[:] = 0.0
    lmax[:] = 0
    # top two of cc + ee, to get max over k != j in O(1)
    i1 = 0
    v1 = 0.0
    i2 = 1 if d > 1 else -1
    v2 = 0.0 if d > 1 else -np.inf
    for kk in range(n):
        i = perm[kk]
        l = lengths[i]
        best_j = -1
        best_o = np.inf
        best_own = np.inf
        for j in range(d):
            if caps[j] < l:
                continue
            p = rank_profile[j]
            cn = cc[j] + t_sum[p, i]
            en = ee[j] if lmax[j] >= l else t_full[p, i] * (pp - 1)
            own = cn + en
            other = v2 if j == i1 else v1
            o = own if own > other else other
            if o < best_o or (o == best_o and own < best_own):
                best_o = o
                best_own = own
                best_j = j
        j = best_j
        assign[i] = j
        p = rank_profile[j]
        cc[j] += t_sum[p, i]
        if l > lmax[j]:
            lmax[j] = l
            ee[j] = t_full[p, i] * (pp - 1)
        v = cc[j] + ee[j]
        if j == i1:
            v1 = v
        elif v > v1:
            i2 = i1
            v2 = v1
            i1 = j
            v1 = v
        elif j == i2 or v > v2:
            i2 = j
            v2 = v
    return v1


@njit(cache=True)
def hydraulis_dispatch(coeffs, rank_profile, caps, lengths, pp, trials, seed):
    """Hydraulis Algorithm 1 (Appendix D.2): greedy dispatch of pieces to DP ranks (pipelines), each piece to
    the rank that keeps the largest lower bound (Eq. 2: sum T(l) + T(max l) * (PP - 1)) smallest, over
    `trials` orders; trial 0 takes the pieces longest first (an addition: it is usually the best trial), the
    others random permutations from `seed`. Ties go to the rank whose own bound stays lowest, then the lowest
    index.

    coeffs: (K, NUM_COEFFS) cost profiles; rank_profile: (D,) profile index of each rank; caps: (D,) token caps
    (MaxLen) of each rank. Returns (rank of each piece, best objective); rank -1 everywhere if some piece fits
    no rank.
    """
    n = lengths.shape[0]
    d = rank_profile.shape[0]
    k_prof = coeffs.shape[0]
    best_assign = np.full(n, -1, dtype=np.int64)
    if n == 0:
        return best_assign, 0.0
    for i in range(n):
        ok = False
        for j in range(d):
            if caps[j] >= lengths[i]:
                ok = True
                break
        if not ok:
            return best_assign, np.inf
    # T(l) without floor (summed) and T(l) with the micro-batch floor (the E term), per profile.
    t_sum = np.empty((k_prof, n), dtype=np.float64)
    t_full = np.empty((k_prof, n), dtype=np.float64)
    for k in range(k_prof):
        f, b = doc_time_split(coeffs[k], lengths)
        for i in range(n):
            t_sum[k, i] = f[i] + b[i]
            t_full[k, i] = t_sum[k, i] + coeffs[k][LIN_FWD + 2] + coeffs[k][LIN_BWD + 2]
    np.random.seed(seed)
    best_obj = np.inf
    assign = np.empty(n, dtype=np.int64)
    cc = np.empty(d, dtype=np.float64)
    ee = np.empty(d, dtype=np.float64)
    lmax = np.empty(d, dtype=np.int64)
    desc = np.argsort(-lengths, kind="mergesort")
    for trial in range(trials):
        perm = desc if trial == 0 else np.random.permutation(n)
        obj = _dispatch_trial(perm, lengths, caps, rank_profile, t_sum, t_full, pp, assign, cc, ee, lmax)
        if obj < best_obj:
            best_obj = obj
            best_assign[:] = assign
    return best_assign, best_obj


@njit(cache=True)
def _hydraulis_pack_scan(coeffs, rank_profile, caps, lengths, piece_rank, per_rank, order, assign, attn, tok, load):
    """`hydraulis_pack` by scanning the rank's bins for each piece (few bins per rank)."""
    n = lengths.shape[0]
    for kk in range(n):
        i = order[kk]
        r = piece_rank[i]
        l = lengths[i]
        best = -1
        for b in range(r * per_rank, (r + 1) * per_rank):
            if tok[b] + l <= caps[r] and (best < 0 or load[b] < load[best]):
                best = b
        if best < 0:
            assign[:] = -1
            return assign, load
        _add_piece(coeffs[rank_profile[r]], i, l, best, assign, attn, tok, load)
    _empty_bin_loads(coeffs, rank_profile, per_rank, tok, load)
    return assign, load


@njit(cache=True)
def hydraulis_pack(coeffs, rank_profile, caps, lengths, piece_rank, per_rank):
    """Hydraulis Eq. (1) for one V: on every rank, pack its pieces into `per_rank` micro-batches, longest
    workload first into the least loaded micro-batch the rank's cap allows (LPT with a cap; ties to the lowest
    bin). The least loaded bin comes from a per-rank binary heap keyed (load, bin) with lazy deletion (loads
    only grow); bins over the cap for this piece are popped aside and pushed back: O(n log V) when the least
    loaded bin usually fits, instead of a scan of the rank's V bins per piece (V reaches the hundreds at the
    top of Appendix C's window); up to HEAP_MIN_BINS / 4 bins per rank the scan is cheaper and is used.

    Returns (bin of each piece as rank * per_rank + j, or -1 everywhere when infeasible; bin times;
    max over ranks of max bin time * (PP - 1 + V) is left to the caller)."""
    n = lengths.shape[0]
    d = rank_profile.shape[0]
    nb = d * per_rank
    assign = np.full(n, -1, dtype=np.int64)
    attn = np.zeros(nb, dtype=np.float64)
    tok = np.zeros(nb, dtype=np.int64)
    load = np.zeros(nb, dtype=np.float64)
    work = np.empty(n, dtype=np.float64)
    for k in range(coeffs.shape[0]):  # each profile's workload of every piece, kept where the rank uses it
        f, b = doc_time_split(coeffs[k], lengths)
        for i in range(n):
            if rank_profile[piece_rank[i]] == k:
                work[i] = f[i] + b[i]
    order = np.argsort(-work, kind="mergesort")
    if per_rank <= HEAP_MIN_BINS // 4:
        return _hydraulis_pack_scan(coeffs, rank_profile, caps, lengths, piece_rank, per_rank, order, assign, attn, tok, load)
    count = np.zeros(d, dtype=np.int64)
    for i in range(n):
        count[piece_rank[i]] += 1
    hcap = per_rank + 1
    for r in range(d):
        if per_rank + count[r] + 1 > hcap:
            hcap = per_rank + count[r] + 1
    hk = np.empty((d, hcap), dtype=np.float64)
    hi = np.empty((d, hcap), dtype=np.int64)
    hs = np.zeros(d, dtype=np.int64)
    for r in range(d):
        for b in range(r * per_rank, (r + 1) * per_rank):
            hs[r] = _heap_push(hk[r], hi[r], hs[r], 0.0, b)
    aside = np.empty(max(per_rank, 1), dtype=np.int64)
    for kk in range(n):
        i = order[kk]
        r = piece_rank[i]
        l = lengths[i]
        kr = hk[r]
        ir = hi[r]
        best = -1
        na = 0
        while hs[r] > 0:
            b = ir[0]
            if kr[0] != load[b]:  # stale
                hs[r] = _heap_pop(kr, ir, hs[r])
                continue
            if tok[b] + l <= caps[r]:
                best = b
                break
            aside[na] = b  # over the cap for this piece: set aside, still a candidate for the next ones
            na += 1
            hs[r] = _heap_pop(kr, ir, hs[r])
        if best < 0:
            assign[:] = -1
            return assign, load
        hs[r] = _heap_pop(kr, ir, hs[r])
        for t in range(na):
            hs[r] = _heap_push(kr, ir, hs[r], load[aside[t]], aside[t])
        _add_piece(coeffs[rank_profile[r]], i, l, best, assign, attn, tok, load)
        hs[r] = _heap_push(kr, ir, hs[r], load[best], best)
    _empty_bin_loads(coeffs, rank_profile, per_rank, tok, load)
    return assign, load
