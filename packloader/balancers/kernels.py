"""Numba kernels shared by the planners (wlb, hydraulis, slimpack, auto).

Everything here takes flat typed arrays (lengths as int64, the cost coefficients as float64[NUM_COEFFS] in
`contracts.COEFF_LAYOUT` order) and returns arrays; no Python objects inside the loops. Costs come from the
kernels of `cost.py` (`attn_time`, `lin_time`, `doc_time_split`), so a planner balances exactly what the cost
model and the simulator later measure.

Conventions:

* a *piece* is an independent run of tokens of one document (a whole document or a context-window piece);
  its workload is `doc_time_split` (attention + linear share, no per-micro-batch floor);
* a *bin* is one micro-batch; its time is the sum of its segments' attention plus `lin_time` of its token
  count, which includes the floor;
* orders are made with stable sorts and ties go to the lowest index, so equal inputs give equal outputs.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from packloader.balancers.cost import ATTN_BWD, ATTN_FWD, LIN_BWD, LIN_FWD, attn_time, doc_time_split, lin_time

__all__ = [
    "backward_runs_ranks",
    "bfd_pack",
    "bin_times",
    "deal_bins",
    "equal_cost_cuts",
    "hydraulis_dispatch",
    "hydraulis_pack",
    "lpt_dispatch",
    "slice_edges_kernel",
    "slice_end",
    "slim_pack_rank",
    "slim_pack_ranks",
    "wlb_pack",
]


@njit(cache=True)
def _bin_time(c, attn, tokens):
    """Forward + backward time of a bin holding `attn` seconds of attention and `tokens` tokens."""
    return attn + lin_time(c, tokens, False) + lin_time(c, tokens, True)


@njit(cache=True)
def bin_times(c, attn, tokens):
    """Forward + backward time of each bin from its attention seconds and token count."""
    out = np.empty(attn.shape[0], dtype=np.float64)
    for k in range(attn.shape[0]):
        out[k] = _bin_time(c, attn[k], tokens[k])
    return out


@njit(cache=True)
def _heap_push(key, idx, size, k, i):
    """Push (k, i) onto the binary min-heap held in key[:size], idx[:size], ordered by (key, idx); returns
    the new size. The planners' "least loaded bin, ties to the lowest index" is the heap's top."""
    j = size
    while j > 0:
        parent = (j - 1) // 2
        if key[parent] < k or (key[parent] == k and idx[parent] < i):
            break
        key[j] = key[parent]
        idx[j] = idx[parent]
        j = parent
    key[j] = k
    idx[j] = i
    return size + 1


@njit(cache=True)
def _heap_pop(key, idx, size):
    """Remove the top of the heap in key[:size], idx[:size]; returns the new size (the caller read the top)."""
    size -= 1
    k = key[size]
    i = idx[size]
    j = 0
    while True:
        c = 2 * j + 1
        if c >= size:
            break
        if c + 1 < size and (key[c + 1] < key[c] or (key[c + 1] == key[c] and idx[c + 1] < idx[c])):
            c += 1
        if k < key[c] or (k == key[c] and i < idx[c]):
            break
        key[j] = key[c]
        idx[j] = idx[c]
        j = c
    if size > 0:
        key[j] = k
        idx[j] = i
    return size


# ------------------------------------------------------------------------------------------------- WLB-LLM


HEAP_MIN_BINS = 96  # below this many bins a scan of every bin beats the heaps (measured: same answers)


@njit(cache=True)
def _add_piece(c, i, l, b, assign, attn, tok, load):
    """Piece i (l tokens, a whole document) into bin b: its attention, tokens and the bin's new time."""
    assign[i] = b
    attn[b] += attn_time(c, l, 0, False) + attn_time(c, l, 0, True)
    tok[b] += l
    load[b] = _bin_time(c, attn[b], tok[b])


@njit(cache=True)
def _empty_bin_loads(coeffs, rank_profile, per_rank, tok, load):
    """An empty Hydraulis bin still costs its rank's per-micro-batch floor."""
    for b in range(load.shape[0]):
        if tok[b] == 0:
            load[b] = _bin_time(coeffs[rank_profile[b // per_rank]], 0.0, 0)


@njit(cache=True)
def _wlb_pack_scan(c, lengths, nbins, cap, assign, attn, tok, load):
    """`wlb_pack` by scanning every bin for both minima (few bins)."""
    n = lengths.shape[0]
    for b in range(nbins):
        load[b] = _bin_time(c, 0.0, 0)
    order = np.argsort(-lengths, kind="mergesort")
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
        if tok[w_idx] + l <= cap:
            b = w_idx
        elif tok[l_idx] + l <= cap:
            b = l_idx
        else:
            continue
        _add_piece(c, i, l, b, assign, attn, tok, load)
    return assign, attn, tok


@njit(cache=True)
def wlb_pack(c, lengths, nbins, cap):
    """WLB-LLM Algorithm 1, lines 18-35: pieces in descending length order go to the bin with the least
    workload if the token cap allows, else to the bin with the fewest tokens, else they remain for the next
    step (bin -1); ties to the lowest bin. Returns (bin of each piece, bin attention seconds, bin tokens).

    Both minima come from binary heaps keyed (value, bin) with lazy deletion (loads and token counts only
    grow, so an entry whose value is no longer its bin's is stale): O(n log bins) instead of a scan of
    every bin per piece, which dominated at DP 1024 (a thousand bins and more); up to HEAP_MIN_BINS bins the
    scan is cheaper and is used."""
    n = lengths.shape[0]
    assign = np.full(n, -1, dtype=np.int64)
    attn = np.zeros(nbins, dtype=np.float64)
    tok = np.zeros(nbins, dtype=np.int64)
    load = np.zeros(nbins, dtype=np.float64)
    if nbins <= HEAP_MIN_BINS:
        return _wlb_pack_scan(c, lengths, nbins, cap, assign, attn, tok, load)
    hcap = nbins + n + 1
    lk = np.empty(hcap, dtype=np.float64)  # heap of (load, bin)
    li = np.empty(hcap, dtype=np.int64)
    tk = np.empty(hcap, dtype=np.int64)  # heap of (tokens, bin)
    ti = np.empty(hcap, dtype=np.int64)
    ls = 0
    ts = 0
    for b in range(nbins):
        load[b] = _bin_time(c, 0.0, 0)
        ls = _heap_push(lk, li, ls, load[b], b)
        ts = _heap_push(tk, ti, ts, tok[b], b)
    if nbins == 0:
        return assign, attn, tok
    order = np.argsort(-lengths, kind="mergesort")
    for k in range(n):
        i = order[k]
        l = lengths[i]
        while lk[0] != load[li[0]]:  # drop stale tops
            ls = _heap_pop(lk, li, ls)
        while tk[0] != tok[ti[0]]:
            ts = _heap_pop(tk, ti, ts)
        w_idx = li[0]
        l_idx = ti[0]
        if tok[w_idx] + l <= cap:
            b = w_idx
        elif tok[l_idx] + l <= cap:
            b = l_idx
        else:
            continue
        _add_piece(c, i, l, b, assign, attn, tok, load)
        ls = _heap_push(lk, li, ls, load[b], b)
        ts = _heap_push(tk, ti, ts, tok[b], b)
    return assign, attn, tok


@njit(cache=True)
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
    for k in range(nb):
        b = order[k]
        best = -1
        for r in range(dp):
            if count[r] < per_rank and (best < 0 or load[r] < load[best]):
                best = r
        rank[b] = best
        pos[b] = count[best]
        count[best] += 1
        load[best] += cost[b]
    return rank, pos


@njit(cache=True)
def bfd_pack(lengths, capacity, num_bins):
    """Best-fit decreasing by token count (`fixed.best_fit_decreasing` in numba, same answer): longest first
    (stable), each to the fullest bin it fits, ties to the lowest bin. Returns (bin of each item, ok); ok is
    False when some item fits no bin."""
    n = lengths.shape[0]
    assign = np.full(n, -1, dtype=np.int64)
    free = np.full(num_bins, capacity, dtype=np.int64)
    order = np.argsort(-lengths, kind="mergesort")
    for k in range(n):
        i = order[k]
        need = lengths[i]
        best = -1
        for b in range(num_bins):
            if free[b] >= need and (best < 0 or free[b] < free[best]):
                best = b
        if best < 0:
            return assign, False
        free[best] -= need
        assign[i] = best
    return assign, True


# ------------------------------------------------------------------------------------------------ Hydraulis


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
        obj = v1
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


# ------------------------------------------------------------------------------------------------- SlimPack


@njit(cache=True)
def lpt_dispatch(work, dp, merge_share):
    """SlimPack phase one: pieces, heaviest first, to the least loaded DP rank (equal forward capacity per
    rank). A piece heavier than `merge_share` (a rank's share; inf disables DP-Merge) goes to a DP-Merge group
    of g = ceil(work / merge_share) ranks (2 <= g <= dp), the g least loaded, each charged work / g.

    Returns (rank of each piece, -1 for a merged one; members of piece i's group, sorted, as
    members[offs[i]:offs[i+1]], empty for a piece that is not merged)."""
    n = work.shape[0]
    rank = np.full(n, -1, dtype=np.int64)
    gsize = np.zeros(n, dtype=np.int64)
    for i in range(n):
        if dp > 1 and work[i] > merge_share:
            gsize[i] = min(max(int(math.ceil(work[i] / merge_share)), 2), dp)
    offs = np.zeros(n + 1, dtype=np.int64)
    for i in range(n):
        offs[i + 1] = offs[i] + gsize[i]
    members = np.empty(offs[n], dtype=np.int64)
    load = np.zeros(dp, dtype=np.float64)
    order = np.argsort(-work, kind="mergesort")
    for kk in range(n):
        i = order[kk]
        g = gsize[i]
        if g > 1:
            sel = np.sort(np.argsort(load, kind="mergesort")[:g])
            for t in range(g):
                members[offs[i] + t] = sel[t]
                load[sel[t]] += work[i] / g
        else:
            best = 0
            for r in range(1, dp):
                if load[r] < load[best]:
                    best = r
            rank[i] = best
            load[best] += work[i]
    return rank, members, offs


@njit(cache=True)
def slice_end(c, x0, budget, length, scale):
    """Token offset x1 (within a piece of `length` tokens) such that the slice x0..x1, attending to the
    piece's first x0 tokens, costs about `budget` forward seconds (divided by `scale`, the DP-Merge group
    size). Attention of a slice is A(x1) - A(x0) with A(x) = a*x^2 + b*x; the linear part adds lam*(x1-x0).
    Tile rounding is ignored here (the caller measures the real cost). At least x0 + 1, at most length."""
    a = c[ATTN_FWD] / scale
    b = (c[ATTN_FWD + 1] + c[LIN_FWD + 1]) / scale
    target = a * x0 * x0 + b * x0 + budget
    if a > 0.0:
        x1 = (-b + math.sqrt(b * b + 4.0 * a * target)) / (2.0 * a)
    elif b > 0.0:
        x1 = target / b
    else:
        x1 = float(length)
    e = int(math.floor(x1))
    if e <= x0:
        e = x0 + 1
    if e > length:
        e = length
    return e


@njit(cache=True)
def slim_pack_rank(c, lengths, npacks, budget, bbudget, cap, min_slice, allow_slice):
    """SlimPack phase two on one rank: pack its pieces (in the given order, heaviest forward workload first)
    into `npacks` MicroPacks of about `budget` forward seconds each.

    Pieces heavier than the budget (or longer than the cap) are slimmed: cut into consecutive slices that fill
    the current pack to the budget (next-fit), so a piece's slices land in increasing packs (Slim packs, and
    a Mix pack where its last slice meets other pieces). The remaining pieces are packed whole (Pack): each
    to the pack whose forward and backward loads, each relative to its own budget (`budget`, `bbudget`), stay
    lowest after adding it (asymmetric: forward and backward balanced separately), within the token cap.

    Returns (ok, seg_piece, seg_start, seg_end, seg_pack) with starts/ends relative to the piece; ok is False
    when the pieces do not fit in npacks packs under the cap (the caller then tries more packs).
    """
    n = lengths.shape[0]
    maxseg = n + 4 * npacks + 16
    seg_piece = np.empty(maxseg, dtype=np.int64)
    seg_start = np.empty(maxseg, dtype=np.int64)
    seg_end = np.empty(maxseg, dtype=np.int64)
    seg_pack = np.empty(maxseg, dtype=np.int64)
    ns = 0
    fl = np.zeros(npacks, dtype=np.float64)  # forward attention + linear share, no floor
    bl = np.zeros(npacks, dtype=np.float64)
    tok = np.zeros(npacks, dtype=np.int64)
    f_one, b_one = doc_time_split(c, lengths)
    lam_f = c[LIN_FWD + 1]
    lam_b = c[LIN_BWD + 1]
    cur = 0
    placed_whole = np.zeros(n, dtype=np.bool_)
    # a slice fills its pack up to the forward budget and up to the backward budget, whichever comes first
    # (a slice's backward grows faster with its prefix than its forward: a forward-only cut leaves the packs
    # of long documents heavy in backward); cb holds the backward coefficients where slice_end reads forward
    cb = c.copy()
    for j in range(3):
        cb[ATTN_FWD + j] = c[ATTN_BWD + j]
        cb[LIN_FWD + j] = c[LIN_BWD + j]
    # slim: long pieces, next-fit from pack 0. Each sliced piece starts in the pack where the previous one
    # ended (`chain`), even when that pack is already at its budget (a short first slice, at least min_slice
    # tokens, cap permitting): then the slices of all pieces form one run of linked packs from pack 0, whose
    # first-in-last-out backward overlaps the pipeline warm-up. A new run starting mid-step would have to
    # wait for its own last forward to cross every stage before its first backward: one more pipeline drain.
    chain = -1
    for i in range(n):
        l = lengths[i]
        if not allow_slice or (f_one[i] <= budget and l <= cap):
            continue
        if l <= min_slice and l <= cap:
            continue
        x0 = 0
        while x0 < l:
            if cur >= npacks:
                return False, seg_piece[:0], seg_start[:0], seg_end[:0], seg_pack[:0]
            room = cap - tok[cur]
            rem = budget - fl[cur]
            remb = bbudget - bl[cur]
            keep = x0 == 0 and cur == chain and room > 0  # the piece's first slice, in the chain's last pack
            if room <= 0 or ((rem <= 0.0 or remb <= 0.0) and tok[cur] > 0 and not keep):
                cur += 1
                continue
            e = slice_end(c, x0, max(rem, 0.0), l, 1.0)
            eb = slice_end(cb, x0, max(remb, 0.0), l, 1.0)
            if eb < e:
                e = eb
            last = cur == npacks - 1
            if last:
                e = l  # the last pack takes what is left (cap permitting)
            if keep and e - x0 < min_slice:
                e = min(x0 + min_slice, l)
            if e - x0 > room:
                e = x0 + room
            if e < l and e - x0 < min_slice and tok[cur] > 0 and not last and not keep:
                cur += 1
                continue
            if e < l and l - e < min_slice and l - x0 <= room:
                e = l  # do not leave a sliver
            if e - x0 > room:
                if last:
                    return False, seg_piece[:0], seg_start[:0], seg_end[:0], seg_pack[:0]
                cur += 1
                continue
            if ns >= maxseg:
                return False, seg_piece[:0], seg_start[:0], seg_end[:0], seg_pack[:0]
            q = e - x0
            seg_piece[ns] = i
            seg_start[ns] = x0
            seg_end[ns] = e
            seg_pack[ns] = cur
            ns += 1
            fl[cur] += attn_time(c, q, x0, False) + lam_f * q
            bl[cur] += attn_time(c, q, x0, True) + lam_b * q
            tok[cur] += q
            x0 = e
            if x0 < l:
                cur += 1
        placed_whole[i] = True
        chain = cur
    # pack: the rest whole, asymmetric 2-D greedy
    for i in range(n):
        if placed_whole[i]:
            continue
        l = lengths[i]
        best = -1
        best_v = np.inf
        for j in range(npacks):
            if tok[j] + l > cap:
                continue
            vf = (fl[j] + f_one[i]) / budget if budget > 0 else 0.0
            vb = (bl[j] + b_one[i]) / bbudget if bbudget > 0 else 0.0
            v = vf if vf > vb else vb
            if v < best_v:
                best_v = v
                best = j
        if best < 0:
            return False, seg_piece[:0], seg_start[:0], seg_end[:0], seg_pack[:0]
        if ns >= maxseg:
            return False, seg_piece[:0], seg_start[:0], seg_end[:0], seg_pack[:0]
        seg_piece[ns] = i
        seg_start[ns] = 0
        seg_end[ns] = l
        seg_pack[ns] = best
        ns += 1
        fl[best] += f_one[i]
        bl[best] += b_one[i]
        tok[best] += l
    # refine: move whole pieces from the heaviest pack to the lightest while that lowers the heavier of the
    # two (forward + backward), so the largest micro-batch comes closer to the mean
    load = fl + bl
    for _ in range(2 * ns + 2):
        hi = 0
        lo = 0
        for j in range(1, npacks):
            if load[j] > load[hi]:
                hi = j
            if load[j] < load[lo]:
                lo = j
        if hi == lo:
            break
        gap = load[hi] - load[lo]
        pick = -1
        pick_dev = gap
        for k in range(ns):
            if seg_pack[k] != hi:
                continue
            i = seg_piece[k]
            if seg_start[k] != 0 or seg_end[k] != lengths[i] or tok[lo] + lengths[i] > cap:
                continue
            w = f_one[i] + b_one[i]
            if w >= gap:
                continue
            dev = abs(gap - 2.0 * w)  # |new difference| after the move
            if dev < pick_dev:
                pick_dev = dev
                pick = k
        if pick < 0:
            break
        i = seg_piece[pick]
        seg_pack[pick] = lo
        fl[hi] -= f_one[i]
        bl[hi] -= b_one[i]
        fl[lo] += f_one[i]
        bl[lo] += b_one[i]
        tok[hi] -= lengths[i]
        tok[lo] += lengths[i]
        load[hi] = fl[hi] + bl[hi]
        load[lo] = fl[lo] + bl[lo]
    return True, seg_piece[:ns], seg_start[:ns], seg_end[:ns], seg_pack[:ns]


@njit(cache=True)
def slim_pack_ranks(c, lengths, bounds, npacks, budgets, bbudgets, cap, min_slice, allow_slice):
    """`slim_pack_rank` for every rank in one call: rank r packs lengths[bounds[r]:bounds[r+1]] (in that
    order) into npacks[r] packs with its own budgets. Returns (the first rank that does not fit, or -1;
    seg_rank, seg_piece (index into lengths), seg_start, seg_end, seg_pack), segments rank by rank."""
    dp = bounds.shape[0] - 1
    total = 0
    for r in range(dp):
        n = bounds[r + 1] - bounds[r]
        if n > 0:
            total += n + 4 * npacks[r] + 16
    seg_rank = np.empty(total, dtype=np.int64)
    seg_piece = np.empty(total, dtype=np.int64)
    seg_start = np.empty(total, dtype=np.int64)
    seg_end = np.empty(total, dtype=np.int64)
    seg_pack = np.empty(total, dtype=np.int64)
    ns = 0
    for r in range(dp):
        lo = bounds[r]
        hi = bounds[r + 1]
        if hi == lo:
            continue
        if npacks[r] <= 0:
            return r, seg_rank[:0], seg_piece[:0], seg_start[:0], seg_end[:0], seg_pack[:0]
        ok, sp, ss, se, sk = slim_pack_rank(c, lengths[lo:hi], npacks[r], budgets[r], bbudgets[r], cap, min_slice, allow_slice)
        if not ok:
            return r, seg_rank[:0], seg_piece[:0], seg_start[:0], seg_end[:0], seg_pack[:0]
        k = sp.shape[0]
        for t in range(k):
            seg_rank[ns + t] = r
            seg_piece[ns + t] = sp[t] + lo
            seg_start[ns + t] = ss[t]
            seg_end[ns + t] = se[t]
            seg_pack[ns + t] = sk[t]
        ns += k
    return -1, seg_rank[:ns], seg_piece[:ns], seg_start[:ns], seg_end[:ns], seg_pack[:ns]


@njit(cache=True)
def equal_cost_cuts(c, length, k, scale):
    """k+1 cut points 0 = x_0 < ... < x_k = length splitting a piece into k consecutive slices of about equal
    forward cost (slice j attends to the first x_j tokens)."""
    a = c[ATTN_FWD]
    b = c[ATTN_FWD + 1] + c[LIN_FWD + 1]
    total = a * length * length + b * length
    cuts = np.empty(k + 1, dtype=np.int64)
    cuts[0] = 0
    for j in range(1, k):
        target = total * j / k
        if a > 0.0:
            x = (-b + math.sqrt(b * b + 4.0 * a * target)) / (2.0 * a)
        else:
            x = target / b if b > 0.0 else length * j / k
        e = int(round(x))
        if e <= cuts[j - 1]:
            e = cuts[j - 1] + 1
        cuts[j] = e
    cuts[k] = length
    for j in range(k - 1, 0, -1):  # keep strictly increasing at the end too
        if cuts[j] >= cuts[j + 1]:
            cuts[j] = cuts[j + 1] - 1
    return cuts


@njit(cache=True)
def backward_runs_ranks(num_slots, dp, span_r, span_a, span_b):
    """`slimpack.backward_runs` for every rank at once: span k covers packs span_a[k]..span_b[k] of rank
    span_r[k]. Returns (order (dp, num_slots): each rank's backward visiting order, has (dp,): whether the
    rank has any span; without one its row is the forward order and the plan keeps the default)."""
    order = np.empty((dp, num_slots), dtype=np.int64)
    has = np.zeros(dp, dtype=np.bool_)
    reach = np.empty((dp, num_slots), dtype=np.int64)
    for r in range(dp):
        for s in range(num_slots):
            reach[r, s] = s
    for k in range(span_r.shape[0]):
        r = span_r[k]
        has[r] = True
        if span_b[k] > reach[r, span_a[k]]:
            reach[r, span_a[k]] = span_b[k]
    for r in range(dp):
        k = 0
        s = 0
        while s < num_slots:
            end = reach[r, s]
            t = s
            while t <= end:
                if reach[r, t] > end:
                    end = reach[r, t]
                t += 1
            for u in range(end, s - 1, -1):
                order[r, k] = u
                k += 1
            s = end + 1
    return order, has


@njit(cache=True)
def slice_edges_kernel(seg_doc, seg_start, seg_end, seg_af, seg_mb, rank_mbs):
    """Per-rank slice edges of a plan given as segment arrays (what `auto.slice_edges_prefix` returns): for
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
    # (doc, end) of every segment, sorted (stable): the segment a slice continues
    key_end = np.empty(ns, dtype=np.int64)
    for i in range(ns):
        key_end[i] = seg_doc[i] * (1 << 31) + seg_end[i]
    order = np.argsort(key_end)  # keys are unique (segments of a document do not overlap): no need for stable
    sorted_keys = key_end[order]
    # listings of each micro-batch: CSR by id, in (rank, position) order
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
        if at >= ns or sorted_keys[at] != want:
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

