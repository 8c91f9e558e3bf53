"""SlimPack (the paper "SlimPack: Fine-Grained Asymmetric Packing for Balanced and Efficient Variable-Length
LLM Training"): slice-level packing into MicroPacks, asymmetric forward/backward balance, DP-Merge.

Per step:

1. Phase one (equal per-DP forward capacity): pieces, heaviest forward workload first, go to the least
   loaded DP rank. DP-Merge: a piece whose forward workload alone exceeds a rank's share (total / DP) goes to
   a group of g = ceil(work / share) DP ranks (the least loaded) that run it together as context parallelism.
2. Phase two, per rank, V MicroPacks (the same V on every rank, as the packloader contract asks; each rank
   has its own budget = its forward load / V):
   * Slim: a piece heavier than the budget (or longer than max_tokens) is cut into consecutive slices, each
     filling the current pack up to the forward budget and up to the backward budget, whichever comes
     first (a slice attends to the piece's earlier tokens: attend_from is the piece's first token, and its
     backward grows faster with that prefix than its forward). Its slices land in increasing packs of the
     same rank and step. Each sliced piece starts in the pack where the previous one ended (with a short
     first slice if that pack is already at its budget), so all of a rank's slices form one run of linked
     packs from pack 0: its first-in-last-out backward then overlaps the pipeline warm-up, where a second
     run starting mid-step would cost one more pipeline drain.
   * Mix: the pack holding a piece's last slice is filled with other pieces (or the next piece's slices).
   * Pack: the remaining pieces, whole, each to the pack whose forward and backward loads (each relative to
     its own budget) stay lowest: forward and backward balanced separately (asymmetric partitioning).
   * Refine: whole pieces move from the heaviest pack to the lightest while that lowers the heavier one.
   A DP-Merge piece is cut into k slices of equal forward cost (k its share of the group's packs, or the
   fewest the cap allows when that share does not fit); its micro-batches take the earliest run of
   positions free on every rank of the group (the same positions on each), leaving each rank enough free
   packs for its own pieces.
3. Backward order (RankPlan.backward_order): slices need first-in-last-out backward (a later slice's backward
   produces the gradient of the keys and values of the earlier ones), so every run of packs linked by a sliced
   piece is visited in reverse, runs in forward order (SlimPack's FIFO MicroPacks with FILO slices). The
   packloader Plan keeps one partition for both passes, so the paper's backward re-slicing is expressed as
   this order plus the 2-D balance above; the backward imbalance that remains is what the scores report.

DP-Merge representation: the merged micro-batch is one MicroBatch object with `dp_group` = the sorted ranks,
listed in the micro_batches of every rank of the group at the same position; each member's fwd/bwd cost is
its share (CostModel.microbatch_times). Coverage counts a micro-batch with a dp_group once (on its first
rank). `packloader plan` writes its segments under the first rank of the group and an empty micro-batch at
the same position of the other members (step key "dp_groups").

Bounded runs (`run_share`, what `auto` falls back to when no plan with one run per rank fits the device): a
sliced piece that would make its run longer than max(pp, run_share x V) packs starts a new run in a fresh
pack, so fewer forwards wait for the run's first backward and fewer activations stay alive; each run costs a
pipeline drain.

V is config.num_micro_batches, or by default enough packs for the cap with slack, at least 4 x PP when
pipelining (SlimPack's micropack factor; `auto` searches it by simulation). Without config.allow_slicing no
piece is sliced (a piece over the cap is then an error) and a DP-Merge micro-batch holds its piece whole.
"""

from __future__ import annotations

import math

import msgspec
import numpy as np

from packloader.balancers.cost.coeffs import doc_time_split
from packloader.balancers.cost.model import CostModel
from packloader.balancers.planners.base import PackingPlanner, StepLayout
from packloader.balancers.planners.bins import desc_order_by
from packloader.balancers.planners.packing import Packing, Pieces, check_cap, grouped_order
from packloader.balancers.planners.registry import AutoUse, Planner, register_planner
from packloader.balancers.planners.slimpack_kernels import (
    backward_runs_ranks,
    equal_cost_cuts,
    lpt_dispatch,
    own_segments,
    slim_pack_ranks,
)
from packloader.contracts import PlanConfig


def default_packs(tokens_per_rank: float, dp_pieces: int, pp: int, cap: int, factor: int = 4) -> int:
    base = max(1, math.ceil(tokens_per_rank / cap))
    if pp > 1:
        return max(base + 1, min(factor * pp, max(base + 1, dp_pieces)))
    return base


def backward_runs(num_slots: int, spans: list[tuple[int, int]]) -> list[int] | None:
    """Backward visiting order of `num_slots` packs when each (first, last) span of packs holds one sliced
    piece: runs of overlapping spans reversed, runs and untouched packs in forward order. None without
    spans (the default order). The readable reference: `solve` runs kernels.backward_runs_ranks, the same
    for every rank in one numba call (tests compare the two)."""
    if not spans:
        return None
    reach = list(range(num_slots))
    for a, b in spans:
        reach[a] = max(reach[a], b)
    order: list[int] = []
    s = 0
    while s < num_slots:
        end = reach[s]
        t = s
        while t <= end:
            end = max(end, reach[t])
            t += 1
        order.extend(range(end, s - 1, -1))
        s = end + 1
    return order


class SlimPackPlanner(PackingPlanner):
    name = "slimpack"

    def __init__(self, config: PlanConfig, *, dp_merge: bool = True, factor: int = 4, min_slice: int | None = None,
                 run_share: float = 0.0, model: CostModel | None = None) -> None:
        super().__init__(config, model)
        self.run_share = run_share  # > 0: runs bounded to max(pp, run_share x packs) packs (`auto`'s memory fallback)
        self.dp_merge = dp_merge
        self.factor = factor
        self.min_slice = min_slice or int(self.model.coeffs[0])
        self._phase_one: tuple | None = None
        self._by_rank: tuple | None = None

    def phase_one(self, pieces: Pieces, model: CostModel) -> tuple:
        """Workloads, the DP dispatch (DP-Merge groups included) and each rank's tokens and minimum packs: the
        part of `solve` that does not depend on V, kept for the last Pieces seen (`auto` solves the same
        pieces at several V; Pieces are not modified after they are made)."""
        if self._phase_one is not None and self._phase_one[0] is pieces and self._phase_one[1] is model:
            return self._phase_one[2]
        dp, cap = self.config.parallel.dp, self.config.max_tokens
        slicing = self.config.allow_slicing
        n = len(pieces)
        f, b = doc_time_split(model.coeffs, pieces.length)
        share = float(f.sum()) / dp if n else 0.0
        merge_share = share if (self.dp_merge and dp > 1 and share > 0) else np.inf
        rank, members, offs = lpt_dispatch(f, dp, merge_share, pieces.length)
        merged = np.nonzero(offs[1:] > offs[:-1])[0]
        merged = merged[np.argsort(-f[merged], kind="stable")].tolist()  # heaviest first, ties in index order
        own = rank >= 0
        tokens = np.bincount(rank[own], weights=pieces.length[own], minlength=dp).astype(np.float64)
        # packs a rank needs at least: its own tokens under the cap, plus each merged piece's minimum slices
        need = np.where(tokens > 0, np.ceil(tokens / cap), 0).astype(np.int64)
        for i in merged:
            grp = members[offs[i] : offs[i + 1]]
            tokens[grp] += pieces.length[i] / len(grp)
            need[grp] += math.ceil(pieces.length[i] / cap) if slicing else 1
        out = (f, b, rank, members, offs, merged, tokens, need)
        self._phase_one = (pieces, model, out)
        return out

    def solve(self, pieces: Pieces, layout: StepLayout, model: CostModel) -> Packing:
        cfg = self.config
        dp, pp, cap = cfg.parallel.dp, cfg.parallel.pp, cfg.max_tokens
        slicing = cfg.allow_slicing
        if not slicing:
            check_cap(pieces, cap, self.name)
        n = len(pieces)
        f, b, rank, members, offs, merged, tokens, need = self.phase_one(pieces, model)
        v = layout.micro_batches or cfg.num_micro_batches
        if not v:
            v = default_packs(float(tokens.max()) if n else 0.0, math.ceil(n / dp), pp, cap, self.factor)
        v = max(v, int(need.max()) if n else 1)
        for attempt in range(200):
            out = self._pack(pieces, model, f, b, rank, members, offs, merged, v, attempt)
            if out is not None:
                return out
            v += max(1, v // 8)
        raise RuntimeError(f"slimpack: no packing found for {n} pieces up to {v} micro-batches per rank")

    def _place_merged(self, pieces, c, f, rank, members, offs, merged, v, attempt):
        """The DP-Merge pieces, before each rank packs its own: each on the earliest run of pack positions free on
        every rank of its group, leaving each rank packs for its own pieces. Returns (slot, segments, groups,
        sliced spans, micro-batch count), or None when a piece finds no room."""
        cfg = self.config
        dp, cap = cfg.parallel.dp, cfg.max_tokens
        slicing = cfg.allow_slicing
        fload = np.bincount(rank[rank >= 0], weights=f[rank >= 0], minlength=dp).astype(np.float64)
        for i in merged:
            g = offs[i + 1] - offs[i]
            fload[members[offs[i] : offs[i + 1]]] += f[i] / g
        slot = np.full((dp, v), -1, np.int64)  # micro-batch id at each rank position
        seg: list[tuple[np.ndarray, ...]] = []  # (doc, start, end, af, mb) arrays
        groups: dict[int, list[int]] = {}
        spans: list[tuple[int, int, int]] = []  # (rank, first pack, last pack) of each sliced piece
        nmb = 0
        # packs each rank keeps free for its own pieces: enough for their tokens under the cap, plus one more
        # per failed attempt (fragmentation can need more than the token count says)
        own_tok = np.bincount(rank[rank >= 0], weights=pieces.length[rank >= 0], minlength=dp)
        reserve = np.where(own_tok > 0, np.ceil(own_tok / cap).astype(np.int64) + attempt, 0)
        for i in merged:
            grp = members[offs[i] : offs[i + 1]]
            g = len(grp)
            l = int(pieces.length[i])
            k_min = math.ceil(l / cap) if slicing else 1
            # its share of the group's packs: as many as its share of the members' forward load (one whole
            # micro-batch without slicing); after failed attempts only as many as the cap needs, so that a
            # large enough v always fits (the proportional share grows with v)
            tries = [k_min]
            if slicing and attempt < 3:
                k = max(k_min, round(v * (f[i] / g) / float(fload[grp].mean())))
                k = min(k, max(k_min, l // self.min_slice))  # no slice shorter than min_slice unless the cap asks
                if k > k_min:
                    tries.insert(0, k)  # the proportional share if it fits, else the fewest slices
            free = slot[grp] < 0
            free_all = free.all(axis=0)
            spare = int((free.sum(axis=1) - reserve[grp]).min())
            start = -1
            for k in tries:
                while True:
                    cuts = equal_cost_cuts(c, l, k, 1.0)
                    if np.diff(cuts).max() <= cap or k >= l:
                        break
                    k += 1
                # the earliest run of k positions free on every rank of the group, leaving each its reserve
                if k <= spare:
                    run = 0
                    for pos in range(v):
                        run = run + 1 if free_all[pos] else 0
                        if run == k:
                            start = pos - k + 1
                            break
                if start >= 0:
                    break
            if start < 0:
                return None
            off = int(pieces.offset[i])
            ids = np.arange(nmb, nmb + k)
            seg.append((np.full(k, pieces.doc[i]), off + cuts[:-1], off + cuts[1:], np.full(k, off), ids))
            members_list = grp.tolist()
            for t, m in enumerate(ids.tolist()):
                groups[m] = members_list
            slot[grp, start : start + k] = ids
            if k > 1:
                for r in grp.tolist():
                    spans.append((r, start, start + k - 1))
            nmb += k
        return slot, seg, groups, spans, nmb

    def _pack(self, pieces, model, f, b, rank, members, offs, merged, v, attempt=0) -> Packing | None:
        cfg = self.config
        dp, cap = cfg.parallel.dp, cfg.max_tokens
        c = model.coeffs
        slicing = cfg.allow_slicing
        placed = self._place_merged(pieces, c, f, rank, members, offs, merged, v, attempt)
        if placed is None:
            return None
        slot, seg, groups, spans, nmb = placed
        # each rank's own pieces, heaviest forward workload first (ties in index order), from one sort (kept
        # with phase one's result: it depends only on the dispatch)
        if self._by_rank is not None and self._by_rank[0] is rank:
            by_rank, bounds = self._by_rank[1:]
        else:
            # np.lexsort((np.arange(n), -f, rank)) by two counting sorts: f is a function of the length
            by_work = desc_order_by(f, pieces.length)
            by_rank = by_work[grouped_order(rank[by_work] + 1, dp + 1)]
            bounds = np.searchsorted(rank[by_rank], np.arange(dp + 1))
            self._by_rank = (rank, by_rank, bounds)
        # phase two on every rank in one numba call; each rank's free positions, row-major, get the next ids
        free = slot < 0
        kp = free.sum(axis=1).astype(np.int64)
        own = rank >= 0
        fsum = np.bincount(rank[own], weights=f[own], minlength=dp)
        bsum = np.bincount(rank[own], weights=b[own], minlength=dp)
        div = np.maximum(kp, 1)
        failed, sr, spc, ss, se, sk = slim_pack_ranks(
            c, np.ascontiguousarray(pieces.length[by_rank]), bounds.astype(np.int64), kp, fsum / div, bsum / div,
            cap, self.min_slice, slicing, max(cfg.parallel.pp, int(self.run_share * v)) if self.run_share > 0 else 0,
        )
        if failed >= 0:
            return None
        rows, cols = np.nonzero(free)
        slot[rows, cols] = nmb + np.arange(len(rows))
        free_off = np.zeros(dp + 1, np.int64)
        np.cumsum(kp, out=free_off[1:])
        *own, at, p, is_slice = own_segments(by_rank, spc, ss, se, sk, sr, free_off, pieces.doc, pieces.offset,
                                             pieces.length, nmb)
        seg.append(tuple(own))
        nmb += len(rows)
        sliced = np.nonzero(is_slice)[0]
        span_arr = np.array(spans, np.int64).reshape(-1, 3)
        if len(sliced):  # first and last pack position of each sliced piece (its slices are in order)
            p_sl = p[sliced]
            pos = cols[at[sliced]]
            _, first_at = np.unique(p_sl, return_index=True)
            last_at = len(p_sl) - 1 - np.unique(p_sl[::-1], return_index=True)[1]
            span_arr = np.concatenate([span_arr, np.stack([sr[sliced][first_at], pos[first_at], pos[last_at]], axis=1)])
        cat = [np.concatenate([s[j] for s in seg]).astype(np.int64, copy=False) if seg else np.zeros(0, np.int64)
               for j in range(5)]
        # backward_runs of each rank, in one numba call
        order, has = backward_runs_ranks(v, dp, np.ascontiguousarray(span_arr[:, 0]), np.ascontiguousarray(span_arr[:, 1]),
                                         np.ascontiguousarray(span_arr[:, 2]))
        bwd = [row if h else None for row, h in zip(order.tolist(), has.tolist())]
        return Packing(
            seg_doc=cat[0], seg_start=cat[1], seg_end=cat[2], seg_af=cat[3], seg_mb=cat[4], rank_mbs=slot,
            groups=groups, backward_order=bwd if any(o is not None for o in bwd) else None, strategy=self.name,
        )


class SlimPackOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """SlimPackPlanner's knobs (PlanConfig.planner_options["slimpack"])."""

    dp_merge: bool = True  # a piece heavier than a rank's share is sliced across DP ranks
    factor: int = 4  # packs per pipeline stage its default count aims for
    min_slice: int | None = None  # fewest tokens in a slice (None: the cost model's own floor)
    run_share: float = 0.0  # > 0: runs of linked packs bounded to this share of a rank's packs


def _auto_count(planner: "SlimPackPlanner", pieces: Pieces, config: PlanConfig) -> int:
    dp = config.parallel.dp
    return default_packs(pieces.total_tokens / dp, math.ceil(len(pieces) / dp), config.parallel.pp, config.max_tokens,
                         planner.factor)


@register_planner("slimpack", slices=True, options=SlimPackOptions, summary="SlimPack: slices + asymmetric balance",
                  report_order=30, auto=AutoUse(order=30, default_count=_auto_count, pipeline_ladder=(2, 4, 8),
                                                defer="default", bounded_runs_option="run_share"))
def _make(config: PlanConfig, options: SlimPackOptions, model: CostModel) -> Planner:
    return SlimPackPlanner(config, model=model, **msgspec.structs.asdict(options))
