"""Numba kernel that lowers the largest partition sum of a given partition by moves and swaps out of the heaviest
partition, never past a token cap nor past a bound on a second measure: what lets the rollout balancers and the
verl adapter start from verl's own Karmarkar-Karp answer and only ever improve on it.

Every accepted step leaves both touched partitions strictly below the old heaviest one, so the sorted vector of
sums falls lexicographically and the search ends; `rounds` bounds its work regardless."""

from __future__ import annotations

import numpy as np
from numba import njit

PAIR_PARTNERS = 4  # lightest partitions tried for a one-for-two trade (each costs |items|^2)
SCAN = 4  # swap partners looked at on each side of the best-balancing one (members sorted by value)


@njit(cache=True)
def _members(part, h, cand, slot, nc, hm, cm, cstart):
    """Items of partition h into hm (returns their count), and of each candidate c into cm[cstart[c]:cstart[c+1]]."""
    n = part.shape[0]
    nh = 0
    cstart[: nc + 1] = 0
    for i in range(n):
        p = part[i]
        if p == h:
            hm[nh] = i
            nh += 1
        elif slot[p] >= 0:
            cstart[slot[p] + 1] += 1
    for c in range(nc):
        cstart[c + 1] += cstart[c]
    fill = cstart[:nc].copy()
    for i in range(n):
        p = part[i]
        if p != h and slot[p] >= 0:
            cm[fill[slot[p]]] = i
            fill[slot[p]] += 1
    return nh


@njit(cache=True)
def _best_step(h, cand, nc, hm, nh, cm, cstart, part_load, tok, gl, work, tokens, guard, cap, guard_cap, moves):
    """The move (x = -1) or swap out of partition h, with a candidate j, that lowers the larger of the two new sums
    most while keeping both within the cap and the guard: (item of h, item of j or -1, j), or i = -1 for none."""
    lh = part_load[h]
    best = lh
    bi = -1
    bx = -1
    bj = -1
    for c in range(nc):
        j = cand[c]
        gap = lh - part_load[j]
        if moves:
            for t in range(nh):
                i = hm[t]
                w = work[i]
                if 0.0 < w < gap and tok[j] + tokens[i] <= cap and gl[j] + guard[i] <= guard_cap:
                    v = max(lh - w, part_load[j] + w)
                    if v < best:
                        best, bi, bx, bj = v, i, -1, j
        js = cm[cstart[c]:cstart[c + 1]]
        if js.shape[0] == 0:
            continue
        js = js[np.argsort(work[js], kind="mergesort")]
        jw = work[js]
        for t in range(nh):
            i = hm[t]
            wi = work[i]
            pos = np.searchsorted(jw, wi - gap / 2.0)
            for q in range(max(pos - SCAN, 0), min(pos + SCAN, js.shape[0])):
                x = js[q]
                d = wi - work[x]
                if not (0.0 < d < gap):
                    continue
                if tok[h] - tokens[i] + tokens[x] > cap or tok[j] + tokens[i] - tokens[x] > cap:
                    continue
                if gl[h] - guard[i] + guard[x] > guard_cap or gl[j] + guard[i] - guard[x] > guard_cap:
                    continue
                v = max(lh - d, part_load[j] + d)
                if v < best:
                    best, bi, bx, bj = v, i, x, j
    return bi, bx, bj


@njit(cache=True)
def _best_pair_swap(h, cand, nc, hm, nh, cm, cstart, part_load, tok, gl, work, tokens, guard, cap, guard_cap):
    """An item of h for two of a candidate j: where micro-batches are nearly full, one long sequence traded for two
    shorter ones of about its tokens is what moves attention work (a single swap of equal tokens moves little).
    Returns (i, x, y, j, the larger new sum) with i = -1 for none that lowers h."""
    lh = part_load[h]
    best = lh
    bi = bx = by = bj = -1
    for c in range(nc):
        j = cand[c]
        lj = part_load[j]
        js = cm[cstart[c]:cstart[c + 1]]
        for t in range(nh):
            i = hm[t]
            for a in range(js.shape[0]):
                x = js[a]
                for b in range(a + 1, js.shape[0]):
                    y = js[b]
                    d = work[i] - work[x] - work[y]
                    if not (0.0 < d < lh - lj):
                        continue
                    dt = tokens[i] - tokens[x] - tokens[y]
                    if tok[h] - dt > cap or tok[j] + dt > cap:
                        continue
                    dg = guard[i] - guard[x] - guard[y]
                    if gl[h] - dg > guard_cap or gl[j] + dg > guard_cap:
                        continue
                    v = max(lh - d, lj + d)
                    if v < best:
                        best, bi, bx, by, bj = v, i, x, y, j
    return bi, bx, by, bj, best


@njit(cache=True)
def _shift(i, a, b, part, load, tok, gl, work, tokens, guard):
    """Item i from partition a to partition b."""
    part[i] = b
    load[a] -= work[i]
    load[b] += work[i]
    tok[a] -= tokens[i]
    tok[b] += tokens[i]
    gl[a] -= guard[i]
    gl[b] += guard[i]


@njit(cache=True)
def refine_partition(part, k, work, tokens, cap, guard, guard_cap, moves, partners, rounds, pairs):
    """Improve `part` (partition 0..k-1 of each item) on the largest sum of `work`: each round takes the heaviest
    partition h and, among its `partners` lightest others, the move (`moves`: sizes may change) or swap (sizes
    kept) that lowers the larger of the two new sums most; with `pairs` (and `moves`: sizes change), where none
    does, one item of h for two of a candidate. A step must keep each partition's `tokens` within `cap` and its
    `guard` sum within `guard_cap`. Returns the new partition (the input is not changed)."""
    n = part.shape[0]
    part = part.copy()
    load = np.zeros(k, np.float64)
    tok = np.zeros(k, np.int64)
    gl = np.zeros(k, np.float64)
    for i in range(n):
        p = part[i]
        load[p] += work[i]
        tok[p] += tokens[i]
        gl[p] += guard[i]
    slot = np.full(k, -1, np.int64)
    cand = np.empty(max(partners, 1), np.int64)
    hm = np.empty(n, np.int64)
    cm = np.empty(n, np.int64)
    cstart = np.zeros(max(partners, 1) + 1, np.int64)
    for _ in range(rounds):
        h = int(np.argmax(load))
        nc = 0
        for j in np.argsort(load, kind="mergesort"):
            if nc == partners:
                break
            if j != h and load[j] < load[h]:
                cand[nc] = j
                slot[j] = nc
                nc += 1
        if nc == 0:
            break
        nh = _members(part, h, cand, slot, nc, hm, cm, cstart)
        bi, bx, bj = _best_step(h, cand, nc, hm, nh, cm, cstart, load, tok, gl, work, tokens, guard, cap, guard_cap,
                                moves)
        by = -1
        if bi < 0 and moves and pairs:  # no single move or swap helps: try one item for two
            bi, bx, by, bj, _ = _best_pair_swap(h, cand, min(nc, PAIR_PARTNERS), hm, nh, cm, cstart, load, tok, gl,
                                                work, tokens, guard, cap, guard_cap)
        for c in range(nc):
            slot[cand[c]] = -1
        if bi < 0:
            break
        _shift(bi, h, bj, part, load, tok, gl, work, tokens, guard)
        if bx >= 0:
            _shift(bx, bj, h, part, load, tok, gl, work, tokens, guard)
        if by >= 0:
            _shift(by, bj, h, part, load, tok, gl, work, tokens, guard)
    return part


@njit(cache=True)
def repair_cap(part, k, work, tokens, cap):
    """`part` with every partition brought within `cap` tokens by moving items out of those over it, each to the
    least loaded partition (by `work`) it fits: from an over-full partition, the shortest item that ends the excess
    alone, else its longest that fits somewhere. Returns (the new partition, whether it fits): a balanced answer that
    ignores the cap (verl's) repaired by few moves stays nearly as balanced."""
    n = part.shape[0]
    part = part.copy()
    load = np.zeros(k, np.float64)
    tok = np.zeros(k, np.int64)
    for i in range(n):
        load[part[i]] += work[i]
        tok[part[i]] += tokens[i]
    by_len = np.argsort(tokens, kind="mergesort")
    for src in range(k):
        while tok[src] > cap:
            excess = tok[src] - cap
            pick = -1
            dest = -1
            for t in range(n):  # shortest first: the first that ends the excess and fits elsewhere wins
                i = by_len[t]
                if part[i] != src or tokens[i] < excess:
                    continue
                d = _lightest_fit(load, tok, cap, tokens[i], src)
                if d >= 0:
                    pick, dest = i, d
                    break
            if pick < 0:
                for t in range(n - 1, -1, -1):  # else the longest that fits somewhere
                    i = by_len[t]
                    if part[i] != src or tokens[i] == 0:
                        continue
                    d = _lightest_fit(load, tok, cap, tokens[i], src)
                    if d >= 0:
                        pick, dest = i, d
                        break
            if pick < 0:
                return part, False
            part[pick] = dest
            load[src] -= work[pick]
            load[dest] += work[pick]
            tok[src] -= tokens[pick]
            tok[dest] += tokens[pick]
    return part, True


@njit(cache=True)
def _lightest_fit(load, tok, cap, l, skip):
    best = -1
    for j in range(load.shape[0]):
        if j != skip and tok[j] + l <= cap and (best < 0 or load[j] < load[best]):
            best = j
    return best
