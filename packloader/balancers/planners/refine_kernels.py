"""Numba kernel that lowers the largest partition sum of a given partition by moves and swaps out of the heaviest
partition, never past a token cap nor past a bound on a second measure: what lets the rollout balancers and the
verl adapter start from verl's own Karmarkar-Karp answer and only ever improve on it.

Every accepted step leaves both touched partitions strictly below the old heaviest one, so the sorted vector of
sums falls lexicographically and the search ends; `rounds` bounds its work regardless."""

from __future__ import annotations

import numpy as np
from numba import njit

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
def refine_partition(part, k, work, tokens, cap, guard, guard_cap, moves, partners, rounds):
    """Improve `part` (partition 0..k-1 of each item) on the largest sum of `work`: each round takes the heaviest
    partition h and, among its `partners` lightest others, the move (`moves`: sizes may change) or swap (sizes
    kept) that lowers the larger of the two new sums most. A step must keep each partition's `tokens` within `cap`
    and its `guard` sum within `guard_cap`. Returns the new partition (the input is not changed)."""
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
        for c in range(nc):
            slot[cand[c]] = -1
        if bi < 0:
            break
        _shift(bi, h, bj, part, load, tok, gl, work, tokens, guard)
        if bx >= 0:
            _shift(bx, bj, h, part, load, tok, gl, work, tokens, guard)
    return part
