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
