"""Numba helpers for planners that fill micro-batches ("bins") one piece at a time (wlb, hydraulis): bin
times from the cost coefficients, and a (key, index) min-heap for picking the lightest bin.

A *piece* is an independent run of tokens of one document (a whole document or a context-window piece); its
workload is `doc_time_split` (attention + linear share, no per-micro-batch floor). A *bin* is one micro-batch;
its time is the sum of its segments' attention plus `lin_time` of its token count, which includes the floor.
Orders come from stable sorts and ties go to the lowest index, so equal inputs give equal outputs."""

from __future__ import annotations

import numpy as np
from numba import njit

from packloader.balancers.cost.coeffs import attn_time, lin_time


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


@njit(cache=True)
def _sift(key, idx, pos, size, j, k, i):
    """Put (k, i) at position j of the heap in key[:size], idx[:size], where it is not below what was there (keys
    here only grow), and move it down; its smaller child chosen without a branch (which child is a coin toss for
    the predictor). pos[item] tracks each item's position when `pos` is an array; with pos=None numba compiles
    the loop without those stores (the `is None` branches are pruned at compile time)."""
    while True:
        c = 2 * j + 1
        if c >= size:
            break
        if c + 1 < size:
            k1 = key[c + 1]
            k0 = key[c]
            c += (k1 < k0) | ((k1 == k0) & (idx[c + 1] < idx[c]))
        kc = key[c]
        if k < kc or (k == kc and i < idx[c]):
            break
        key[j] = kc
        idx[j] = idx[c]
        if pos is not None:
            pos[idx[j]] = j
        j = c
    key[j] = k
    idx[j] = i
    if pos is not None:
        pos[i] = j


@njit(cache=True)
def _sift_down(key, idx, pos, size, j):
    """Restore the heap in key[:size], idx[:size] after the entry at position j grew its key: the entry moves
    down; pos[item] tracks each item's position, so a bin whose key grew anywhere in the heap is found without a
    search (and without the stale entries of lazy deletion)."""
    _sift(key, idx, pos, size, j, key[j], idx[j])


@njit(cache=True)
def _sift_top(key, idx, size, k, i):
    """The heap in key[:size], idx[:size] with its top replaced by (k, i), which is not below the old top (a
    least loaded bin or rank that took a piece): `_sift_down` from the root without item positions (for heaps
    that are only ever changed at the top, pushed or popped), ~20 % faster at a thousand ranks."""
    _sift(key, idx, None, size, 0, k, i)


# ------------------------------------------------------------------------------------------------ orders

SORT_SPAN = 1 << 20  # lengths up to this (or up to 4 x the piece count) are ordered by counting, not merge sort


@njit(cache=True)
def _counting_span(lengths):
    """The largest length when a counting sort over 0..max pays (non-negative lengths, max within SORT_SPAN or
    4 x the count), else -1."""
    n = lengths.shape[0]
    top = 0
    for i in range(n):
        if lengths[i] < 0:
            return -1
        if lengths[i] > top:
            top = lengths[i]
    return top if top <= max(SORT_SPAN, 4 * n) else -1


@njit(cache=True)
def desc_order(lengths):
    """np.argsort(-lengths, kind="mergesort") (longest first, ties in index order) by a counting sort: O(n +
    max length) instead of O(n log n), for the planners that take pieces longest first."""
    n = lengths.shape[0]
    top = _counting_span(lengths)
    if top < 0:
        return np.argsort(-lengths, kind="mergesort")
    start = np.zeros(top + 2, dtype=np.int64)
    for i in range(n):
        start[top - lengths[i] + 1] += 1
    for k in range(top + 1):
        start[k + 1] += start[k]
    out = np.empty(n, dtype=np.int64)
    for i in range(n):
        k = top - lengths[i]
        out[start[k]] = i
        start[k] += 1
    return out


@njit(cache=True)
def desc_order_by(key, lengths):
    """np.argsort(-key, kind="mergesort") (largest key first, ties in index order) where key[i] is a function of
    lengths[i] alone (a piece's workload under one cost profile): the distinct lengths are sorted by their key,
    then the pieces counted into those classes, so the sort is over distinct lengths, not pieces."""
    n = lengths.shape[0]
    top = _counting_span(lengths)
    if top < 0:
        return np.argsort(-key, kind="mergesort")
    first = np.full(top + 1, -1, dtype=np.int64)
    nd = 0
    for i in range(n):
        if first[lengths[i]] < 0:
            first[lengths[i]] = i
            nd += 1
    reps = np.empty(nd, dtype=np.int64)  # a piece of each distinct length
    k = 0
    for l in range(top + 1):
        if first[l] >= 0:
            reps[k] = first[l]
            k += 1
    rkey = np.empty(nd, dtype=np.float64)
    for k in range(nd):
        rkey[k] = -key[reps[k]]
    ro = np.argsort(rkey, kind="mergesort")
    cls = np.empty(top + 1, dtype=np.int64)  # class of each length: equal keys share one, largest key first
    c = -1
    for k in range(nd):
        if k == 0 or rkey[ro[k]] != rkey[ro[k - 1]]:
            c += 1
        cls[lengths[reps[ro[k]]]] = c
    start = np.zeros(c + 2, dtype=np.int64)
    for i in range(n):
        start[cls[lengths[i]] + 1] += 1
    for k in range(c + 1):
        start[k + 1] += start[k]
    out = np.empty(n, dtype=np.int64)
    for i in range(n):
        k = cls[lengths[i]]
        out[start[k]] = i
        start[k] += 1
    return out


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
