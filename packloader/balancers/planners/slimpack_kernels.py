"""Numba kernels of the SlimPack planner: LPT dispatch of documents over DP ranks (with DP-Merge), packing
each rank's documents into packs of balanced forward and backward time with slices cut at equal cost, and the
backward order of slice chains. Costs come from `cost.coeffs`, so the planner balances exactly what the model
and the simulator measure."""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from packloader.balancers.cost.coeffs import (
    ATTN_BWD,
    ATTN_FWD,
    LIN_BWD,
    LIN_FWD,
    SLICE_BWD,
    SLICE_FWD,
    SLICE_TILE,
    attn_time,
    doc_time_split,
)
from packloader.balancers.planners.bins import _heap_pop, _heap_push, _sift_top, desc_order_by

# ------------------------------------------------------------------------------------------------- SlimPack


@njit(cache=True, nogil=True)
def lpt_dispatch(work, dp, merge_share, lengths):
    """SlimPack phase one: pieces, heaviest first, to the least loaded DP rank (equal forward capacity per
    rank; ties to the lowest rank). A piece heavier than `merge_share` (a rank's share; inf disables DP-Merge)
    goes to a DP-Merge group of g = ceil(work / merge_share) ranks (2 <= g <= dp), the g least loaded, each
    charged work / g. `lengths`: the pieces' lengths (work is a function of them: the order is counted).

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
    order = desc_order_by(work, lengths)  # heaviest first, ties in index order (work is a function of length)
    # the least loaded ranks, ties to the lowest index, from a (load, rank) min-heap: O(log dp) a piece
    hk = np.zeros(dp, dtype=np.float64)
    hi = np.arange(dp, dtype=np.int64)  # all loads 0: index order is already a heap
    hs = dp
    sel = np.empty(dp, dtype=np.int64)
    for kk in range(n):
        i = order[kk]
        g = gsize[i]
        if g > 1:  # the g least loaded (a stable argsort's first g), in index order
            for t in range(g):
                sel[t] = hi[0]
                hs = _heap_pop(hk, hi, hs)
            grp = np.sort(sel[:g])
            for t in range(g):
                members[offs[i] + t] = grp[t]
                load[grp[t]] += work[i] / g
                hs = _heap_push(hk, hi, hs, load[grp[t]], grp[t])
        else:
            best = hi[0]
            rank[i] = best
            load[best] += work[i]
            _sift_top(hk, hi, hs, load[best], best)  # its key grew: down from the top
    return rank, members, offs


@njit(cache=True)
def slice_end(c, x0, budget, length, scale):
    """Token offset x1 (within a piece of `length` tokens) such that the slice x0..x1, attending to the
    piece's first x0 tokens, costs about `budget` forward seconds (divided by `scale`, the DP-Merge group
    size). Attention of a slice is A(x1) - A(x0) with A(x) = a*x^2 + b*x; the linear part adds lam*(x1-x0).
    Tile rounding is ignored here (the caller measures the real cost). At least x0 + 1, at most length.
    Under a measured slice term the q = x1 - x0 tokens after x0 > 0 keys cost a*q^2 + (b + 2*x*x0)*q + y*x0."""
    a = c[ATTN_FWD] / scale
    b = (c[ATTN_FWD + 1] + c[LIN_FWD + 1]) / scale
    if x0 > 0 and c[SLICE_TILE] > 0.0:
        return _slice_end_term(a, b + 2.0 * c[SLICE_FWD] / scale * x0, budget - c[SLICE_FWD + 1] / scale * x0, x0, length)
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
def _slice_end_term(a, b, target, x0, length):
    """slice_end's x1 where the slice's q tokens cost a*q^2 + b*q = target (at least x0 + 1, at most length)."""
    if target <= 0.0:
        q = 0.0
    elif a > 0.0:
        q = (-b + math.sqrt(b * b + 4.0 * a * target)) / (2.0 * a)
    elif b > 0.0:
        q = target / b
    else:
        q = float(length)
    e = x0 + int(math.floor(q))
    return min(max(e, x0 + 1), length)


@njit(cache=True)
def _slim(c, cb, lengths, f_one, budget, bbudget, cap, min_slice, allow_slice, npacks, fl, bl, tok, seg_piece,
          seg_start, seg_end, seg_pack, placed_whole, run_packs):
    """`slim_pack_rank`'s slicing of the long pieces (next-fit from pack 0); returns the segment count, or -1
    when they do not fit. run_packs > 0 bounds a run of linked packs: a piece that would take it past that many
    packs starts a new run in a fresh pack."""
    n = lengths.shape[0]
    maxseg = seg_piece.shape[0]
    lam_f = c[LIN_FWD + 1]
    lam_b = c[LIN_BWD + 1]
    ns = 0
    cur = 0
    # slim: long pieces, next-fit from pack 0. Each sliced piece starts in the pack where the previous one
    # ended (`chain`), even when that pack is already at its budget (a short first slice, at least min_slice
    # tokens, cap permitting): then the slices of all pieces form one run of linked packs from pack 0, whose
    # first-in-last-out backward overlaps the pipeline warm-up. A new run starting mid-step would have to
    # wait for its own last forward to cross every stage before its first backward: one more pipeline drain.
    chain = -1
    run_first = 0
    for i in range(n):
        l = lengths[i]
        if not allow_slice or (f_one[i] <= budget and l <= cap):
            continue
        if l <= min_slice and l <= cap:
            continue
        if run_packs > 0 and chain >= 0 and budget > 0.0 and cur - run_first + f_one[i] / budget > run_packs:
            cur += 1 if tok[cur] > 0 else 0  # a new run: its FILO backward no longer waits for this one's forwards
            chain = -1
            run_first = cur
        x0 = 0
        while x0 < l:
            if cur >= npacks:
                return -1
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
                    return -1
                cur += 1
                continue
            if ns >= maxseg:
                return -1
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
    return ns


@njit(cache=True)
def _pack_whole(lengths, f_one, b_one, budget, bbudget, cap, npacks, fl, bl, tok, seg_piece, seg_start, seg_end,
                seg_pack, ns, placed_whole):
    """`slim_pack_rank`'s whole pieces; returns the segment count, or -1 when one does not fit."""
    n = lengths.shape[0]
    maxseg = seg_piece.shape[0]
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
            return -1
        if ns >= maxseg:
            return -1
        seg_piece[ns] = i
        seg_start[ns] = 0
        seg_end[ns] = l
        seg_pack[ns] = best
        ns += 1
        fl[best] += f_one[i]
        bl[best] += b_one[i]
        tok[best] += l
    return ns


@njit(cache=True)
def _refine(lengths, f_one, b_one, cap, npacks, fl, bl, tok, seg_piece, seg_start, seg_end, seg_pack, ns):
    """`slim_pack_rank`'s last pass, in place."""
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


@njit(cache=True)
def slim_pack_rank(c, lengths, npacks, budget, bbudget, cap, min_slice, allow_slice, run_packs=0):
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
    fl = np.zeros(npacks, dtype=np.float64)  # forward attention + linear share, no floor
    bl = np.zeros(npacks, dtype=np.float64)
    tok = np.zeros(npacks, dtype=np.int64)
    f_one, b_one = doc_time_split(c, lengths)
    placed_whole = np.zeros(n, dtype=np.bool_)
    # a slice fills its pack up to the forward budget and up to the backward budget, whichever comes first
    # (a slice's backward grows faster with its prefix than its forward: a forward-only cut leaves the packs
    # of long documents heavy in backward); cb holds the backward coefficients where slice_end reads forward
    cb = c.copy()
    for j in range(3):
        cb[ATTN_FWD + j] = c[ATTN_BWD + j]
        cb[LIN_FWD + j] = c[LIN_BWD + j]
    cb[SLICE_FWD] = c[SLICE_BWD]
    cb[SLICE_FWD + 1] = c[SLICE_BWD + 1]
    ns = _slim(c, cb, lengths, f_one, budget, bbudget, cap, min_slice, allow_slice, npacks, fl, bl, tok,
               seg_piece, seg_start, seg_end, seg_pack, placed_whole, run_packs)
    if ns >= 0:
        ns = _pack_whole(lengths, f_one, b_one, budget, bbudget, cap, npacks, fl, bl, tok, seg_piece, seg_start,
                         seg_end, seg_pack, ns, placed_whole)
    if ns < 0:
        return False, seg_piece[:0], seg_start[:0], seg_end[:0], seg_pack[:0]
    _refine(lengths, f_one, b_one, cap, npacks, fl, bl, tok, seg_piece, seg_start, seg_end, seg_pack, ns)
    return True, seg_piece[:ns], seg_start[:ns], seg_end[:ns], seg_pack[:ns]


@njit(cache=True, nogil=True)
def slim_pack_ranks(c, lengths, bounds, npacks, budgets, bbudgets, cap, min_slice, allow_slice, run_packs=0):
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
        ok, sp, ss, se, sk = slim_pack_rank(c, lengths[lo:hi], npacks[r], budgets[r], bbudgets[r], cap, min_slice, allow_slice,
                                         run_packs)
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


@njit(cache=True, nogil=True)
def own_segments(by_rank, spc, ss, se, sk, sr, free_off, doc, offset, length, first_id):
    """The segments of the ranks' own pieces from `slim_pack_ranks` (segment j: piece by_rank[spc[j]], tokens
    ss..se of it, in pack sk of rank sr, whose free packs are numbered from free_off[sr] after first_id), in one
    pass: (doc, start, end, attend_from, micro-batch id, pack index, piece, whether it is a slice of a cut
    piece)."""
    k = ss.shape[0]
    s_doc = np.empty(k, dtype=np.int64)
    s_start = np.empty(k, dtype=np.int64)
    s_end = np.empty(k, dtype=np.int64)
    s_af = np.empty(k, dtype=np.int64)
    s_mb = np.empty(k, dtype=np.int64)
    at = np.empty(k, dtype=np.int64)
    piece = np.empty(k, dtype=np.int64)
    cut = np.empty(k, dtype=np.bool_)
    for j in range(k):
        p = by_rank[spc[j]]
        o = offset[p]
        piece[j] = p
        at[j] = free_off[sr[j]] + sk[j]
        s_doc[j] = doc[p]
        s_start[j] = o + ss[j]
        s_end[j] = o + se[j]
        s_af[j] = o
        s_mb[j] = first_id + at[j]
        cut[j] = ss[j] > 0 or se[j] < length[p]
    return s_doc, s_start, s_end, s_af, s_mb, at, piece, cut
