"""Numba kernels of the Hydraulis planner (`hydraulis.py`): the greedy DP dispatch of pieces to ranks (Algorithm
1, by a scan of every rank, or from a heap when the pieces come longest first on identical ranks) and the
per-rank packing into V micro-batches (Eq. 1)."""

from __future__ import annotations

import numpy as np
from numba import njit

from packloader.balancers.cost.coeffs import LIN_BWD, LIN_FWD, doc_time_split
from packloader.balancers.planners.bins import (
    HEAP_MIN_BINS,
    _add_piece,
    _empty_bin_loads,
    _heap_pop,
    _heap_push,
    _sift_down,
    desc_order,
    desc_order_by,
)


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
def _dispatch_longest_first(perm, lengths, t_sum, t_full, pp, assign, cc, ee, lmax):
    """`_dispatch_trial` for ranks of one profile and one cap with the pieces in non-increasing length order, in
    O(n log D) instead of O(n D). There a rank's own bound decides alone (the rank holding the largest bound
    can only raise it, past every other's), and a rank with pieces already holds one at least as long as this
    one, so its bound grows by the piece's T(l) whichever it is: the choice is the least (cc + ee, rank), the
    top of a min-heap, or the first rank still empty when that one's bound is lower. The same choices as the
    scan in exact arithmetic; in floating point the scan compares each rank's rounded cc + T(l) + ee, so two
    ranks whose bounds differ by less than a rounding step may go the other way (test_planning_speed_kernels.py
    checks equality with costs whose sums are exact)."""
    d = cc.shape[0]
    n = lengths.shape[0]
    cc[:] = 0.0
    ee[:] = 0.0
    lmax[:] = 0
    hk = np.empty(d, dtype=np.float64)
    hi = np.empty(d, dtype=np.int64)
    hpos = np.empty(d, dtype=np.int64)
    hs = 0
    empty = 0  # ranks empty..d-1 hold no piece yet (they fill in index order: equal bounds, lowest rank first)
    for kk in range(n):
        i = perm[kk]
        l = lengths[i]
        t = t_sum[i]
        tf = t_full[i] * (pp - 1)
        j = -1
        own = np.inf
        if empty < d:
            j = empty
            own = (0.0 + t) + (0.0 if l <= 0 else tf)
        from_heap = False
        if hs > 0:
            top = hi[0]
            top_own = (cc[top] + t) + (ee[top] if lmax[top] >= l else tf)
            if top_own < own or (top_own == own and top < j):
                j = top
                from_heap = True
        if not from_heap:
            empty += 1
        assign[i] = j
        cc[j] += t
        if l > lmax[j]:
            lmax[j] = l
            ee[j] = tf
        if from_heap:  # its key grew: down from the top
            hk[0] = cc[j] + ee[j]
            _sift_down(hk, hi, hpos, hs, 0)
        else:
            hs = _heap_push(hk, hi, hs, cc[j] + ee[j], j)
    top = 0.0
    for j in range(d):
        if cc[j] + ee[j] > top:
            top = cc[j] + ee[j]
    return top


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
    desc = desc_order(lengths)
    uniform = k_prof == 1
    for j in range(d):
        uniform = uniform and caps[j] == caps[0]
    for trial in range(trials):
        perm = desc if trial == 0 else np.random.permutation(n)
        if trial == 0 and uniform:  # longest first on identical ranks: the same choices from a heap
            obj = _dispatch_longest_first(perm, lengths, t_sum[0], t_full[0], pp, assign, cc, ee, lmax)
        else:
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
def pack_order(coeffs, rank_profile, lengths, piece_rank):
    """The order `hydraulis_pack` takes pieces in: largest workload (under its rank's profile) first, ties in
    index order. It does not depend on V, so `HydraulisPlanner.solve` computes it once for every V it packs."""
    n = lengths.shape[0]
    work = np.empty(n, dtype=np.float64)
    for k in range(coeffs.shape[0]):  # each profile's workload of every piece, kept where the rank uses it
        f, b = doc_time_split(coeffs[k], lengths)
        for i in range(n):
            if rank_profile[piece_rank[i]] == k:
                work[i] = f[i] + b[i]
    if coeffs.shape[0] == 1:  # one profile: the workload is a function of the length
        return desc_order_by(work, lengths)
    return np.argsort(-work, kind="mergesort")


@njit(cache=True)
def hydraulis_pack(coeffs, rank_profile, caps, lengths, piece_rank, per_rank):
    """`hydraulis_pack_ordered` in `pack_order`'s order."""
    order = pack_order(coeffs, rank_profile, lengths, piece_rank)
    return hydraulis_pack_ordered(coeffs, rank_profile, caps, lengths, piece_rank, per_rank, order)


@njit(cache=True)
def hydraulis_pack_ordered(coeffs, rank_profile, caps, lengths, piece_rank, per_rank, order):
    """Hydraulis Eq. (1) for one V: on every rank, pack its pieces into `per_rank` micro-batches, longest
    workload first into the least loaded micro-batch the rank's cap allows (LPT with a cap; ties to the lowest
    bin). The least loaded bin comes from a per-rank binary heap keyed (load, bin) with lazy deletion (loads
    only grow); bins over the cap for this piece are popped aside and pushed back: O(n log V) when the least
    loaded bin usually fits, instead of a scan of the rank's V bins per piece (V reaches the hundreds at the
    top of Appendix C's window); up to HEAP_MIN_BINS / 4 bins per rank the scan is cheaper and is used.

    `order`: the pieces in `pack_order`. Returns (bin of each piece as rank * per_rank + j, or -1 everywhere
    when infeasible; bin times;
    max over ranks of max bin time * (PP - 1 + V) is left to the caller)."""
    n = lengths.shape[0]
    d = rank_profile.shape[0]
    nb = d * per_rank
    assign = np.full(n, -1, dtype=np.int64)
    attn = np.zeros(nb, dtype=np.float64)
    tok = np.zeros(nb, dtype=np.int64)
    load = np.zeros(nb, dtype=np.float64)
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


@njit(cache=True)
def rank_max(rank, values, dp):
    """The largest value on each rank (-1 where a rank has none; values >= 0)."""
    out = np.full(dp, -1, dtype=np.int64)
    for i in range(rank.shape[0]):
        if values[i] > out[rank[i]]:
            out[rank[i]] = values[i]
    return out
