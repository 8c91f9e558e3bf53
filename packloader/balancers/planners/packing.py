"""Python side of the planners: the step's pieces as arrays in, a StepPlan out.

The numba kernels (beside each planner) work on flat arrays; this module turns a Window plus the planner's queue into
those arrays (`Pieces`), and the kernels' answer (`Packing`: segments, micro-batch ids, ranks, DP-Merge
groups, backward orders, what stays queued) into the msgspec StepPlan with costs filled in.

Flushing (plan every queued piece now: the end of an epoch, `packloader plan` after its last step) is per call,
`StepLayout.flush`, never carried in the state.
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from numba import njit

from packloader.balancers.cost.coeffs import (
    doc_time_split,
    lin_times,
    microbatch_times_by_id,
    microbatch_times_csr,
    segment_times_kernel,
)
from packloader.balancers.cost.lookup import cost_model_for  # noqa: F401 (re-exported)
from packloader.balancers.cost.model import CostModel
from packloader.balancers.planners.registry import Window  # noqa: F401 (re-exported)
from packloader.contracts import MicroBatch, PlannerState, QueuedDoc, RankPlan, Segment, StepPlan


@dataclass(frozen=True)
class Pieces:
    """What a step plans: the queued pieces first (oldest first), then the newly drawn ones."""

    doc: np.ndarray
    offset: np.ndarray
    length: np.ndarray
    drawn: np.ndarray  # step at which each piece was drawn
    _split: tuple | None = field(default=None, init=False, repr=False, compare=False)

    def time_split(self, coeffs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """`doc_time_split` of the pieces' lengths under `coeffs`, kept for the last coeffs asked: `auto` and its
        candidates all ask for the same one (1-2 ms each at DP 1024). Shared arrays: read them, never write."""
        hit = self._split
        if hit is not None and hit[0] is coeffs:
            return hit[1], hit[2]
        f, b = doc_time_split(coeffs, self.length)
        object.__setattr__(self, "_split", (coeffs, f, b))
        return f, b

    @classmethod
    def of(cls, window: Window, state: PlannerState, step: int) -> "Pieces":
        q = state.queued
        n = len(window.doc)
        return cls(
            np.concatenate([np.array([d.doc for d in q], np.int64), np.asarray(window.doc, np.int64)]),
            np.concatenate([np.array([d.offset for d in q], np.int64), np.asarray(window.offset, np.int64)]),
            np.concatenate([np.array([d.length for d in q], np.int64), np.asarray(window.length, np.int64)]),
            np.concatenate([np.array([d.drawn_step for d in q], np.int64), np.full(n, step, np.int64)]),
        )

    def __len__(self) -> int:
        return len(self.doc)

    @property
    def total_tokens(self) -> int:
        return int(self.length.sum())

    def queue(self, idx: np.ndarray) -> list[QueuedDoc]:
        """QueuedDoc entries for the given pieces, in the given order."""
        idx = np.asarray(idx, np.int64)
        return list(map(QueuedDoc, *(a[idx].tolist() for a in (self.doc, self.offset, self.length, self.drawn))))

    def held(self, idx: np.ndarray) -> "QueuedPieces":
        """The given pieces held back, as `queue(idx)` lists them but made only when read (`QueuedPieces`)."""
        return QueuedPieces(self, np.asarray(idx, np.int64))


class QueuedPieces(Sequence):
    """Pieces a packing holds back, kept as the step's arrays and their indices: `auto` scores a candidate from
    their lengths and drawn steps, and only the chosen packing's become QueuedDoc objects (wlb holds ~13K at DP
    1024: ~4 ms a step made for a candidate that mostly loses). Reads like `Pieces.queue(idx)`'s list."""

    def __init__(self, pieces: Pieces, idx: np.ndarray) -> None:
        self.length = pieces.length[idx]
        self.drawn = pieces.drawn[idx]
        self._pieces, self._idx, self._docs = pieces, idx, None

    def docs(self) -> list[QueuedDoc]:
        if self._docs is None:
            self._docs = self._pieces.queue(self._idx)
        return self._docs

    def __len__(self) -> int:
        return len(self._idx)

    def __getitem__(self, i):
        return self.docs()[i]

    def __iter__(self):
        return iter(self.docs())

    def __eq__(self, other: object) -> bool:
        return list(self) == list(other) if isinstance(other, Sequence) else NotImplemented


def check_cap(pieces: Pieces, cap: int, strategy: str) -> None:
    if len(pieces) and int(pieces.length.max()) > cap:
        raise ValueError(
            f"{strategy}: a piece of {int(pieces.length.max())} tokens exceeds max_tokens={cap}; cut documents at a "
            f"context length <= max_tokens, or allow slicing and use the slimpack (or auto) strategy"
        )


# segments made per chunk in `Packing.to_step_plan`: the chunk's column lists (64 KiB each) stay below glibc's
# mmap threshold, so each chunk reuses the last one's freed memory instead of ~1.4 MB lists of fresh pages at DP
# 1024 (~1,300 fewer page faults and ~2 ms a step on docs)
SEGMENT_CHUNK = 8192


@dataclass
class Packing:
    """A step plan as arrays.

    Segment k is tokens seg_start[k]..seg_end[k]-1 of document seg_doc[k], attending from seg_af[k], in
    micro-batch seg_mb[k]; segments of one micro-batch keep their relative order. rank_mbs[r] lists the
    micro-batch ids of rank r in forward order (all rows the same length). A DP-Merge micro-batch appears in
    the row of every rank of its group, at the same position; `groups` maps its id to the sorted ranks.
    """

    seg_doc: np.ndarray
    seg_start: np.ndarray
    seg_end: np.ndarray
    seg_af: np.ndarray
    seg_mb: np.ndarray
    rank_mbs: np.ndarray
    groups: dict[int, list[int]] = field(default_factory=dict)
    backward_order: list[list[int] | None] | None = None
    queued: list[QueuedDoc] | QueuedPieces = field(default_factory=list)
    delayed: list[int] = field(default_factory=list)
    extra: dict[str, list[int]] = field(default_factory=dict)
    strategy: str = ""
    mb_fwd: np.ndarray | None = None  # per-rank seconds of each micro-batch (after `costs`)
    mb_bwd: np.ndarray | None = None
    schedule: int = -1  # the simulator's schedule code `auto` scored it under (planners.schedule_choice)

    @property
    def num_micro_batches(self) -> int:
        return int(self.rank_mbs.max()) + 1 if self.rank_mbs.size else 0

    def costs(self, model: CostModel) -> "Packing":
        """Fill mb_fwd / mb_bwd: the cost model's time of each micro-batch on one rank (a DP-Merge micro-batch
        costs each member its share, as CostModel.microbatch_times defines it)."""
        nmb = self.num_micro_batches
        if not self.groups:  # no DP-Merge shares: sum each micro-batch's segments as they come, no sort
            self.mb_fwd, self.mb_bwd = microbatch_times_by_id(
                model.coeffs, self.seg_end - self.seg_start, self.seg_start - self.seg_af, self.seg_mb, nmb)
            return self
        order = np.argsort(self.seg_mb, kind="stable")
        q = (self.seg_end - self.seg_start)[order]
        p = (self.seg_start - self.seg_af)[order]
        offs = np.zeros(nmb + 1, np.int64)
        np.cumsum(np.bincount(self.seg_mb, minlength=nmb), out=offs[1:])
        f, b = microbatch_times_csr(model.coeffs, q, p, offs)
        # DP-Merge: each member runs 1/g of the attention and the linear part of n/g tokens
        c = model.coeffs
        af, ab = segment_times_kernel(c, q, p)
        seg_mb = self.seg_mb[order]
        ids = np.fromiter(self.groups.keys(), np.int64, len(self.groups))
        g = np.fromiter((len(v) for v in self.groups.values()), np.float64, len(self.groups))
        n = np.bincount(seg_mb, weights=q, minlength=nmb)[ids] / g
        for arr, attn, bwd in ((f, af, False), (b, ab, True)):
            arr[ids] = np.bincount(seg_mb, weights=attn, minlength=nmb)[ids] / g + lin_times(c, n, bwd)
        self.mb_fwd, self.mb_bwd = f, b
        return self

    def drop_empty_slots(self) -> "Packing":
        """The same plan with the empty micro-batches that no rank needs removed: every rank must run the same
        count (the frameworks' micro-batches per step are one number for all DP ranks), so a rank keeps as many
        empty ones as it has fewer filled micro-batches than the fullest rank, and the others go (each rank drops
        its last ones, at least one micro-batch stays). With DP-Merge groups, whose micro-batch sits at the same
        position on every member, only positions empty on every rank go. Forward order and backward orders are
        kept (renumbered); costs are per micro-batch id and stay valid."""
        dp, v = self.rank_mbs.shape
        if v <= 1 or dp == 0:
            return self
        used = np.zeros(int(self.rank_mbs.max()) + 1, bool)
        used[self.seg_mb] = True
        empty = ~used[self.rank_mbs]
        if self.groups:
            drop = np.broadcast_to(empty.all(axis=0), empty.shape)  # a group's micro-batch: never all empty
            k = int(drop[0].sum())
        else:
            k = min(int(empty.sum(axis=1).min()), v - 1)
            drop = empty & (np.cumsum(empty[:, ::-1], axis=1)[:, ::-1] <= k)  # each rank's last k empty slots
        if k == 0:
            return self
        keep = ~drop
        rank_mbs = self.rank_mbs[keep].reshape(dp, v - k)
        order = self.backward_order
        if order is not None:
            order = [None if o is None else [int(new[q]) for q in o if keep[r, q]]
                     for r, o, new in zip(range(dp), order, np.cumsum(keep, axis=1) - 1)]
        return dataclasses.replace(self, rank_mbs=rank_mbs, backward_order=order)

    def to_step_plan(self, step: int) -> StepPlan:
        # the plan's objects all stay alive, so a garbage collection while they are made frees nothing; at DP
        # 1024 (~130K segments, ~20K containers) the collections their allocations set off cost 10-30 ms a step,
        # more while earlier plans are held: collection waits until they are built
        paused = gc.isenabled()
        gc.disable()
        try:
            return self._step_plan(step)
        finally:
            if paused:
                gc.enable()

    def _step_plan(self, step: int) -> StepPlan:
        nmb = self.num_micro_batches
        # the segments grouped by micro-batch (a stable sort keeps their order within one), built in one pass and
        # sliced: at DP 1024 a step holds ~130K segments, and a loop of appends cost twice as long
        mb = self.seg_mb
        if mb.size and not 0 <= int(mb.min()) <= int(mb.max()) < nmb:
            raise ValueError(f"a segment in micro-batch {int(mb.max())} or {int(mb.min())}, but the ranks list "
                             f"micro-batches 0..{nmb - 1}")
        order = None if mb.size < 2 or bool((mb[1:] >= mb[:-1]).all()) else grouped_order(mb, nmb)
        # whole pieces attend from their start: one list of ints for both fields (fewer objects, ~2 ms at DP 1024)
        whole = self.seg_af is self.seg_start or np.array_equal(self.seg_af, self.seg_start)
        flat: list[Segment] = []
        for lo in range(0, mb.size, SEGMENT_CHUNK):  # chunks: the columns' lists reuse freed memory, no fresh pages
            at = slice(lo, lo + SEGMENT_CHUNK) if order is None else order[lo : lo + SEGMENT_CHUNK]
            cols = [c[at].tolist() for c in (self.seg_doc, self.seg_start, self.seg_end)]
            cols.append(cols[1] if whole else self.seg_af[at].tolist())
            flat += map(Segment, *cols)
        ends = np.cumsum(np.bincount(mb, minlength=nmb)).tolist() if mb.size else [0] * nmb
        segs = [flat[b:e] for b, e in zip([0, *ends[:-1]], ends)]
        fwd = self.mb_fwd.tolist() if self.mb_fwd is not None else [0.0] * nmb
        bwd = self.mb_bwd.tolist() if self.mb_bwd is not None else [0.0] * nmb
        if self.groups:
            mbs = [MicroBatch(segments=s, fwd_cost=f, bwd_cost=b, dp_group=self.groups.get(m))
                   for m, (s, f, b) in enumerate(zip(segs, fwd, bwd))]
        else:
            mbs = [MicroBatch(segments=s, fwd_cost=f, bwd_cost=b) for s, f, b in zip(segs, fwd, bwd)]
        orders = self.backward_order if self.backward_order is not None else [None] * len(self.rank_mbs)
        ranks = [RankPlan(micro_batches=[mbs[m] for m in row], backward_order=o)
                 for row, o in zip(self.rank_mbs.tolist(), orders)]
        return StepPlan(step=step, ranks=ranks, delayed=sorted(set(self.delayed)), planner=self.strategy)

    def state(self) -> PlannerState:
        q = self.queued
        return PlannerState(queued=q.docs() if isinstance(q, QueuedPieces) else q, extra=self.extra)


def whole_pieces_packing(pieces: Pieces, piece_mb: np.ndarray, rank_mbs: np.ndarray, **kw) -> Packing:
    """A Packing where every planned piece is one whole segment (no slices): piece i in micro-batch piece_mb[i]
    (pieces with -1 are not in this step's plan). Segments keep the pieces' order."""
    sel = np.nonzero(piece_mb >= 0)[0]
    start = pieces.offset[sel]
    return Packing(
        seg_doc=pieces.doc[sel], seg_start=start, seg_end=start + pieces.length[sel], seg_af=start,
        seg_mb=piece_mb[sel], rank_mbs=rank_mbs, **kw,
    )


@njit(cache=True, nogil=True)
def grouped_order(mb, nmb):
    """np.argsort(mb, kind="stable") for micro-batch ids 0..nmb-1, by counting: O(n + nmb)."""
    start = np.zeros(nmb + 1, dtype=np.int64)
    for i in range(mb.shape[0]):
        start[mb[i] + 1] += 1
    for m in range(nmb):
        start[m + 1] += start[m]
    out = np.empty(mb.shape[0], dtype=np.int64)
    for i in range(mb.shape[0]):
        out[start[mb[i]]] = i
        start[mb[i]] += 1
    return out


@njit(cache=True)
def _listings(rank_mbs):
    """Where each micro-batch id is listed (a DP-Merge one on every member): CSR offsets by id, then the rank and
    position of each listing, in (rank, position) order."""
    dp = rank_mbs.shape[0]
    v = rank_mbs.shape[1]
    nmb = 0
    for r in range(dp):
        for j in range(v):
            if rank_mbs[r, j] + 1 > nmb:
                nmb = rank_mbs[r, j] + 1
    lst_off = np.zeros(nmb + 1, dtype=np.int64)
    for r in range(dp):
        for j in range(v):
            lst_off[rank_mbs[r, j] + 1] += 1
    for m in range(nmb):
        lst_off[m + 1] += lst_off[m]
    lst_r = np.empty(dp * v, dtype=np.int64)
    lst_p = np.empty(dp * v, dtype=np.int64)
    fill = lst_off[:-1].copy()
    for r in range(dp):
        for j in range(v):
            m = rank_mbs[r, j]
            lst_r[fill[m]] = r
            lst_p[fill[m]] = j
            fill[m] += 1
    return lst_off, lst_r, lst_p


@njit(cache=True)
def _sliced_doc_segments(seg_doc, seg_start, seg_af, nsl):
    """The segments of documents that have a slice (the ones a slice can continue), in index order: a flag per
    document id when the step's ids are dense enough, else a sorted search."""
    ns = seg_doc.shape[0]
    lo_doc = seg_doc.min()
    span = seg_doc.max() - lo_doc + 1
    if span <= 64 * ns:  # a flag per document id of the step
        sliced_doc = np.zeros(span, dtype=np.bool_)
        for i in range(ns):
            if seg_af[i] < seg_start[i]:
                sliced_doc[seg_doc[i] - lo_doc] = True
        cand = np.empty(ns, dtype=np.int64)
        nc = 0
        for i in range(ns):
            if sliced_doc[seg_doc[i] - lo_doc]:
                cand[nc] = i
                nc += 1
    else:  # ids too sparse for flags: a sorted search
        sdocs = np.empty(nsl, dtype=np.int64)
        k = 0
        for i in range(ns):
            if seg_af[i] < seg_start[i]:
                sdocs[k] = seg_doc[i]
                k += 1
        sdocs = np.sort(sdocs)
        at = np.searchsorted(sdocs, seg_doc)
        cand = np.empty(ns, dtype=np.int64)
        nc = 0
        for i in range(ns):
            if at[i] < nsl and sdocs[at[i]] == seg_doc[i]:
                cand[nc] = i
                nc += 1
    return cand[:nc]


@njit(cache=True, nogil=True)
def slice_edges_kernel(seg_doc, seg_start, seg_end, seg_af, seg_mb, rank_mbs):
    """Per-rank slice edges of a plan given as segment arrays (what `packing_measures.slice_edges_prefix` returns): for
    each slice (attend_from < start), an edge from the micro-batch holding the segment of its document that
    ends where the slice starts to the slice's micro-batch, on every rank listing the slice's micro-batch (a
    DP-Merge one is listed by each member) that also lists the source; positions local to the rank, edges
    sorted by (rank, source, destination); the slice's prefix tokens (start - attend_from) with each.
    Returns (CSR offsets per rank, source positions, destination positions, prefixes)."""
    dp = rank_mbs.shape[0]
    v = rank_mbs.shape[1]
    ns = seg_doc.shape[0]
    offs = np.zeros(dp + 1, dtype=np.int64)
    nsl = 0
    for i in range(ns):
        if seg_af[i] < seg_start[i]:
            nsl += 1
    if nsl == 0:
        return offs, np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    # (doc, end) of the segments of documents that have slices, sorted: the segment a slice continues (the
    # other documents' segments, most of a step's, are left out of the sort)
    cand = _sliced_doc_segments(seg_doc, seg_start, seg_af, nsl)
    nc = cand.shape[0]
    key_end = np.empty(nc, dtype=np.int64)
    for j in range(nc):
        key_end[j] = seg_doc[cand[j]] * (1 << 31) + seg_end[cand[j]]
    by_key = np.argsort(key_end)  # keys are unique (segments of a document do not overlap): no need for stable
    order = cand[by_key]
    sorted_keys = key_end[by_key]
    ns_sorted = nc
    lst_off, lst_r, lst_p = _listings(rank_mbs)
    cap = 0
    for i in range(ns):
        if seg_af[i] < seg_start[i]:
            m = seg_mb[i]
            cap += lst_off[m + 1] - lst_off[m]
    er = np.empty(cap, dtype=np.int64)
    es = np.empty(cap, dtype=np.int64)
    ed = np.empty(cap, dtype=np.int64)
    ep = np.empty(cap, dtype=np.int64)
    ne = 0
    for i in range(ns):
        if seg_af[i] >= seg_start[i]:
            continue
        want = seg_doc[i] * (1 << 31) + seg_start[i]
        at = np.searchsorted(sorted_keys, want)
        if at >= ns_sorted or sorted_keys[at] != want:
            continue
        src = seg_mb[order[at]]
        dst = seg_mb[i]
        if src == dst:
            continue
        for a in range(lst_off[dst], lst_off[dst + 1]):
            r = lst_r[a]
            sp = -1
            for b2 in range(lst_off[src], lst_off[src + 1]):
                if lst_r[b2] == r:
                    sp = lst_p[b2]
                    break
            if sp < 0:
                continue
            er[ne] = r
            es[ne] = sp
            ed[ne] = lst_p[a]
            ep[ne] = seg_start[i] - seg_af[i]
            ne += 1
    key = np.empty(ne, dtype=np.int64)
    for k in range(ne):
        key[k] = (er[k] * v + es[k]) * v + ed[k]
    o = np.argsort(key, kind="mergesort")
    s_out = np.empty(ne, dtype=np.int64)
    d_out = np.empty(ne, dtype=np.int64)
    p_out = np.empty(ne, dtype=np.int64)
    for k in range(ne):
        s_out[k] = es[o[k]]
        d_out[k] = ed[o[k]]
        p_out[k] = ep[o[k]]
        offs[er[o[k]] + 1] += 1
    for r in range(dp):
        offs[r + 1] += offs[r]
    return offs, s_out, d_out, p_out
