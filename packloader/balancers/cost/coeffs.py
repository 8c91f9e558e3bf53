"""Time of a micro-batch: attention per segment (quadratic, tile floor) plus linear work per token (with a
per-micro-batch floor), forward and backward separately.

The formula is the one `contracts.CostProfile` documents. With ``qt = ceil(q / tile) * tile``::

    attn(q, p) = a * (qt^2 + 2*qt*p) + b * qt + c        # a segment of q query tokens after p earlier keys
    attn(q, p) = a * qt^2 + b * qt + c + x*2*qs*p + y*p  # p > 0 under a measured `slice_term` (qs: its tile)
    lin(n)     = a * n^2 + b * n + c                      # a micro-batch of n tokens; c is its floor
    time(mb)   = sum over segments of attn(q_i, p_i) + lin(sum q_i)

``p = start - attend_from`` (0 for a whole document or an independent piece). Where the profile carries a
measured `LinTable`, lin(n) interpolates it instead (floor below its first count, the last per-token rate past
its last). The coefficients travel as a flat float64[NUM_COEFFS] array in `contracts.COEFF_LAYOUT` order so the
numba kernels (here and in the planners) take them without Python objects.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from packloader.contracts import COEFF_LAYOUT, MAX_LIN_KNOTS, CostProfile

# Offsets into the coefficient array (COEFF_LAYOUT).
TILE = 0
ATTN_FWD = 1
ATTN_BWD = 4
LIN_FWD = 7
LIN_BWD = 10
LIN_KNOTS = 13  # number of LinTable knots (0: the lin polynomials are the linear part)
LIN_TOK = 14
LIN_TFWD = LIN_TOK + MAX_LIN_KNOTS
LIN_TBWD = LIN_TOK + 2 * MAX_LIN_KNOTS
SLICE_TILE = LIN_TOK + 3 * MAX_LIN_KNOTS  # 0: no slice term, slices priced by the rule
SLICE_FWD = SLICE_TILE + 1  # x, y
SLICE_BWD = SLICE_TILE + 3
NUM_COEFFS = SLICE_TILE + 5


def profile_coeffs(profile: CostProfile) -> np.ndarray:
    """The profile as float64[NUM_COEFFS] in `COEFF_LAYOUT` order."""
    out = np.zeros(NUM_COEFFS, dtype=np.float64)
    out[TILE] = float(profile.tile)
    for off, poly in ((ATTN_FWD, profile.attn_fwd), (ATTN_BWD, profile.attn_bwd), (LIN_FWD, profile.lin_fwd), (LIN_BWD, profile.lin_bwd)):
        out[off], out[off + 1], out[off + 2] = poly.a, poly.b, poly.c
    t = profile.lin_table
    if t is not None:
        k = len(t.tokens)
        out[LIN_KNOTS] = k
        out[LIN_TOK:LIN_TOK + k] = t.tokens
        out[LIN_TFWD:LIN_TFWD + k] = t.fwd
        out[LIN_TBWD:LIN_TBWD + k] = t.bwd
    st = profile.slice_term
    if st is not None:
        out[SLICE_TILE] = float(st.tile)
        out[SLICE_FWD], out[SLICE_FWD + 1], out[SLICE_BWD], out[SLICE_BWD + 1] = st.x_fwd, st.y_fwd, st.x_bwd, st.y_bwd
    assert len(COEFF_LAYOUT) == NUM_COEFFS
    return out


# ----------------------------------------------------------------------------------------------- kernels


@njit(cache=True, inline="always")
def _round_tile(q, tile):
    if tile <= 1.0:
        return float(q)
    return math.ceil(q / tile) * tile


@njit(cache=True)
def attn_time(c, q, p, bwd):
    """Attention time of one segment: q query tokens attending causally to themselves and p earlier keys."""
    if q <= 0:
        return 0.0
    o = ATTN_BWD if bwd else ATTN_FWD
    qt = _round_tile(q, c[TILE])
    if p > 0 and c[SLICE_TILE] > 0.0:  # a measured slice term: attn(q, 0) + x*2*qs*p + y*p
        s = SLICE_BWD if bwd else SLICE_FWD
        qs = _round_tile(q, c[SLICE_TILE])
        return c[o] * qt * qt + c[o + 1] * qt + c[o + 2] + c[s] * 2.0 * qs * p + c[s + 1] * p
    return c[o] * (qt * qt + 2.0 * qt * p) + c[o + 1] * qt + c[o + 2]


@njit(cache=True)
def lin_time(c, n, bwd):
    """Linear (GEMM + element-wise) time of a micro-batch of n tokens, including its floor."""
    x = float(n)
    k = int(c[LIN_KNOTS])
    if k > 0:
        t = LIN_TBWD if bwd else LIN_TFWD
        if x >= c[LIN_TOK + k - 1]:
            return c[t + k - 1] * x / c[LIN_TOK + k - 1]
        # from the top: planners mostly ask about micro-batches near the cap
        for i in range(k - 2, -1, -1):
            x0 = c[LIN_TOK + i]
            if x >= x0:
                x1 = c[LIN_TOK + i + 1]
                return c[t + i] + (c[t + i + 1] - c[t + i]) * (x - x0) / (x1 - x0)
        return c[t]
    o = LIN_BWD if bwd else LIN_FWD
    return c[o] * x * x + c[o + 1] * x + c[o + 2]


@njit(cache=True)
def lin_share(c, n, bwd):
    """A document's share of the linear part: the smooth polynomial without the floor (the per-token rate), so
    the shares of a micro-batch's documents add up to about its linear time less the floor."""
    o = LIN_BWD if bwd else LIN_FWD
    x = float(n)
    return c[o] * x * x + c[o + 1] * x


@njit(cache=True)
def lin_times(c, n, bwd):
    """lin_time of each of the (possibly fractional) token counts n."""
    out = np.empty(n.shape[0], dtype=np.float64)
    for i in range(n.shape[0]):
        out[i] = lin_time(c, n[i], bwd)
    return out


@njit(cache=True)
def microbatch_time(c, q, p):
    """(forward, backward) time of one micro-batch whose segments have q[i] query tokens after p[i] keys."""
    f = 0.0
    b = 0.0
    n = 0
    for i in range(q.shape[0]):
        f += attn_time(c, q[i], p[i], False)
        b += attn_time(c, q[i], p[i], True)
        n += q[i]
    return f + lin_time(c, n, False), b + lin_time(c, n, True)


@njit(cache=True)
def segment_times_kernel(c, q, p):
    """Attention-only forward and backward time of each segment."""
    m = q.shape[0]
    f = np.empty(m, dtype=np.float64)
    b = np.empty(m, dtype=np.float64)
    for i in range(m):
        f[i] = attn_time(c, q[i], p[i], False)
        b[i] = attn_time(c, q[i], p[i], True)
    return f, b


@njit(cache=True)
def doc_time_split(c, lengths):
    """Forward and backward workload of each length as a whole document: its attention plus its share of the
    linear part (`lin_share`: no floor). What a balancer sums over the documents of a micro-batch."""
    m = lengths.shape[0]
    f = np.empty(m, dtype=np.float64)
    b = np.empty(m, dtype=np.float64)
    for i in range(m):
        l = lengths[i]
        f[i] = attn_time(c, l, 0, False) + lin_share(c, l, False)
        b[i] = attn_time(c, l, 0, True) + lin_share(c, l, True)
    return f, b


@njit(cache=True)
def doc_time_kernel(c, lengths):
    """Forward + backward workload of each length (see doc_time_split)."""
    f, b = doc_time_split(c, lengths)
    return f + b


@njit(cache=True)
def microbatch_times_csr(c, q, p, offsets):
    """(forward, backward) time of many micro-batches at once: micro-batch k holds segments
    offsets[k]..offsets[k+1]-1 of the flat q, p arrays."""
    m = offsets.shape[0] - 1
    f = np.empty(m, dtype=np.float64)
    b = np.empty(m, dtype=np.float64)
    for k in range(m):
        fs = 0.0
        bs = 0.0
        n = 0
        for i in range(offsets[k], offsets[k + 1]):
            fs += attn_time(c, q[i], p[i], False)
            bs += attn_time(c, q[i], p[i], True)
            n += q[i]
        f[k] = fs + lin_time(c, n, False)
        b[k] = bs + lin_time(c, n, True)
    return f, b


@njit(cache=True)
def microbatch_times_by_id(c, q, p, mb, m):
    """`microbatch_times_csr` for segments given in any order with their micro-batch ids mb[i] (0..m-1):
    each micro-batch sums its segments in the order they come, so segments already grouped stably give the
    same sums as the CSR kernel, without the sort."""
    fs = np.zeros(m, dtype=np.float64)
    bs = np.zeros(m, dtype=np.float64)
    n = np.zeros(m, dtype=np.int64)
    for i in range(q.shape[0]):
        k = mb[i]
        fs[k] += attn_time(c, q[i], p[i], False)
        bs[k] += attn_time(c, q[i], p[i], True)
        n[k] += q[i]
    for k in range(m):
        fs[k] += lin_time(c, n[k], False)
        bs[k] += lin_time(c, n[k], True)
    return fs, bs
