"""`auto` (the default strategy): plan the step with several candidates and keep the one the pipeline simulator
says runs fastest, as SlimPack's simulator-guided selection does.

Candidates are (planner, micro-batches per rank): `wlb`, `hydraulis`, `slimpack` (only with
config.allow_slicing) and `fixed`, each at its own default number of micro-batches and at a few others around
it (`micro_batch_counts`); config.num_micro_batches pins the count. Every candidate plans the same pieces (the
queued ones, then the window) under the same token cap, min(config.max_tokens, the cost model's memory cap
MaxLen); a candidate that cannot (a piece over the cap without slicing) is skipped.

Score: the slowest DP rank's simulated step time (the batched numba simulator, 1F1B / GPipe / interleaved as
configured, slice dependencies and FILO backward included), divided by the workload the candidate planned
this step (attention + linear work of its pieces, no floors). For candidates that plan everything this is the
step time; a candidate that delays outliers (wlb) is charged for the time per unit of work it actually trains,
so holding work back never looks like a speed-up by itself. Lowest score wins; scores within TOLERANCE of the
lowest count as equal, and among those the most even micro-batches (imbalance degree), then the earlier
candidate in the fixed order above, so every rank picks the same plan. Slicing candidates are scored first;
a whole-piece candidate that plans everything (hydraulis, fixed) is skipped when its bound, PP times the
largest piece's own micro-batch time (that micro-batch's forward and backward chain through the stages), is
already beyond the tolerance of the best score.

Cost of the search: hydraulis runs its longest-first dispatch only (one trial, not the paper's 100) with at
most three V values (two at scale); with pieces x DP ranks above SMALL_WORK only each planner's default count
is tried, and above FIXED_MAX_WORK fixed is dropped. Measured on a busy 2-core machine (4M tokens per step,
64K cap, long-tail lengths): about 8-12 ms per step at DP 8 / PP 4, 30-70 ms at DP 1024 with 3.2M tokens.

State: the winner's queue is the new state (only wlb queues); a flush plans everything (every candidate then
plans all pieces).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import msgspec
import numpy as np

from packloader.balancers.assemble import Packing, Pieces, carried_extra, cost_model_for, wants_flush
from packloader.balancers.cost import doc_time_split
from packloader.balancers.hydraulis import HydraulisPlanner
from packloader.balancers.kernels import bfd_pack
from packloader.balancers.registry import Planner, Window, register_planner
from packloader.balancers.simulator import SCHEDULES, step_times_ranks_sliced
from packloader.balancers.slimpack import SlimPackPlanner, default_packs
from packloader.balancers.wlb import WLBPlanner, default_micro_batches
from packloader.contracts import PlanConfig, PlannerState, StepPlan

PLANNERS = ("wlb", "hydraulis", "slimpack", "fixed")
SMALL_WORK = 400_000  # pieces x DP ranks below which every candidate runs
FIXED_MAX_WORK = 2_000_000  # fixed's BFD is O(pieces x bins): dropped above this
TOLERANCE = 0.005  # simulated step times this close count as equal (the cost model is no finer than that)


@dataclass(frozen=True)
class Candidate:
    planner: str
    micro_batches: int | None  # None: the planner's own choice


def micro_batch_counts(base: int, small: bool) -> list[int | None]:
    """The counts tried around a planner's default `base`: the default itself and, for small problems, twice
    as many (a finer balance and a smaller pipeline fill share, for more per-micro-batch floors)."""
    return [None, 2 * base] if small else [None]


def slice_edges(packing: Packing) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-rank slice edges (CSR offsets, source position, destination position) of a Packing: an edge from
    the micro-batch holding a slice's prefix end to the slice's micro-batch, positions local to each rank (a
    DP-Merge micro-batch is listed by each member rank, so its edges appear on each)."""
    dp, v = packing.rank_mbs.shape
    sl = np.nonzero(packing.seg_af < packing.seg_start)[0]
    if len(sl) == 0:
        return np.zeros(dp + 1, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64)
    # the segment ending where each slice starts: (doc, end) keys sorted, then searched
    key_end = packing.seg_doc * (1 << 31) + packing.seg_end
    order = np.argsort(key_end, kind="stable")
    want = packing.seg_doc[sl] * (1 << 31) + packing.seg_start[sl]
    at = np.searchsorted(key_end[order], want)
    at = np.minimum(at, len(order) - 1)
    found = key_end[order[at]] == want
    src_mb = packing.seg_mb[order[at]][found]
    dst_mb = packing.seg_mb[sl][found]
    keep = src_mb != dst_mb
    src_mb, dst_mb = src_mb[keep], dst_mb[keep]
    # every (rank, position) listing of each micro-batch (a DP-Merge one is listed by each member rank)
    ranks = np.repeat(np.arange(dp, dtype=np.int64), v)
    poss = np.tile(np.arange(v, dtype=np.int64), dp)
    mbs = packing.rank_mbs.ravel()
    by_mb = np.argsort(mbs, kind="stable")
    lo = np.searchsorted(mbs[by_mb], dst_mb, side="left")
    hi = np.searchsorted(mbs[by_mb], dst_mb, side="right")
    cnt = hi - lo
    # one row per (edge, listing of its destination)
    e_idx = np.repeat(np.arange(len(dst_mb)), cnt)
    li = by_mb[np.repeat(lo, cnt) + (np.arange(cnt.sum()) - np.repeat(np.cumsum(cnt) - cnt, cnt))]
    r = ranks[li]
    d = poss[li]
    # the source's position on the same rank: listings keyed (mb, rank)
    key = mbs * dp + ranks
    ko = np.argsort(key, kind="stable")
    want = src_mb[e_idx] * dp + r
    at = np.minimum(np.searchsorted(key[ko], want), len(ko) - 1)
    hit = key[ko[at]] == want
    r, d, s = r[hit], d[hit], poss[ko[at]][hit]
    o = np.lexsort((d, s, r))
    r, s, d = r[o], s[o], d[o]
    offs = np.zeros(dp + 1, np.int64)
    np.cumsum(np.bincount(r, minlength=dp), out=offs[1:])
    return offs, np.ascontiguousarray(s), np.ascontiguousarray(d)


def imbalance_degree(packing: Packing) -> float:
    """WLB-LLM's imbalance degree of the worst rank: max micro-batch cost x count / total (costs filled in)."""
    c = (packing.mb_fwd + packing.mb_bwd)[packing.rank_mbs]
    tot = c.sum(axis=1)
    ok = tot > 0
    if not ok.any():
        return 1.0
    return float((c.max(axis=1)[ok] * c.shape[1] / tot[ok]).max())


class AutoPlanner:
    name = "auto"

    def __init__(self, config: PlanConfig) -> None:
        self.config = config
        self.model = cost_model_for(config)
        mem_cap = self.model.max_tokens()
        self.cap = min(config.max_tokens, mem_cap) if mem_cap else config.max_tokens
        sub = msgspec.structs.replace(config, max_tokens=self.cap)
        self.sub_config = sub
        self.wlb = WLBPlanner(msgspec.structs.replace(sub, strategy="wlb"))
        self.hydraulis = HydraulisPlanner(msgspec.structs.replace(sub, strategy="hydraulis"), trials=1, v_limit=3)
        self.hydraulis_fast = HydraulisPlanner(msgspec.structs.replace(sub, strategy="hydraulis"), trials=1, v_limit=2)
        self.slimpack = SlimPackPlanner(msgspec.structs.replace(sub, strategy="slimpack")) if config.allow_slicing else None
        kind = SCHEDULES[config.schedule]
        self.kind = 0 if kind == 2 and config.parallel.vpp == 1 else kind
        self.last_choice: Candidate | None = None
        self.last_scores: list[tuple[Candidate, float]] = []

    # --- candidates ------------------------------------------------------------------------------------------

    def candidates(self, pieces: Pieces) -> list[Candidate]:
        cfg = self.config
        dp, pp = cfg.parallel.dp, cfg.parallel.pp
        n = len(pieces)
        work = n * dp
        small = work <= SMALL_WORK
        fixed_v = cfg.num_micro_batches
        tokens = pieces.total_tokens
        out: list[Candidate] = []
        for name in PLANNERS:
            if name == "slimpack" and self.slimpack is None:
                continue
            if name == "fixed" and work > FIXED_MAX_WORK:
                continue
            if fixed_v:
                out.append(Candidate(name, fixed_v))
                continue
            if name == "wlb":
                base = default_micro_batches(tokens, n, dp, pp, self.cap, self.wlb.fill)
            elif name == "slimpack":
                base = default_packs(tokens / dp, math.ceil(n / dp), pp, self.cap)
            else:  # hydraulis enumerates its own V; fixed takes the fewest bins that hold the step
                out.append(Candidate(name, None))
                continue
            out += [Candidate(name, v) for v in micro_batch_counts(int(base), small)]
        return out

    def solve(self, cand: Candidate, pieces: Pieces, step: int, flush: bool, small: bool) -> Packing:
        v = cand.micro_batches
        if cand.planner == "wlb":
            return self.wlb.solve(pieces, step, flush, v)
        if cand.planner == "hydraulis":
            return (self.hydraulis if small else self.hydraulis_fast).solve(pieces, step, v)
        if cand.planner == "slimpack":
            return self.slimpack.solve(pieces, step, v)
        return self.fixed_packing(pieces, v)

    def fixed_packing(self, pieces: Pieces, v: int | None) -> Packing:
        """`fixed`'s plan as a Packing: best-fit decreasing into dp x V bins of cap tokens, bin b to rank b % dp
        at position b // dp (as FixedPlanner deals them), V grown until everything fits."""
        from packloader.balancers.assemble import check_cap, whole_pieces_packing

        dp, cap = self.config.parallel.dp, self.cap
        check_cap(pieces, cap, "fixed")
        per_rank = v or max(1, -(-pieces.total_tokens // (cap * dp)))
        while True:
            assign, ok = bfd_pack(pieces.length, cap, per_rank * dp)
            if ok:
                break
            per_rank += 1
        b = np.arange(per_rank * dp, dtype=np.int64)
        rank_mbs = np.empty((dp, per_rank), np.int64)
        rank_mbs[b % dp, b // dp] = b
        return whole_pieces_packing(pieces, assign, rank_mbs, strategy="fixed")

    # --- scoring ---------------------------------------------------------------------------------------------

    def step_time(self, packing: Packing) -> float:
        """The slowest rank's simulated step time of a packing (costs filled in)."""
        cfg = self.config
        dp, v = packing.rank_mbs.shape
        order = packing.rank_mbs.ravel()
        f = np.ascontiguousarray(packing.mb_fwd[order])
        b = np.ascontiguousarray(packing.mb_bwd[order])
        offsets = np.arange(dp + 1, dtype=np.int64) * v
        e_off, e_src, e_dst = slice_edges(packing)
        t = step_times_ranks_sliced(cfg.parallel.pp, cfg.parallel.vpp, self.kind, f, b, offsets, e_off, e_src, e_dst, 0.0)
        if (t < 0).any():
            return math.inf  # this micro-batch count deadlocks the interleaved schedule
        return float(t.max())

    # --- planning --------------------------------------------------------------------------------------------

    def plan(self, window: Window, state: PlannerState, step: int) -> tuple[StepPlan, PlannerState]:
        pieces = Pieces.of(window, state, step)
        flush = wants_flush(state)
        f, b = doc_time_split(self.model.coeffs, pieces.length)
        piece_work = f + b
        total_work = float(piece_work.sum())
        small = len(pieces) * self.config.parallel.dp <= SMALL_WORK
        results: list[tuple[float, float, int, Packing, Candidate]] = []
        scores: list[tuple[Candidate, float]] = []
        errors: list[str] = []
        cands = list(enumerate(self.candidates(pieces)))
        # slicing candidates first: their time often rules out the whole-piece planners without running them
        cands.sort(key=lambda ic: (ic[1].planner != "slimpack", ic[0]))
        floor = sum(self.model.floor())
        # any plan that keeps pieces whole and plans them all runs the largest piece inside one micro-batch,
        # whose forward and backward pass through every stage one after the other: pp x its time at least
        pp = self.config.parallel.pp
        whole_bound = pp * (float(piece_work.max()) + floor) / total_work if len(pieces) and total_work > 0 else 0.0
        for idx, cand in cands:
            if cand.planner in ("hydraulis", "fixed") and results:
                if whole_bound > min(r[0] for r in results) * (1.0 + TOLERANCE):
                    continue  # cannot come within the tolerance of the fastest so far
            try:
                packing = self.solve(cand, pieces, step, flush, small)
            except ValueError as e:  # e.g. a piece over the cap for a planner that cannot slice
                errors.append(f"{cand.planner}: {e}")
                continue
            packing.costs(self.model)
            t = self.step_time(packing)
            work = total_work
            if packing.queued:  # what it holds back is not trained this step
                hf, hb = doc_time_split(self.model.coeffs, np.array([q.length for q in packing.queued], np.int64))
                work -= float(hf.sum() + hb.sum())
            score = t / work if work > 0 else (0.0 if t == 0 else math.inf)
            imb = imbalance_degree(packing)
            scores.append((cand, score))
            results.append((score, imb, idx, packing, cand))
        if not results:
            raise ValueError("auto: no candidate planner can plan this step: " + "; ".join(errors))
        # fastest; within TOLERANCE of the fastest, the most even micro-batches, then the earliest candidate
        fastest = min(r[0] for r in results)
        _, _, idx, packing, cand = min((r for r in results if r[0] <= fastest * (1.0 + TOLERANCE)), key=lambda r: (r[1], r[2]))
        self.last_choice = cand
        self.last_scores = scores
        packing.extra = carried_extra(state)
        plan = packing.to_step_plan(step)
        plan.extra["auto_candidate"] = float(idx)
        plan.extra["auto_planner"] = float(PLANNERS.index(cand.planner))
        return plan, packing.state()


@register_planner("auto")
def _make(config: PlanConfig) -> Planner:
    return AutoPlanner(config)
