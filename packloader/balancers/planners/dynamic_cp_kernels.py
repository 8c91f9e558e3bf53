"""The placement loop of the dynamic-cp planner in numba: each piece, in the given order, to the slot and aligned
subgroup of its CP size that keeps the pool's slowest GPU fastest.

A GPU's time over the step is the sum over slots of its connected block's slowest member (GPUs sharing a
document wait for each other; aligned subgroups nest, so connected GPUs form an aligned block). Placing a piece of
per-GPU cost c on GPUs f .. f+s-1 of slot m raises that block's maximum; the choice minimises the largest step
time of the block's GPUs after the placement, ties to the least added time (waits included), then to the earliest
slot and GPU. Memory: no GPU holds more than `cap` tokens in one slot.
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True)
def place_pieces(order, size, cost, need, after, rest, slots, pool, cap):
    """(slot, first GPU) of every piece and ok; ok is False when some piece fits no slot. `after[i]`: the piece
    that must sit in an earlier slot (the previous slice of the same piece; -1 for none); `rest[i]`: slots that
    must remain after this one (its later slices)."""
    n = size.shape[0]
    slot = np.full(n, -1, dtype=np.int64)
    first = np.full(n, -1, dtype=np.int64)
    load = np.zeros((slots, pool))
    tok = np.zeros((slots, pool), dtype=np.int64)
    bfirst = np.empty((slots, pool), dtype=np.int64)
    bsize = np.ones((slots, pool), dtype=np.int64)
    for m in range(slots):
        for g in range(pool):
            bfirst[m, g] = g
    slot_e = np.zeros((slots, pool))
    total = np.zeros(pool)
    for k in range(order.shape[0]):
        i = order[k]
        s = size[i]
        c = cost[i]
        lo = 0 if after[i] < 0 else slot[after[i]] + 1
        hi = slots - rest[i]
        best_obj = np.inf
        best_tie = np.inf
        bm = -1
        bf = -1
        for m in range(lo, hi):
            for f in range(0, pool, s):
                fits = True
                for g in range(f, f + s):
                    if tok[m, g] + need[i] > cap:
                        fits = False
                        break
                if not fits:
                    continue
                b0 = bfirst[m, f] if bsize[m, f] >= s else f
                bs = bsize[m, f] if bsize[m, f] >= s else s
                top = 0.0
                for g in range(b0, b0 + bs):
                    x = load[m, g] + (c if f <= g < f + s else 0.0)
                    if x > top:
                        top = x
                obj = 0.0
                tie = 0.0
                for g in range(b0, b0 + bs):
                    e = total[g] - slot_e[m, g] + top
                    if e > obj:
                        obj = e
                    tie += top - slot_e[m, g]
                if obj < best_obj * (1 - 1e-12) or (obj <= best_obj * (1 + 1e-12) and tie < best_tie * (1 - 1e-12)):
                    best_obj = obj
                    best_tie = tie
                    bm = m
                    bf = f
        if bm < 0:
            return slot, first, False
        slot[i] = bm
        first[i] = bf
        b0 = bfirst[bm, bf] if bsize[bm, bf] >= s else bf
        bs = bsize[bm, bf] if bsize[bm, bf] >= s else s
        top = 0.0
        for g in range(bf, bf + s):
            load[bm, g] += c
            tok[bm, g] += need[i]
        for g in range(b0, b0 + bs):
            bfirst[bm, g] = b0
            bsize[bm, g] = bs
            if load[bm, g] > top:
                top = load[bm, g]
        for g in range(b0, b0 + bs):
            total[g] += top - slot_e[bm, g]
            slot_e[bm, g] = top
    return slot, first, True
