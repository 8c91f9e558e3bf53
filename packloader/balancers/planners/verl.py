"""verl's balancer, behind the Planner contract so its plans are scored like every other.

* ``karmarkar_karp`` (verl's ``RayPPOTrainer._balance_batch`` since verl PR 3605, "DP workload balance", September
  2025): the largest differencing method (LDM, ``get_seqlen_balanced_partitions``) partitions the pieces over DP
  ranks by verl's estimated workload ``calculate_workload`` = ``24576 l + l^2`` (a 7B model's
  ``12 h^2 l + 2 h l^2`` over ``2h``, h = 4096) with ``equal_size=True`` (every rank the same number of
  sequences; the piece count is padded to a multiple of DP with empty items, which verl avoids by sizing its
  batch). Each rank's pieces are then split over micro-batches by the same workload (``rearrange_micro_batches``):
  the micro-batch count is ``min(pieces, ceil(tokens / max_tokens))`` all-reduced to the maximum over ranks and
  rounded up to a multiple of ``vpp``; micro-batches are ordered heaviest-in-the-middle
  (``use_dynamic_bsz_balance``). LDM does not bound a partition's tokens; where a micro-batch would exceed
  ``max_tokens`` every rank gets one more micro-batch and the ranks are partitioned again (verl has no such check;
  the contract needs it).
* ``karmarkar_karp_verl_legacy``: the same, but the DP level balances token counts with ``equal_size=False``
  (verl before PR 3605 balanced token counts).

LDM runs on thousands of items and up to thousands of partitions, so it is a numba kernel with its own heap of
partial partitions (keyed by spread, top and sequence number).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from packloader.balancers.planners.base import Model, PackingPlanner, StepLayout
from packloader.balancers.planners.packing import Packing, Pieces, check_cap, cost_model_for, whole_pieces_packing
from packloader.balancers.planners.registry import Planner, register_planner
from packloader.contracts import PlanConfig

VERL_WORKLOAD_LINEAR = 24576  # verl's calculate_workload: 12 h^2 l + 2 h l^2 with h = 4096, divided by 2h

# ------------------------------------------------------------------------------------- Karmarkar-Karp (LDM)


@njit(cache=True)
def _set_before(sa, ca, ha, sb, cb, hb):
    """Order of two sets inside a state: larger sum first, then more items, then larger first item."""
    if sa != sb:
        return sa > sb
    if ca != cb:
        return ca > cb
    return ha > hb


@njit(cache=True)
def _sort_sets(s, c, h, t):
    """Sort the k sets of one state (parallel arrays) into `_set_before` order; insertion sort for small k,
    a bottom-up merge sort otherwise."""
    k = s.shape[0]
    idx = np.arange(k)
    if k <= 32:
        for i in range(1, k):
            j = i
            v = idx[i]
            while j > 0 and _set_before(s[v], c[v], h[v], s[idx[j - 1]], c[idx[j - 1]], h[idx[j - 1]]):
                idx[j] = idx[j - 1]
                j -= 1
            idx[j] = v
    else:
        buf = np.empty(k, np.int64)
        width = 1
        while width < k:
            for lo in range(0, k, 2 * width):
                mid = min(lo + width, k)
                hi = min(lo + 2 * width, k)
                i, j, o = lo, mid, lo
                while i < mid and j < hi:
                    a, b = idx[i], idx[j]
                    if _set_before(s[b], c[b], h[b], s[a], c[a], h[a]):
                        buf[o] = b
                        j += 1
                    else:
                        buf[o] = a
                        i += 1
                    o += 1
                while i < mid:
                    buf[o] = idx[i]
                    i += 1
                    o += 1
                while j < hi:
                    buf[o] = idx[j]
                    j += 1
                    o += 1
            idx[:] = buf
            width *= 2
    s[:] = s[idx].copy()
    c[:] = c[idx].copy()
    h[:] = h[idx].copy()
    t[:] = t[idx].copy()


@njit(cache=True)
def _heap_before(spread, top, seq, a, b):
    """Max-heap order on states: larger spread first, then larger largest set, then earlier pushed."""
    if spread[a] != spread[b]:
        return spread[a] > spread[b]
    if top[a] != top[b]:
        return top[a] > top[b]
    return seq[a] < seq[b]


@njit(cache=True)
def _heap_push(heap, size, spread, top, seq, x):
    heap[size] = x
    i = size
    while i > 0:
        p = (i - 1) // 2
        if _heap_before(spread, top, seq, heap[i], heap[p]):
            heap[i], heap[p] = heap[p], heap[i]
            i = p
        else:
            break
    return size + 1


@njit(cache=True)
def _heap_pop(heap, size, spread, top, seq):
    x = heap[0]
    size -= 1
    heap[0] = heap[size]
    i = 0
    while True:
        l = 2 * i + 1
        r = l + 1
        best = i
        if l < size and _heap_before(spread, top, seq, heap[l], heap[best]):
            best = l
        if r < size and _heap_before(spread, top, seq, heap[r], heap[best]):
            best = r
        if best == i:
            break
        heap[i], heap[best] = heap[best], heap[i]
        i = best
    return x, size


@njit(cache=True)
def karmarkar_karp(values, k, equal_size):
    """Largest differencing method: partition index (0..k-1) of each value, partitions numbered by decreasing
    sum. A state is k sets in decreasing order; the two states of largest spread (largest minus smallest set)
    are merged by joining set i of one with set k-1-i of the other, until one state is left. With
    `equal_size`, the initial states are the sorted values taken k at a time (len(values) % k == 0), so every
    partition gets len(values) / k items.

    States are handles 0..S-1 (S initial states); a handle of a single value stays unmaterialised (no k-sized
    arrays) until merged, so memory is O(n + live states x k), and merging a single value into a state costs
    O(k) (one set moves to its place)."""
    n = values.shape[0]
    part = np.zeros(n, np.int64)
    if n == 0 or k <= 1:
        return part
    order = np.argsort(values, kind="mergesort")  # ascending, ties by index
    nxt = np.full(n, -1, np.int64)
    nstates = n // k if equal_size else n
    spread = np.zeros(nstates, np.int64)
    top = np.zeros(nstates, np.int64)
    seq = np.arange(nstates)
    single = np.full(nstates, -1, np.int64)  # item of an unmaterialised single-value state
    slot_of = np.full(nstates, -1, np.int64)
    nslots = nstates if equal_size else n // 2 + 2
    sums = np.empty((nslots, k), np.int64)
    cnt = np.empty((nslots, k), np.int64)
    head = np.empty((nslots, k), np.int64)
    tail = np.empty((nslots, k), np.int64)
    free = np.empty(nslots, np.int64)
    nfree = 0
    used = 0
    heap = np.empty(nstates, np.int64)
    hsize = 0
    if equal_size:
        for st in range(nstates):
            sl = used
            used += 1
            slot_of[st] = sl
            for j in range(k):
                it = order[st * k + j]
                sums[sl, j] = values[it]
                cnt[sl, j] = 1
                head[sl, j] = it
                tail[sl, j] = it
            _sort_sets(sums[sl], cnt[sl], head[sl], tail[sl])
            spread[st] = sums[sl, 0] - sums[sl, k - 1]
            top[st] = sums[sl, 0]
            hsize = _heap_push(heap, hsize, spread, top, seq, st)
    else:
        for st in range(n):
            it = order[st]
            single[st] = it
            spread[st] = values[it]
            top[st] = values[it]
            hsize = _heap_push(heap, hsize, spread, top, seq, st)
    ts = np.empty(k, np.int64)
    tc = np.empty(k, np.int64)
    th = np.empty(k, np.int64)
    tt = np.empty(k, np.int64)
    counter = nstates
    while hsize > 1:
        a, hsize = _heap_pop(heap, hsize, spread, top, seq)
        b, hsize = _heap_pop(heap, hsize, spread, top, seq)
        # the result lives in a's handle; its slot is a's, else b's, else a fresh one
        if slot_of[a] >= 0:
            sl = slot_of[a]
        elif slot_of[b] >= 0:
            sl = slot_of[b]
        elif nfree > 0:
            nfree -= 1
            sl = free[nfree]
        else:
            sl = used
            used += 1
        if single[b] >= 0 and slot_of[a] >= 0:
            # fast path: b's one value joins a's smallest set, which then moves up to its place
            y = single[b]
            j = k - 1
            if cnt[sl, j] == 0:
                head[sl, j] = y
            else:
                nxt[tail[sl, j]] = y
            tail[sl, j] = y
            sums[sl, j] += values[y]
            cnt[sl, j] += 1
            s0, c0, h0, t0 = sums[sl, j], cnt[sl, j], head[sl, j], tail[sl, j]
            while j > 0 and _set_before(s0, c0, h0, sums[sl, j - 1], cnt[sl, j - 1], head[sl, j - 1]):
                sums[sl, j] = sums[sl, j - 1]
                cnt[sl, j] = cnt[sl, j - 1]
                head[sl, j] = head[sl, j - 1]
                tail[sl, j] = tail[sl, j - 1]
                j -= 1
            sums[sl, j], cnt[sl, j], head[sl, j], tail[sl, j] = s0, c0, h0, t0
        else:
            # general merge: set i of a joined by set k-1-i of b (a's items first)
            for i in range(k):
                ts[i] = 0
                tc[i] = 0
                th[i] = -1
                tt[i] = -1
            if slot_of[a] >= 0:
                sa = slot_of[a]
                for i in range(k):
                    ts[i] = sums[sa, i]
                    tc[i] = cnt[sa, i]
                    th[i] = head[sa, i]
                    tt[i] = tail[sa, i]
            else:
                x = single[a]
                ts[0] = values[x]
                tc[0] = 1
                th[0] = x
                tt[0] = x
            for i in range(k):
                j = k - 1 - i
                if slot_of[b] >= 0:
                    sb = slot_of[b]
                    bs, bc, bh, bt = sums[sb, j], cnt[sb, j], head[sb, j], tail[sb, j]
                elif j == 0:
                    y = single[b]
                    bs, bc, bh, bt = values[y], 1, y, y
                else:
                    bs, bc, bh, bt = 0, 0, -1, -1
                if bc == 0:
                    continue
                if tc[i] == 0:
                    th[i] = bh
                else:
                    nxt[tt[i]] = bh
                tt[i] = bt
                ts[i] += bs
                tc[i] += bc
            if slot_of[b] >= 0 and slot_of[b] != sl:
                free[nfree] = slot_of[b]
                nfree += 1
            _sort_sets(ts, tc, th, tt)
            for i in range(k):
                sums[sl, i] = ts[i]
                cnt[sl, i] = tc[i]
                head[sl, i] = th[i]
                tail[sl, i] = tt[i]
        slot_of[b] = -1
        single[b] = -1
        slot_of[a] = sl
        single[a] = -1
        spread[a] = sums[sl, 0] - sums[sl, k - 1]
        top[a] = sums[sl, 0]
        seq[a] = counter
        counter += 1
        hsize = _heap_push(heap, hsize, spread, top, seq, a)
    last = heap[0]
    if single[last] >= 0:
        part[single[last]] = 0
        return part
    sl = slot_of[last]
    for i in range(k):
        it = head[sl, i] if cnt[sl, i] > 0 else -1
        while it >= 0:
            part[it] = i
            it = nxt[it]
    return part


def kk_partitions(values: np.ndarray, k: int, equal_size: bool = False) -> list[np.ndarray]:
    """verl's get_seqlen_balanced_partitions: k lists of indices (each sorted), partitions by decreasing sum.
    Unlike verl, fewer items than partitions is allowed (the extra partitions are empty)."""
    values = np.asarray(values, dtype=np.int64)
    if k < 1:
        raise ValueError(f"karmarkar_karp: k must be >= 1, got {k}")
    if equal_size and len(values) % k:
        raise ValueError(f"karmarkar_karp: equal_size needs len(values) = {len(values)} divisible by k = {k}")
    part = karmarkar_karp(values, k, equal_size)
    order = np.argsort(part, kind="stable")
    bounds = np.searchsorted(part[order], np.arange(k + 1))
    return [order[bounds[i]:bounds[i + 1]] for i in range(k)]


@njit(cache=True)
def kk_micro_batches(lengths, work, rank_of, dp, m, cap):
    """Per DP rank, LDM over `m` micro-batches of its pieces' workloads (pieces in index order within a rank):
    (micro-batch of each piece in sum-descending order, whether every micro-batch holds at most `cap` tokens)."""
    n = lengths.shape[0]
    part = np.zeros(n, np.int64)
    order = np.argsort(rank_of, kind="mergesort")
    tokens = np.zeros(m, np.int64)
    ok = True
    a = 0
    for r in range(dp):
        b = a
        while b < n and rank_of[order[b]] == r:
            b += 1
        if b > a:
            ix = order[a:b]
            p = karmarkar_karp(work[ix], m, False)
            tokens[:] = 0
            for j in range(b - a):
                part[ix[j]] = p[j]
                tokens[p[j]] += lengths[ix[j]]
            for j in range(m):
                if tokens[j] > cap:
                    ok = False
        a = b
    return part, ok


def verl_positions(rank_of: np.ndarray, part: np.ndarray, work: np.ndarray, dp: int, m: int) -> np.ndarray:
    """Position of each piece's micro-batch on its rank under verl_order, vectorised over all ranks."""
    key = rank_of * m + part
    sums = np.bincount(key, weights=work.astype(np.float64), minlength=dp * m)
    local = np.empty(len(rank_of), np.int64)  # index of each piece among its rank's pieces (verl's partition[0])
    order = np.argsort(rank_of, kind="stable")
    counts = np.bincount(rank_of, minlength=dp)
    local[order] = np.arange(len(rank_of)) - np.repeat(np.cumsum(counts) - counts, counts)
    first_set = np.full(dp * m, np.iinfo(np.int64).max)
    np.minimum.at(first_set, key, local)
    first = np.where(first_set == np.iinfo(np.int64).max, 0, first_set)
    mb = np.arange(dp * m)
    # sort each rank's micro-batches by (workload, first index) descending; q = rank in that order
    srt = np.lexsort((-first, -sums, mb // m))
    q = np.empty(dp * m, np.int64)
    q[srt] = np.tile(np.arange(m), dp)
    ne = (m + 1) // 2
    pos = np.where(q % 2 == 0, ne - 1 - q // 2, ne + q // 2)
    return pos[key]


def verl_workload(lengths: np.ndarray, linear: int = VERL_WORKLOAD_LINEAR) -> np.ndarray:
    """verl's calculate_workload: proportional to a 7B model's FLOPs of a sequence (linear + attention)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    return linear * lengths + lengths * lengths


def verl_order(parts: list[np.ndarray], work: np.ndarray) -> list[int]:
    """verl's use_dynamic_bsz_balance order: micro-batches by decreasing workload (ties: larger first index),
    then the even positions reversed followed by the odd ones, so light micro-batches sit at both ends of the
    pipeline's warm-up and cool-down."""
    keys = [(int(work[p].sum()), int(p[0]) if len(p) else 0) for p in parts]
    idx = sorted(range(len(parts)), key=lambda i: keys[i], reverse=True)
    return idx[::2][::-1] + idx[1::2]


# ----------------------------------------------------------------------------------------------- planners


class KarmarkarKarpPlanner(PackingPlanner):
    """verl's two-level Karmarkar-Karp balancing as since verl PR 3605 (see the module docstring): DP ranks by
    workload with equal-size groups, then micro-batches by workload."""

    name = "karmarkar_karp"

    def __init__(self, config: PlanConfig, *, dp_balance: str = "workload", equal_size: bool = True,
                 workload_linear: int = VERL_WORKLOAD_LINEAR) -> None:
        if dp_balance not in ("tokens", "workload"):
            raise ValueError(f"karmarkar_karp: dp_balance must be 'tokens' or 'workload', got {dp_balance!r}")
        self.config = config
        self.dp_balance = dp_balance
        self.equal_size = equal_size
        self.workload_linear = workload_linear
        self.model = cost_model_for(config)

    def rank_of(self, lengths: np.ndarray, work: np.ndarray, dp: int) -> np.ndarray:
        """The DP rank of each piece: LDM over `dp` partitions, padded with empty items for equal sizes."""
        values = lengths if self.dp_balance == "tokens" else work
        if not self.equal_size or dp <= 1:
            return karmarkar_karp(values, dp, False)
        pad = -len(values) % dp
        padded = np.concatenate([values, np.zeros(pad, values.dtype)]) if pad else values
        return karmarkar_karp(padded, dp, True)[:len(values)]

    def solve(self, pieces: Pieces, layout: StepLayout, model: Model) -> Packing:
        cfg = self.config
        dp, cap, vpp = cfg.parallel.dp, cfg.max_tokens, cfg.parallel.vpp
        check_cap(pieces, cap, self.name)
        lengths = pieces.length
        work = verl_workload(lengths, self.workload_linear)
        rank_of = self.rank_of(lengths, work, dp)
        counts = np.bincount(rank_of, minlength=dp)
        tokens = np.bincount(rank_of, weights=lengths, minlength=dp).astype(np.int64)
        m = int(np.minimum(counts, -(-tokens // cap)).max()) if len(lengths) else 1
        m = max(m, 1, layout.micro_batches or cfg.num_micro_batches or 1)
        m = -(-m // vpp) * vpp
        while True:
            part, ok = kk_micro_batches(lengths, work, rank_of, dp, m, cap)
            if ok:
                break
            m += vpp  # a partition over the cap: one more round of micro-batches everywhere
        piece_mb = rank_of * m + verl_positions(rank_of, part, work, dp, m)
        rank_mbs = (np.arange(dp)[:, None] * m + np.arange(m)[None, :]).astype(np.int64)
        return whole_pieces_packing(pieces, piece_mb, rank_mbs, strategy=self.name)


class KarmarkarKarpLegacyPlanner(KarmarkarKarpPlanner):
    """Historical: DP ranks balanced by token count without equal sizes (see the module docstring)."""

    name = "karmarkar_karp_verl_legacy"

    def __init__(self, config: PlanConfig) -> None:
        super().__init__(config, dp_balance="tokens", equal_size=False)


@register_planner("karmarkar_karp")
def _make_kk(config: PlanConfig) -> Planner:
    return KarmarkarKarpPlanner(config)


@register_planner("karmarkar_karp_verl_legacy")
def _make_kk_legacy(config: PlanConfig) -> Planner:
    return KarmarkarKarpLegacyPlanner(config)
