"""SlimPack (seed 002): slice-level packing into MicroPacks, asymmetric forward/backward balance, DP-Merge.

Per step:

1. Phase one (equal per-DP forward capacity): pieces, heaviest forward workload first, go to the least
   loaded DP rank. DP-Merge: a piece whose forward workload alone exceeds a rank's share (total / DP) goes to
   a group of g = ceil(work / share) DP ranks (the least loaded) that run it together as context parallelism.
2. Phase two, per rank, V MicroPacks (the same V on every rank, as the packloader contract asks; each rank
   has its own budget = its forward load / V):
   * Slim: a piece heavier than the budget (or longer than max_tokens) is cut into consecutive slices, each
     filling the current pack to the budget (a slice attends to the piece's earlier tokens: attend_from is
     the piece's first token). Its slices land in increasing packs of the same rank and step.
   * Mix: the pack holding a piece's last slice is filled with other pieces (or the next piece's slices).
   * Pack: the remaining pieces, whole, each to the pack whose forward and backward loads (each relative to
     its own budget) stay lowest: forward and backward balanced separately (asymmetric partitioning).
   A DP-Merge piece is cut into k slices of equal forward cost (k from the group's budget and the cap); its
   micro-batches come first on every rank of the group, at the same positions.
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

V is config.num_micro_batches, or by default enough packs for the cap with slack, at least 4 x PP when
pipelining (SlimPack's micropack factor; `auto` searches it by simulation). Without config.allow_slicing no
piece is sliced (a piece over the cap is then an error) and a DP-Merge micro-batch holds its piece whole.
"""

from __future__ import annotations

import math

import numpy as np

from packloader.balancers.assemble import Packing, Pieces, carried_extra, check_cap, cost_model_for
from packloader.balancers.cost import doc_time_split
from packloader.balancers.kernels import equal_cost_cuts, lpt_dispatch, slim_pack_rank
from packloader.balancers.registry import Planner, Window, register_planner
from packloader.contracts import PlanConfig, PlannerState, StepPlan


def default_packs(tokens_per_rank: float, dp_pieces: int, pp: int, cap: int, factor: int = 4) -> int:
    base = max(1, math.ceil(tokens_per_rank / cap))
    if pp > 1:
        return max(base + 1, min(factor * pp, max(base + 1, dp_pieces)))
    return base


def backward_runs(num_slots: int, spans: list[tuple[int, int]]) -> list[int] | None:
    """Backward visiting order of `num_slots` packs when each (first, last) span of packs holds one sliced
    piece: runs of overlapping spans reversed, runs and untouched packs in forward order. None without
    spans (the default order)."""
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


class SlimPackPlanner:
    name = "slimpack"

    def __init__(self, config: PlanConfig, *, dp_merge: bool = True, factor: int = 4, min_slice: int | None = None) -> None:
        self.config = config
        self.model = cost_model_for(config)
        self.dp_merge = dp_merge
        self.factor = factor
        self.min_slice = min_slice or int(self.model.coeffs[0])

    def solve(self, pieces: Pieces, step: int, num_micro_batches: int | None = None) -> Packing:
        cfg = self.config
        dp, pp, cap = cfg.parallel.dp, cfg.parallel.pp, cfg.max_tokens
        slicing = cfg.allow_slicing
        if not slicing:
            check_cap(pieces, cap, self.name)
        c = self.model.coeffs
        n = len(pieces)
        f, b = doc_time_split(c, pieces.length)
        share = float(f.sum()) / dp if n else 0.0
        merge_share = share if (self.dp_merge and dp > 1 and share > 0) else np.inf
        rank, members, offs = lpt_dispatch(f, dp, merge_share)
        merged = [i for i in np.argsort(-f, kind="stable") if offs[i + 1] > offs[i]]
        tokens = np.bincount(rank[rank >= 0], weights=pieces.length[rank >= 0], minlength=dp).astype(np.float64)
        for i in merged:
            tokens[members[offs[i] : offs[i + 1]]] += pieces.length[i] / (offs[i + 1] - offs[i])
        v = num_micro_batches or cfg.num_micro_batches
        if not v:
            v = default_packs(float(tokens.max()) if n else 0.0, math.ceil(n / dp), pp, cap, self.factor)
        for _ in range(200):
            out = self._pack(pieces, f, b, rank, members, offs, merged, v)
            if out is not None:
                return out
            v += max(1, v // 8)
        raise RuntimeError(f"slimpack: no packing found for {n} pieces up to {v} micro-batches per rank")

    def _pack(self, pieces, f, b, rank, members, offs, merged, v) -> Packing | None:
        cfg = self.config
        dp, cap = cfg.parallel.dp, cfg.max_tokens
        c = self.model.coeffs
        slicing = cfg.allow_slicing
        fload = np.bincount(rank[rank >= 0], weights=f[rank >= 0], minlength=dp).astype(np.float64)
        for i in merged:
            g = offs[i + 1] - offs[i]
            fload[members[offs[i] : offs[i + 1]]] += f[i] / g
        slot = np.full((dp, v), -1, np.int64)  # micro-batch id at each rank position
        used = np.zeros(dp, np.int64)
        seg: list[tuple[np.ndarray, ...]] = []  # (doc, start, end, af, mb) arrays
        groups: dict[int, list[int]] = {}
        spans: list[list[tuple[int, int]]] = [[] for _ in range(dp)]
        nmb = 0
        for i in merged:
            grp = members[offs[i] : offs[i + 1]]
            g = len(grp)
            l = int(pieces.length[i])
            start = int(used[grp].max())
            k_min = math.ceil(l / cap) if slicing else 1
            # its share of the group's packs: as many as its share of the members' forward load (one whole
            # micro-batch without slicing)
            k = max(k_min, min(v - start, round(v * (f[i] / g) / float(fload[grp].mean())))) if slicing else 1
            if start + k_min > v:
                return None
            while True:
                cuts = equal_cost_cuts(c, l, k, 1.0)
                if np.diff(cuts).max() <= cap or k >= l:
                    break
                k += 1
            if start + k > v:
                return None
            off = int(pieces.offset[i])
            ids = np.arange(nmb, nmb + k)
            seg.append((np.full(k, pieces.doc[i]), off + cuts[:-1], off + cuts[1:], np.full(k, off), ids))
            for t, m in enumerate(ids):
                groups[int(m)] = [int(r) for r in grp]
                slot[grp, start + t] = m
            used[grp] = start + k
            if k > 1:
                for r in grp:
                    spans[r].append((start, start + k - 1))
            nmb += k
        for r in range(dp):
            own = np.nonzero(rank == r)[0]
            free = np.nonzero(slot[r] < 0)[0]
            if len(own) == 0:
                slot[r, free] = np.arange(nmb, nmb + len(free))
                nmb += len(free)
                continue
            if len(free) == 0:
                return None
            own = own[np.argsort(-f[own], kind="stable")]
            kpacks = len(free)
            budget = float(f[own].sum()) / kpacks
            bbudget = float(b[own].sum()) / kpacks
            ok, sp, ss, se, sk = slim_pack_rank(c, pieces.length[own], kpacks, budget, bbudget, cap, self.min_slice, slicing)
            if not ok:
                return None
            ids = nmb + np.arange(kpacks)
            slot[r, free] = ids
            nmb += kpacks
            p = own[sp]
            off = pieces.offset[p]
            seg.append((pieces.doc[p], off + ss, off + se, off, ids[sk]))
            sliced = np.nonzero((ss > 0) | (se < pieces.length[p]))[0]
            if len(sliced):
                first: dict[int, int] = {}
                last: dict[int, int] = {}
                for k in sliced:
                    s_pos = int(free[sk[k]])
                    first[int(p[k])] = min(first.get(int(p[k]), s_pos), s_pos)
                    last[int(p[k])] = max(last.get(int(p[k]), s_pos), s_pos)
                spans[r].extend((first[q], last[q]) for q in first)
        cat = [np.concatenate([s[j] for s in seg]).astype(np.int64) if seg else np.zeros(0, np.int64) for j in range(5)]
        bwd = [backward_runs(v, spans[r]) for r in range(dp)]
        return Packing(
            seg_doc=cat[0], seg_start=cat[1], seg_end=cat[2], seg_af=cat[3], seg_mb=cat[4], rank_mbs=slot,
            groups=groups, backward_order=bwd if any(o is not None for o in bwd) else None, strategy=self.name,
        )

    def plan(self, window: Window, state: PlannerState, step: int) -> tuple[StepPlan, PlannerState]:
        packing = self.solve(Pieces.of(window, state, step), step)
        packing.extra = carried_extra(state)
        return packing.costs(self.model).to_step_plan(step), packing.state()


@register_planner("slimpack")
def _make(config: PlanConfig) -> Planner:
    return SlimPackPlanner(config)
