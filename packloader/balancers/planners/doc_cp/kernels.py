"""The placement loop of the dynamic-cp planner in numba: each piece, in the given order, to the slot and aligned
subgroup of its CP size that keeps the pool's slowest GPU fastest.

A GPU's time over the step is the sum over slots of its connected block's slowest member (GPUs sharing a
document wait for each other; aligned subgroups nest, so connected GPUs form an aligned block). Placing a piece of
per-GPU cost c on GPUs f .. f+s-1 of slot m raises that block's maximum; the choice minimises the largest step
time of the block's GPUs after the placement, ties to the least added time (waits included), then to the earliest
slot and GPU. Memory: no GPU holds more than `cap` tokens in one slot.

A chain (`link`: slices of one piece at a CP size smaller than the piece needs whole) runs on one subgroup in
consecutive slots: its head is placed where the whole chain fits, priced as if the chain's cost fell in the head's
slot (the chain's slots are the ones it raises), and every later slice follows on the same GPUs in the next slot.
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True)
def place_pieces(order, size, cost, need, after, rest, link, slots, pool, cap):
    """(slot, first GPU) of every piece and ok; ok is False when some piece fits no slot. `after[i]`: the piece
    that must sit in an earlier slot (the previous slice of the same piece; -1 for none); `rest[i]`: slots that
    must remain after this one (its later slices); `link[i]`: 1 where the piece is a chain's slice, whose later
    slices are pieces i + 1 .. i + rest[i] (module docstring)."""
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
        span = 0
        if link[i] and after[i] >= 0:  # a chain's later slice: the next slot on its head's GPUs
            lo = slot[after[i]] + 1
            hi = lo + 1
        elif link[i]:  # a chain's head: the whole chain must fit, and its cost is the head's slot's
            span = rest[i]
            for j in range(1, span + 1):
                c += cost[i + j]
        best_obj = np.inf
        best_tie = np.inf
        bm = -1
        bf = -1
        for m in range(lo, hi):
            for f in range(0, pool, s):
                if link[i] and after[i] >= 0 and f != first[after[i]]:
                    continue
                if not fits_at(tok, need, i, span, m, f, s, cap):
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
        commit(load, tok, bfirst, bsize, slot_e, total, bm, bf, s, b0, bs, cost[i], need[i])
    return slot, first, True


@njit(cache=True)
def fits_at(tok, need, i, span, m, f, s, cap):
    """Whether piece i (and the span later slices of its chain, in the next slots) fit GPUs f .. f+s-1 from slot m."""
    for j in range(span + 1):
        for g in range(f, f + s):
            if tok[m + j, g] + need[i + j] > cap:
                return False
    return True


@njit(cache=True)
def commit(load, tok, bfirst, bsize, slot_e, total, m, f, s, b0, bs, c, need):
    """Place a piece of per-GPU cost c and `need` tokens on GPUs f .. f+s-1 of slot m, in block b0 .. b0+bs-1."""
    top = 0.0
    for g in range(f, f + s):
        load[m, g] += c
        tok[m, g] += need
    for g in range(b0, b0 + bs):
        bfirst[m, g] = b0
        bsize[m, g] = bs
        if load[m, g] > top:
            top = load[m, g]
    for g in range(b0, b0 + bs):
        total[g] += top - slot_e[m, g]
        slot_e[m, g] = top
