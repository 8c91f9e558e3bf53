"""Numba kernel of Karmarkar-Karp's largest differencing method (LDM), as verl's
``get_seqlen_balanced_partitions`` runs it: thousands of items over up to thousands of partitions, with its own
heap of partial partitions (keyed by spread, top and sequence number)."""

from __future__ import annotations

import numpy as np
from numba import njit


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
def _join_single(sums, cnt, head, tail, nxt, values, y):
    """Karmarkar-Karp's fast path: value y joins the smallest of a state's sets (rows of one slot), which then
    moves up to its place in the decreasing order."""
    k = sums.shape[0]
    j = k - 1
    if cnt[j] == 0:
        head[j] = y
    else:
        nxt[tail[j]] = y
    tail[j] = y
    sums[j] += values[y]
    cnt[j] += 1
    s0, c0, h0, t0 = sums[j], cnt[j], head[j], tail[j]
    while j > 0 and _set_before(s0, c0, h0, sums[j - 1], cnt[j - 1], head[j - 1]):
        sums[j] = sums[j - 1]
        cnt[j] = cnt[j - 1]
        head[j] = head[j - 1]
        tail[j] = tail[j - 1]
        j -= 1
    sums[j], cnt[j], head[j], tail[j] = s0, c0, h0, t0


@njit(cache=True)
def _merge_states(sums, cnt, head, tail, nxt, values, slot_of, single, a, b, ts, tc, th, tt):
    """Karmarkar-Karp's general merge into ts/tc/th/tt, sorted: set i of state a joined by set k-1-i of state b
    (a's items first); a state without a slot is the single value `single[...]`."""
    k = ts.shape[0]
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
    _sort_sets(ts, tc, th, tt)


@njit(cache=True)
def _initial_states(values, order, k, equal_size, sums, cnt, head, tail, single, slot_of, spread, top, seq, heap):
    """The starting states on the heap: the sorted values k at a time, each in a slot (`equal_size`), or one
    unmaterialised state per value. Returns (heap size, slots used)."""
    n = values.shape[0]
    nstates = n // k if equal_size else n
    used = 0
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
    return hsize, used


@njit(cache=True)
def _read_partition(last, single, slot_of, cnt, head, nxt, part):
    """Each value's partition index from the final state `last`, into `part`."""
    if single[last] >= 0:
        part[single[last]] = 0
        return
    sl = slot_of[last]
    for i in range(cnt.shape[1]):
        it = head[sl, i] if cnt[sl, i] > 0 else -1
        while it >= 0:
            part[it] = i
            it = nxt[it]


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
    heap = np.empty(nstates, np.int64)
    hsize, used = _initial_states(values, order, k, equal_size, sums, cnt, head, tail, single, slot_of, spread, top,
                                  seq, heap)
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
            _join_single(sums[sl], cnt[sl], head[sl], tail[sl], nxt, values, single[b])
        else:
            _merge_states(sums, cnt, head, tail, nxt, values, slot_of, single, a, b, ts, tc, th, tt)
            if slot_of[b] >= 0 and slot_of[b] != sl:
                free[nfree] = slot_of[b]
                nfree += 1
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
    _read_partition(heap[0], single, slot_of, cnt, head, nxt, part)
    return part
