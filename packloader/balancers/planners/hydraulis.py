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

from packloader.balancers.cost.coeffs import (
    ATTN_BWD,
    ATTN_FWD,
    LIN_BWD,
    LIN_FWD,
    LIN_KNOTS,
    LIN_TBWD,
    LIN_TFWD,
    LIN_TOK,
    doc_time_split,
    lin_times,
    segment_times_kernel,
)
from packloader.balancers.cost.model import CostModel, annotate_costs
from packloader.balancers.cost.resolve import RankCosts
from packloader.balancers.planners.base import Model, PackingPlanner, StepLayout
from packloader.balancers.planners.hydraulis_kernels import (  # noqa: F401 (hydraulis_pack: the kernels' API here)
    hydraulis_dispatch,
    hydraulis_pack,
    hydraulis_pack_ordered,
    pack_order,
    rank_max,
)
from packloader.balancers.planners.packing import Packing, Pieces, check_cap, whole_pieces_packing
from packloader.balancers.planners.registry import AutoUse, Planner, register_planner
from packloader.contracts import PlanConfig, StepPlan

UTIL_THRESHOLD = 0.85  # Appendix C: the efficiency at which a micro-batch counts as fully utilised
MAX_V_CANDIDATES = 24


def _piece_times(coeffs: np.ndarray, prof: np.ndarray, length: np.ndarray, times) -> np.ndarray:
    """Forward + backward time of each piece under its rank's profile (`prof[i]`, a row of `coeffs`), by
    `times(coeffs row, lengths)` -> (forward, backward): one call per profile rather than per piece."""
    out = np.empty(len(length), np.float64)
    for k in range(len(coeffs)):
        at = prof == k
        if at.any():
            f, b = times(coeffs[k], np.ascontiguousarray(length[at]))
            out[at] = f + b
    return out


def _whole_attention(c: np.ndarray, q: np.ndarray):
    """The attention part alone of whole documents of lengths q (no prefix)."""
    return segment_times_kernel(c, q, np.zeros_like(q))


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


def _least_holding(ck: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Under a measured linear table (forward + backward), the least linear time of a micro-batch of n >= q
    tokens, for each q: the least of lin_time(q) and the table's rows at q tokens and more (lin_time is linear
    between rows and grows past the last)."""
    nk = int(ck[LIN_KNOTS])
    past = np.searchsorted(ck[LIN_TOK:LIN_TOK + nk], q.astype(np.float64), side="left")
    out = np.zeros(len(q))
    for t, bwd in ((LIN_TFWD, False), (LIN_TBWD, True)):
        rows = np.append(np.minimum.accumulate(ck[t:t + nk][::-1])[::-1], np.inf)
        out += np.minimum(lin_times(ck, q.astype(np.float64), bwd), rows[past])
    return out


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
        least its pieces' own shares, a*n^2 >= sum a*l^2); for measured linear tables, which need not be convex
        (the H100 backward rows are not even monotone), the weaker `table_bound`; None otherwise. Lets `solve`
        skip a V (at the top of Appendix C's window: hundreds of micro-batches, each a floor) without changing
        which V wins."""
        ra = ra or self.arrays()
        c = ra.coeffs
        if (c[:, LIN_KNOTS] > 0).all():
            return self.table_bound(pieces, rank, ra)
        if (c[:, LIN_FWD] < 0).any() or (c[:, LIN_BWD] < 0).any() or (c[:, LIN_KNOTS] > 0).any():
            return None
        dp, pp = self.config.parallel.dp, self.config.parallel.pp
        work = _piece_times(c, ra.rank_profile[rank], pieces.length, doc_time_split)
        tot = np.bincount(rank, weights=work, minlength=dp)
        big = np.zeros(dp, np.float64)
        np.maximum.at(big, rank, work)
        floor = c[ra.rank_profile, LIN_FWD + 2] + c[ra.rank_profile, LIN_BWD + 2]

        def bound(v: int) -> float:
            return float(np.maximum(big + floor, (tot + v * floor) / v).max()) * (pp - 1 + v)

        return bound

    def table_bound(self, pieces: Pieces, rank: np.ndarray, ra: RankArrays):
        """`v_bound` for measured linear tables: a micro-batch's linear time is at least the table's least row
        (lin_time holds the first row below it, interpolates between rows and grows past the last) and whole
        pieces' attention adds up, so a rank's largest micro-batch takes at least (its pieces' attention + V x
        the least row) / V, and at least the least time of a micro-batch holding its longest piece. At PP 1
        and DP 1024 it skips the top of the window (130 micro-batches a rank, 14x the best objective), which
        cost as long as the rest of the packing."""
        c = ra.coeffs
        dp, pp = self.config.parallel.dp, self.config.parallel.pp
        prof = ra.rank_profile[rank]
        attn = _piece_times(c, prof, pieces.length, _whole_attention)
        tot = np.bincount(rank, weights=attn, minlength=dp)
        if (c[:, [ATTN_FWD, ATTN_FWD + 1, ATTN_BWD, ATTN_BWD + 1]] >= 0).all():
            # attention grows with the length, as does the least linear time of a micro-batch holding it
            # (`_least_holding`): each rank's longest piece is the one that counts
            longest = rank_max(rank, pieces.length, dp)
            big = np.zeros(dp, np.float64)
            for k in range(len(c)):
                at = (ra.rank_profile == k) & (longest >= 0)
                if at.any():
                    q = np.ascontiguousarray(longest[at])
                    f, b = segment_times_kernel(c[k], q, np.zeros_like(q))
                    big[at] = f + b + _least_holding(c[k], q)
        else:
            alone = np.empty(len(pieces), np.float64)
            for k in range(len(c)):
                at = prof == k
                if at.any():
                    alone[at] = attn[at] + _least_holding(c[k], np.ascontiguousarray(pieces.length[at]))
            big = np.zeros(dp, np.float64)
            np.maximum.at(big, rank, alone)
        least = np.array([sum(ck[t:t + int(ck[LIN_KNOTS])].min() for t in (LIN_TFWD, LIN_TBWD)) for ck in c])
        least = least[ra.rank_profile]

        def bound(v: int) -> float:
            return float(np.maximum(big, (tot + v * least) / v).max()) * (pp - 1 + v)

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
            ul = min(util_len(m) for m in {id(m): m for m in ra.models}.values())  # each distinct model once
            hi = max(lo, int(np.max(np.minimum(tokens // ul, counts)))) if n else 1
            cands = v_candidates(lo, hi, self.v_limit)
        best = None
        bound = self.v_bound(pieces, rank, ra) if len(cands) > 1 and n else None
        order = pack_order(ra.coeffs, ra.rank_profile, pieces.length, rank)
        for v in cands:
            if best is not None and bound is not None and bound(v) * (1.0 - 1e-9) >= best[0]:
                continue  # its objective cannot beat the best so far: the same V wins without packing this one
            assign, load = hydraulis_pack_ordered(ra.coeffs, ra.rank_profile, ra.caps, pieces.length, rank, v, order)
            if n and assign[0] < 0:
                continue
            obj = float(load.max()) * (pp - 1 + v)
            if best is None or obj < best[0]:
                best = (obj, v, assign)
        v = max(cands)
        while best is None:  # nothing in the window fits: more micro-batches until the cap allows
            v += 1
            assign, load = hydraulis_pack_ordered(ra.coeffs, ra.rank_profile, ra.caps, pieces.length, rank, v, order)
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
