"""ZB-V, the V-shaped zero-bubble schedule (Qi et al. 2024, section 6; torch.distributed.pipelining's
ScheduleZBVZeroBubble): two model chunks per pipeline rank placed as a V, rank r holding model stages r and
2*pp-1-r, every backward split into the input gradient (B) and the weight gradient (W).

The rank's order is torch's template (warm-up, steady F/B/W of both chunks, cool-down), with its k-th forward of
a chunk running micro-batch k and its k-th B and W running `bwd_order[k]`. Without slices this is torch's order
exactly, its padding to 2*pp-1 micro-batches included (the slots of absent micro-batches dropped).

A sliced document's backwards go last slice first (its later slices' key/value gradients flow to the earlier
ones), so the backward order can name a micro-batch whose forward the template has not run yet. At the first
such B (the same slot on every rank: where rank 0, the rank with the least lead, would lack the forward), every
rank runs all its remaining forwards, chunk 0's kept ahead of chunk 1's by torch's warm-up lead (2*(pp-r)-1),
and the template's later forward slots run nothing. Deciding it at the same slot on every rank keeps the ranks
consistent (no deadlock); keeping chunk 0 ahead lets the forwards flow through the V rather than cross it one
micro-batch at a time. The activations of those forwards stay alive until their backwards: the simulator's
memory timeline counts them (what `auto` checks against the device)."""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True)
def v_stage_rank(vs, pp):
    """The pipeline rank that holds model stage `vs` under the V placement."""
    return vs if vs < pp else 2 * pp - 1 - vs


@njit(cache=True)
def _template(pp, r, n):
    """Torch's ZB-V slots of rank r for n micro-batches: rows (op 0 F / 1 B / 2 W, chunk, count)."""
    out = np.empty((6 * n, 3), dtype=np.int64)
    k = 0
    cnt = np.zeros((3, 2), dtype=np.int64)  # per op, per chunk: how many issued
    plan = []  # phases as (op, chunk) sequences, appended below
    for _ in range(2 * (pp - r) - 1):
        plan.append((0, 0))
    for _ in range(r):
        plan.append((0, 1))
        plan.append((0, 0))
    for _ in range(pp - r):
        plan.append((0, 1))
        plan.append((1, 1))
        plan.append((2, 1))
    for op, c in plan:
        out[k, 0], out[k, 1], out[k, 2] = op, c, cnt[op, c]
        cnt[op, c] += 1
        k += 1
    while cnt[0, 1] < cnt[0, 0] or cnt[0, 0] < n:  # steady
        if cnt[0, 0] < n:
            out[k, 0], out[k, 1], out[k, 2] = 0, 0, cnt[0, 0]
            cnt[0, 0] += 1
            k += 1
        for op, c in ((1, 0), (2, 0), (0, 1), (1, 1), (2, 1)):
            out[k, 0], out[k, 1], out[k, 2] = op, c, cnt[op, c]
            cnt[op, c] += 1
            k += 1
    for _ in range(r):  # cool-down
        for c in (0, 1):
            out[k, 0], out[k, 1], out[k, 2] = 1, c, cnt[1, c]
            cnt[1, c] += 1
            k += 1
    for _ in range(pp - r):
        for op in (1, 2):
            out[k, 0], out[k, 1], out[k, 2] = op, 0, cnt[op, 0]
            cnt[op, 0] += 1
            k += 1
    for c in (1, 0):
        while cnt[2, c] < cnt[1, c]:
            out[k, 0], out[k, 1], out[k, 2] = 2, c, cnt[2, c]
            cnt[2, c] += 1
            k += 1
    return out[:k]


@njit(cache=True)
def _forward(ops, r, k, stage, m, nf, c, lead):
    """Put the rank's next forward of chunk c at position k, for chunk 1 after chunk 0's forwards up to `lead`
    micro-batches ahead of it (at least the same micro-batch's: chunk 1's forward of u needs chunk 0's, on this
    rank or through the ranks below); returns the next position."""
    if c == 1:
        while nf[0] < min(m, nf[1] + lead):
            ops[r, k] = (stage[0] * m + nf[0]) * 3
            nf[0] += 1
            k += 1
    if nf[c] < m:
        ops[r, k] = (stage[c] * m + nf[c]) * 3
        nf[c] += 1
        k += 1
    return k


@njit(cache=True)
def build_ops_zbv(pp, m, bwd_order):
    """(pp, 6*m) task order per rank, encoded as `kernels` does ((stage*m + u)*3 + op), stage in model order."""
    n_tmpl = max(2 * pp - 1, m)
    early = m  # the first B slot whose micro-batch's forward rank 0 has not run by then (module docstring)
    for j in range(m):
        if bwd_order[j] > j:
            early = j
            break
    ops = np.empty((pp, 6 * m), dtype=np.int64)
    for r in range(pp):
        stage = np.array([r, 2 * pp - 1 - r], dtype=np.int64)
        lead = 2 * (pp - r) - 1
        nf = np.zeros(2, dtype=np.int64)  # next forward to run, per chunk
        k = 0
        tmpl = _template(pp, r, n_tmpl)
        for i in range(tmpl.shape[0]):
            op, c, j = tmpl[i, 0], tmpl[i, 1], tmpl[i, 2]
            if op == 0:
                k = _forward(ops, r, k, stage, m, nf, c, 1)
                continue
            if j >= m:
                continue
            while op == 1 and c == 1 and j == early and nf[1] < m:  # every rank: all its forwards now
                k = _forward(ops, r, k, stage, m, nf, 1, lead)
            ops[r, k] = (stage[c] * m + bwd_order[j]) * 3 + op
            k += 1
    return ops


def v_static_bytes(static: np.ndarray, memory) -> np.ndarray:
    """Per-rank static bytes (`memory.static_bytes(s)` for s in range(pp), where the memory model puts the
    embedding on rank 0 and the LM head on rank pp-1) moved to the V placement: rank 0 holds the last model stage,
    so the head's bytes move from rank pp-1 to rank 0. The head's share is rank pp-1's bytes less those of a
    stage holding neither end (the memory model's stage -1)."""
    out = np.array(static, dtype=np.float64)
    pp = len(out)
    if pp > 1:
        head = out[pp - 1] - memory.static_bytes(-1)
        out[0] += head
        out[pp - 1] -= head
    return out
