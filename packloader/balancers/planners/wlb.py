"""WLB-LLM (the paper "WLB-LLM: Workload-Balance 4D Parallelism for Large Language Model Training"):
variable-length packing on total workload with multi-level outlier-delay queues.

Per step (Algorithm 1 of the paper):

1. The step's pieces are the queued ones (oldest first) and the newly drawn ones. A piece is an outlier of
   level k when its length is at least the level's threshold L_k. By default the thresholds are derived from
   the step's length distribution: L_k is the shortest length whose own workload (attention + linear, the
   cost model's `doc_time_split`) reaches `gammas[k]` times the mean workload per micro-batch of the step.
2. Outliers wait in their level's queue until it holds one per micro-batch (N = DP x V); then N of them,
   oldest first, join the step. An outlier that has waited `max_delay` steps joins regardless (a bound on
   the delay the paper leaves open), and a flush (``StepLayout.flush``) releases all.
3. Longest first, each piece goes to the micro-batch with the least workload if the token cap allows, else
   to the one with the fewest tokens, else it remains for the next step (Eq. 2's var-length packing with the
   memory cap L_max = max_tokens).
4. The N micro-batches are dealt to DP ranks, V each, heaviest first to the least loaded rank.

The queue lives in PlannerState.queued (QueuedDoc keeps the step each piece was drawn), so a resumed run
plans the same steps. V is config.num_micro_batches, or enough micro-batches of max_tokens for the step's newly
drawn tokens at `fill` occupancy (at least the pipeline depth when there are pieces for it), grown when the pieces
that run (a released round, forced pieces) need more, and at most one piece per micro-batch. Held pieces never
leave a micro-batch empty: when fewer pieces would run than there are micro-batches, the oldest held ones run
(any piece fits an empty micro-batch). Sizing V from all tokens, held ones included, left most micro-batches of
a step empty and fed back (a larger V makes the next release round larger, so more wait).
"""

from __future__ import annotations

import math

import msgspec
import numpy as np
from numba import njit

from packloader.balancers.cost.coeffs import attn_time, doc_time_split
from packloader.balancers.cost.model import CostModel
from packloader.balancers.planners.base import PackingPlanner, StepLayout
from packloader.balancers.planners.bins import (
    HEAP_MIN_BINS,
    _add_piece,
    _bin_time,
    _heap_pop,
    _sift_down,
    _sift_top,
    bin_times,
    desc_order,
)
from packloader.balancers.planners.packing import Packing, Pieces, check_cap, whole_pieces_packing
from packloader.balancers.planners.registry import AutoUse, Planner, register_planner
from packloader.contracts import PlanConfig


def default_micro_batches(tokens: int, num_pieces: int, dp: int, pp: int, cap: int, fill: float = 0.9) -> int:
    """Micro-batches per DP rank that hold `tokens` at `fill` of the cap, at least the pipeline depth when
    there are enough pieces to fill it."""
    v = max(1, math.ceil(tokens / (dp * cap * fill)))
    return max(v, min(pp, math.ceil(num_pieces / dp)))


class WLBPlanner(PackingPlanner):
    name = "wlb"

    def __init__(self, config: PlanConfig, *, gammas: tuple[float, ...] = (0.5, 1.0), max_delay: int = 2,
                 fill: float = 0.9, thresholds: tuple[int, ...] | None = None, model: CostModel | None = None) -> None:
        super().__init__(config, model)
        self.gammas = tuple(sorted(gammas))
        self.max_delay = max_delay
        self.fill = fill
        self.fixed_thresholds = tuple(sorted(thresholds)) if thresholds else None
        self._work_table: tuple[CostModel, np.ndarray] | None = None

    def thresholds(self, work_per_mb: float, model: CostModel) -> np.ndarray:
        """Length thresholds L_1 < ... < L_n: the shortest length whose workload reaches gamma_k x the mean
        micro-batch workload (binary search on the monotone cost)."""
        if self.fixed_thresholds is not None:
            return np.array(self.fixed_thresholds, np.int64)
        hi = max(self.config.context, self.config.max_tokens)
        if self._work_table is None or self._work_table[0] is not model:  # workload of every length 0..hi, once
            f, b = doc_time_split(model.coeffs, np.arange(hi + 1, dtype=np.int64))
            self._work_table = (model, f + b)
        work = self._work_table[1]
        out = []
        for g in self.gammas:
            target = g * work_per_mb
            lo_l, hi_l = 1, hi + 1  # hi + 1: no piece is that long (no outliers at this level)
            while lo_l < hi_l:
                mid = (lo_l + hi_l) // 2
                if work[mid] >= target:
                    hi_l = mid
                else:
                    lo_l = mid + 1
            out.append(lo_l)
        return np.array(out, np.int64)

    def solve(self, pieces: Pieces, layout: StepLayout, model: CostModel) -> Packing:
        cfg = self.config
        dp, pp, cap = cfg.parallel.dp, cfg.parallel.pp, cfg.max_tokens
        step, flush = layout.step, layout.flush
        check_cap(pieces, cap, self.name)
        c = model.coeffs
        pinned = layout.micro_batches or cfg.num_micro_batches
        n = len(pieces)
        drawn_now = pieces.drawn == step
        if pinned:
            v = pinned
        elif flush or not drawn_now.any():
            v = default_micro_batches(pieces.total_tokens, n, dp, pp, cap, self.fill)
        else:  # the step's own draw sets V: queued (held) tokens must not inflate it (bins left empty)
            v = default_micro_batches(int(pieces.length[drawn_now].sum()), int(drawn_now.sum()), dp, pp, cap, self.fill)
        f, b = pieces.time_split(c)
        work = f + b
        nbins = dp * v
        floor = float(model.floor()[0] + model.floor()[1])
        held = np.zeros(n, dtype=bool)
        if not flush and n:
            th = self.thresholds((float(work.sum()) + nbins * floor) / nbins, model)
            level = np.searchsorted(th, pieces.length, side="right")  # 0: not an outlier
            waited = step - pieces.drawn
            for k in range(1, len(th) + 1):
                idx = np.nonzero(level == k)[0]  # queue order: oldest first
                release = len(idx) - len(idx) % nbins  # whole rounds of one per micro-batch
                forced = idx[waited[idx] >= self.max_delay]
                held[idx[release:]] = True
                held[forced] = False
            if not pinned:  # room for what runs: a released round or forced pieces may need more micro-batches
                run = ~held
                v = max(v, default_micro_batches(int(pieces.length[run].sum()), int(run.sum()), dp, pp, cap, self.fill))
                v = min(v, max(1, math.ceil(int(run.sum()) / dp)))  # one piece each is enough (pieces <= cap)
                nbins = dp * v
            # never an empty micro-batch while a piece waits (any piece fits an empty one): release the oldest
            short = nbins - int((~held).sum())
            if short > 0:
                held[np.nonzero(held)[0][:short]] = False
        while True:
            sel = np.nonzero(~held)[0]
            assign, attn, tok = wlb_pack(c, pieces.length[sel], nbins, cap)
            if not flush or (assign >= 0).all():
                break
            v += 1  # a flush plans everything: add micro-batches until it fits
            nbins = dp * v
        piece_bin = np.full(n, -1, np.int64)
        piece_bin[sel] = assign
        bin_cost = bin_times(c, attn, tok)
        rank, pos = deal_bins(bin_cost, dp, v)
        rank_mbs = np.empty((dp, v), np.int64)
        rank_mbs[rank, pos] = np.arange(nbins)
        queued_idx = np.nonzero(piece_bin < 0)[0]
        return whole_pieces_packing(
            pieces, piece_bin, rank_mbs, queued=pieces.held(queued_idx),
            delayed=pieces.doc[queued_idx][pieces.drawn[queued_idx] == step].tolist(), strategy=self.name,
        )


class WLBOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """WLBPlanner's knobs (PlanConfig.planner_options["wlb"])."""

    gammas: tuple[float, ...] = (0.5, 1.0)  # outlier levels, as multiples of the mean micro-batch workload
    max_delay: int = 2  # steps a piece may be held back
    fill: float = 0.9  # share of the cap its default micro-batch count fills
    thresholds: tuple[int, ...] | None = None  # fixed length thresholds instead of gammas


def _auto_count(planner: "WLBPlanner", pieces: Pieces, config: PlanConfig) -> int:
    p = config.parallel
    return default_micro_batches(pieces.total_tokens, len(pieces), p.dp, p.pp, config.max_tokens, planner.fill)


@register_planner("wlb", options=WLBOptions, summary="WLB-LLM: workload packing + outlier delay", report_order=10,
                  auto=AutoUse(order=10, default_count=_auto_count, defer="counts", flush_fallback=True))
def _make(config: PlanConfig, options: WLBOptions, model: CostModel) -> Planner:
    return WLBPlanner(config, model=model, **msgspec.structs.asdict(options))


SCAN_MISSES = 32  # wlb_pack: times the fewest-tokens bin is found by a scan before its heap is built


@njit(cache=True)
def _choose_bin(tok, w_idx, l_idx, l, cap):
    """WLB's rule: the least loaded bin when the piece fits there, else the bin with the fewest tokens when it
    fits there, else -1 (the piece waits)."""
    if tok[w_idx] + l <= cap:
        return w_idx
    if tok[l_idx] + l <= cap:
        return l_idx
    return -1


@njit(cache=True)
def _wlb_pack_scan(c, lengths, nbins, cap, assign, attn, tok, load):
    """`wlb_pack` by scanning every bin for both minima (few bins)."""
    n = lengths.shape[0]
    for b in range(nbins):
        load[b] = _bin_time(c, 0.0, 0)
    order = desc_order(lengths)
    for k in range(n):
        i = order[k]
        l = lengths[i]
        w_idx = 0
        l_idx = 0
        for b in range(1, nbins):
            if load[b] < load[w_idx]:
                w_idx = b
            if tok[b] < tok[l_idx]:
                l_idx = b
        b = _choose_bin(tok, w_idx, l_idx, l, cap)
        if b < 0:
            continue
        _add_piece(c, i, l, b, assign, attn, tok, load)
    return assign, attn, tok


@njit(cache=True, nogil=True)
def wlb_pack(c, lengths, nbins, cap):
    """WLB-LLM Algorithm 1, lines 18-35: pieces in descending length order go to the bin with the least
    workload if the token cap allows, else to the bin with the fewest tokens, else they remain for the next
    step (bin -1); ties to the lowest bin. Returns (bin of each piece, bin attention seconds, bin tokens).

    Both minima come from binary heaps keyed (value, bin), each bin's position tracked (loads and token counts
    only grow: the bin that took a piece moves down from where it is), the tokens' one built only once the
    least loaded bin has lacked room SCAN_MISSES times; until then the load heap keeps no positions (the bin
    that took a piece is its top but for those few misses, found by a scan): O(n log bins) instead of a scan of
    every bin per piece, which dominated at DP 1024 (a thousand bins and more); up to HEAP_MIN_BINS bins the
    scan is cheaper and is used."""
    n = lengths.shape[0]
    assign = np.full(n, -1, dtype=np.int64)
    attn = np.zeros(nbins, dtype=np.float64)
    tok = np.zeros(nbins, dtype=np.int64)
    load = np.zeros(nbins, dtype=np.float64)
    if nbins <= HEAP_MIN_BINS:
        return _wlb_pack_scan(c, lengths, nbins, cap, assign, attn, tok, load)
    # every bin starts equal, so bin order is already a heap of (load, bin)
    lk = np.empty(nbins, dtype=np.float64)
    li = np.arange(nbins, dtype=np.int64)
    lpos = np.arange(nbins, dtype=np.int64)  # each bin's position in the load heap, once SCAN_MISSES is reached
    for b in range(nbins):
        load[b] = _bin_time(c, 0.0, 0)
        lk[b] = load[b]
    # the (tokens, bin) heap is only asked when the least loaded bin has no room, which is rare: until that has
    # happened SCAN_MISSES times its minimum is found by a scan, then the heap is built and kept
    tk = np.empty(nbins, dtype=np.int64)
    ti = np.empty(nbins, dtype=np.int64)
    tpos = np.empty(nbins, dtype=np.int64)
    misses = 0
    order = desc_order(lengths)
    last = -1  # longest first: equal lengths come together, so a piece's attention is computed once per length
    a_l = 0.0
    for k in range(n):
        i = order[k]
        l = lengths[i]
        b = li[0]
        if tok[b] + l > cap:
            misses += 1
            if misses == SCAN_MISSES:
                _build_heap(tok, tk, ti, tpos)
                for j in range(nbins):  # from here on the load heap keeps positions too
                    lpos[li[j]] = j
            if misses >= SCAN_MISSES:
                f = ti[0]
            else:
                f = 0
                for j in range(1, nbins):
                    if tok[j] < tok[f]:
                        f = j
            b = _choose_bin(tok, b, f, l, cap)
            if b < 0:
                continue
        if l != last:
            a_l = attn_time(c, l, 0, False) + attn_time(c, l, 0, True)
            last = l
        assign[i] = b  # `_add_piece`, written out with the attention of this length
        attn[b] += a_l
        tok[b] += l
        load[b] = _bin_time(c, attn[b], tok[b])
        if misses >= SCAN_MISSES:  # its keys grew: it moves down from where it is
            lk[lpos[b]] = load[b]
            _sift_down(lk, li, lpos, nbins, lpos[b])
        elif li[0] == b:  # until then no positions are kept: the least loaded bin moves down from the top
            _sift_top(lk, li, nbins, load[b], b)
        else:  # or the fewest-tokens bin (fewer than SCAN_MISSES times), found by a scan
            j = 0
            while li[j] != b:
                j += 1
            lk[j] = load[b]
            _sift_down(lk, li, lpos, nbins, j)  # lpos: scratch until positions are kept
        if misses >= SCAN_MISSES:
            tk[tpos[b]] = tok[b]
            _sift_down(tk, ti, tpos, nbins, tpos[b])
    return assign, attn, tok


@njit(cache=True)
def _build_heap(key, hk, hi, pos):
    """A (key, index) min-heap of every item of `key` in hk, hi, with positions in pos."""
    n = key.shape[0]
    for j in range(n):
        hk[j] = key[j]
        hi[j] = j
        pos[j] = j
    for j in range(n // 2 - 1, -1, -1):
        _sift_down(hk, hi, pos, n, j)


@njit(cache=True, nogil=True)
def deal_bins(cost, dp, per_rank):
    """Deal dp*per_rank bins to dp ranks, per_rank each, heaviest bin first to the least loaded rank that still
    has room (LPT with a count constraint). Returns (rank of each bin, position of each bin on its rank);
    positions follow the dealing order, so each rank runs its heaviest micro-batch first."""
    nb = cost.shape[0]
    rank = np.empty(nb, dtype=np.int64)
    pos = np.empty(nb, dtype=np.int64)
    load = np.zeros(dp, dtype=np.float64)
    count = np.zeros(dp, dtype=np.int64)
    order = np.argsort(-cost, kind="mergesort")
    # the least loaded rank with room, ties to the lowest, from a (load, rank) min-heap; a full rank leaves it
    hk = np.zeros(dp, dtype=np.float64)
    hi = np.arange(dp, dtype=np.int64)  # all loads 0: index order is already a heap
    hs = dp if per_rank > 0 else 0
    for k in range(nb):
        b = order[k]
        best = hi[0]
        rank[b] = best
        pos[b] = count[best]
        count[best] += 1
        load[best] += cost[b]
        if count[best] < per_rank:
            _sift_top(hk, hi, hs, load[best], best)  # its key grew: down from the top
        else:
            hs = _heap_pop(hk, hi, hs)
    return rank, pos
