"""Numba kernels of the pipeline simulator: build a schedule's per-rank action order, list-schedule its DAG,
and step times for many ranks at once (what `auto` calls per candidate). `simulator.py` wraps them for plans.

A task is (virtual stage, micro-batch, op) encoded as (vs*m + u)*3 + op: op 0 forward, 1 backward, 2 weight
gradient. Under ZB-H1 (kind 3) the backward splits into the input gradient (op 1, "B") and the weight gradient
(op 2, "W"), and so does ZB-V (kind 4, `zbv.py`: two chunks per rank in a V, rank r holding model stages r and
2*pp-1-r); every other schedule runs whole backwards and no W. A W takes the `wgt` time of its micro-batch
(half the linear backward: dX and dW are two GEMMs of equal size, attention has no weights) and its B the rest."""

from __future__ import annotations

import numpy as np
from numba import njit

from packloader.balancers.cost.schedules import ORDER_GPIPE, ORDER_ZB_H1, ORDER_ZB_V
from packloader.balancers.cost.schedules import SCHEDULE_ORDERS as SCHEDULES  # noqa: F401  (name -> order, re-exported)
from packloader.balancers.sim.zbv import build_ops_zbv

# the registry's order codes (`cost/schedules.py`); numba reads module globals as compile-time constants
GPIPE = ORDER_GPIPE
ZB_H1 = ORDER_ZB_H1
ZB_V = ORDER_ZB_V


# ----------------------------------------------------------------------------------------------- kernels


@njit(cache=True)
def _enc(vs, u, op, m):
    return (vs * m + u) * 3 + op


@njit(cache=True)
def tasks_per_rank(m, vpp, kind):
    """How many tasks each pipeline rank runs: F and B per micro-batch and chunk, and W under ZB-H1 and ZB-V."""
    return (3 if kind == ZB_H1 or kind == ZB_V else 2) * m * vpp


@njit(cache=True)
def build_ops(pp, vpp, m, kind, bwd_order):
    """Per pipeline rank, the order in which it runs its tasks (`tasks_per_rank`; encoded as above).

    kind: 0 = 1F1B, 1 = GPipe, 2 = interleaved 1F1B (same as 1F1B when vpp == 1), 3 = ZB-H1 (vpp 1): the
    1F1B order of F and B, and after rank s's k-th B the W of its (k - s)-th B once k >= s (the last stage keeps
    pp - 1 Ws back, the first none, as torch.distributed.pipelining's zero-bubble rank ops), the rest at the end;
    at vpp > 1 the same on interleaved 1F1B's order with one warm-up forward per hop (torch's
    ScheduleInterleavedZeroBubble); 4 = ZB-V (vpp 2, `zbv.build_ops_zbv`).
    """
    if kind == ZB_V:
        return build_ops_zbv(pp, m, bwd_order)
    n = tasks_per_rank(m, vpp, kind)
    ops = np.empty((pp, n), dtype=np.int64)
    nv = m * vpp
    # virtual forward / backward sequences: groups of pp micro-batches, chunk by chunk (Megatron's order)
    fu = np.empty(nv, dtype=np.int64)
    fc = np.empty(nv, dtype=np.int64)
    bu = np.empty(nv, dtype=np.int64)
    bc = np.empty(nv, dtype=np.int64)
    k = 0
    g0 = 0
    while g0 < m:
        gsz = min(pp, m - g0) if vpp > 1 else m
        for c in range(vpp):
            for j in range(gsz):
                fu[k] = g0 + j
                fc[k] = c
                bu[k] = bwd_order[g0 + j]
                bc[k] = vpp - 1 - c
                k += 1
        g0 += gsz
    issued = np.zeros((m, vpp), dtype=np.bool_)
    for s in range(pp):
        issued[:, :] = False
        if kind == GPIPE:
            warm = nv
        elif vpp > 1:  # Megatron's; the zero-bubble variant warms up one forward per hop, not two (torch's)
            warm = min((pp - s - 1) * (1 if kind == ZB_H1 else 2) + (vpp - 1) * pp, nv)
        else:
            warm = min(pp - s - 1, nv)
        # Before its nb-th backward a rank has run warm + nb + 1 forwards (the 1F1B / Megatron rule), or more
        # when that backward's forward comes later in the forward order (injected forwards); an injection
        # does not raise the lead for the backwards after it.
        k = 0
        nf = 0
        nb = 0
        while nb < nv:
            target = min(nv, warm + nb + 1)
            while nf < target or not issued[bu[nb], bc[nb]]:
                ops[s, k] = _enc(fc[nf] * pp + s, fu[nf], 0, m)
                issued[fu[nf], fc[nf]] = True
                k += 1
                nf += 1
            ops[s, k] = _enc(bc[nb] * pp + s, bu[nb], 1, m)
            k += 1
            if kind == ZB_H1 and nb >= s:
                ops[s, k] = _enc(bc[nb - s] * pp + s, bu[nb - s], 2, m)
                k += 1
            nb += 1
        if kind == ZB_H1:
            for j in range(max(nv - s, 0), nv):
                ops[s, k] = _enc(bc[j] * pp + s, bu[j], 2, m)
                k += 1
    return ops


@njit(cache=True)
def sim_buffers(pp, vpp, m, kind):
    """The output buffers `simulate_kernel` fills: task start and finish (V*m*3), the memory timeline (pp, 2*n
    events for the n = tasks_per_rank tasks of a stage), peak and busy per stage."""
    V = pp * vpp
    n = tasks_per_rank(m, vpp, kind)
    return (np.empty(V * m * 3, dtype=np.float64), np.empty(V * m * 3, dtype=np.float64),
            np.empty((pp, 2 * n), dtype=np.float64), np.empty((pp, 2 * n), dtype=np.float64),
            np.empty(pp, dtype=np.float64), np.empty(pp, dtype=np.float64))


@njit(cache=True, inline="always")
def _after(ready, done, lag):
    """When a task may start given one more dependency that finished at `done` (-1: has not run) and takes
    `lag` to arrive; -1 once any dependency has not run."""
    if ready < 0.0 or done < 0.0:
        return -1.0
    return done + lag if done + lag > ready else ready


@njit(cache=True, inline="always")
def _ready(op, vs, u, m, V, p2p, finish, in_ptr, in_src, out_ptr, out_dst):
    """When task (vs, u, op) may start: F after the previous stage's F and the F of the micro-batches whose keys
    it reads; B after its F, the next stage's B and the B of the micro-batches that read its keys; W after its
    own B. -1 while a dependency has not run."""
    ready = 0.0
    if op == 0:
        if vs > 0:
            ready = _after(ready, finish[_enc(vs - 1, u, 0, m)], p2p)
        for e in range(in_ptr[u], in_ptr[u + 1]):
            ready = _after(ready, finish[_enc(vs, in_src[e], 0, m)], 0.0)
    elif op == 1:
        ready = _after(ready, finish[_enc(vs, u, 0, m)], 0.0)
        if vs < V - 1:
            ready = _after(ready, finish[_enc(vs + 1, u, 1, m)], p2p)
        for e in range(out_ptr[u], out_ptr[u + 1]):
            ready = _after(ready, finish[_enc(vs, out_dst[e], 1, m)], 0.0)
    else:
        ready = _after(ready, finish[_enc(vs, u, 1, m)], 0.0)
    return ready


@njit(cache=True, inline="always")
def _task_bytes(op, vs, u, split, act, trans, edge_kv, in_ptr, in_eid, out_ptr, out_eid):
    """(bytes a task allocates at its start, bytes it frees at its end): an F its activations and transient;
    a B its transient and the key/value gradients it produces for earlier slices; the last of B and W frees the
    activations and the key/value gradients this micro-batch's keys received."""
    up = 0.0
    down = 0.0
    if op == 0:
        up = act[vs, u] + trans[vs, u]
        down = trans[vs, u]
    elif op == 1:
        up = trans[vs, u]
        for e in range(in_ptr[u], in_ptr[u + 1]):
            up += edge_kv[vs, in_eid[e]]
        down = trans[vs, u]
    if op == 2 or (op == 1 and not split):
        down += act[vs, u]
        for e in range(out_ptr[u], out_ptr[u + 1]):
            down += edge_kv[vs, out_eid[e]]
    return up, down


@njit(cache=True)
def simulate_kernel(pp, vpp, m, ops, fwd, bwd, wgt, p2p, in_ptr, in_src, in_eid, out_ptr, out_dst, out_eid,
                    act, trans, edge_kv, start, finish, mem_t, mem_b, peak, busy):
    """Resolve the DAG. fwd, bwd (the whole backward), wgt (its weight-gradient part), act, trans: (V, m) per
    virtual stage; edge_kv: (V, E). Fills start/finish (V*m*3), the per-rank memory timeline mem_t/mem_b
    (pp, 2*n: after each task start and end), peak and busy (pp). Returns the step time, or -1.0 when the
    order deadlocks. With W tasks in `ops` a B takes bwd - wgt and a W wgt; a micro-batch's activations and the
    key/value gradients its keys received live until its W ends (dW of the key/value projections reads them)."""
    V = pp * vpp
    n = ops.shape[1]
    split = n > 2 * m * vpp
    total = pp * n
    for i in range(V * m * 3):
        start[i] = -1.0
        finish[i] = -1.0
    ptr = np.zeros(pp, dtype=np.int64)
    free_at = np.zeros(pp, dtype=np.float64)
    cur = np.zeros(pp, dtype=np.float64)
    for s in range(pp):
        peak[s] = 0.0
        busy[s] = 0.0
    done = 0
    makespan = 0.0
    while done < total:
        progress = False
        for s in range(pp):
            while ptr[s] < n:
                t = ops[s, ptr[s]]
                op = t % 3
                vs = (t // 3) // m
                u = (t // 3) % m
                ready = _ready(op, vs, u, m, V, p2p, finish, in_ptr, in_src, out_ptr, out_dst)
                if ready < 0.0:
                    break
                dur = fwd[vs, u] if op == 0 else (wgt[vs, u] if op == 2 else bwd[vs, u] - (wgt[vs, u] if split else 0.0))
                st = ready if ready > free_at[s] else free_at[s]
                fi = st + dur
                start[t] = st
                finish[t] = fi
                free_at[s] = fi
                busy[s] += dur
                if fi > makespan:
                    makespan = fi
                # memory: allocate at start, free at end (activations at the last of B / W)
                k = ptr[s]
                up, down = _task_bytes(op, vs, u, split, act, trans, edge_kv, in_ptr, in_eid, out_ptr, out_eid)
                cur[s] += up
                if cur[s] > peak[s]:
                    peak[s] = cur[s]
                mem_t[s, 2 * k] = st
                mem_b[s, 2 * k] = cur[s]
                cur[s] -= down
                mem_t[s, 2 * k + 1] = fi
                mem_b[s, 2 * k + 1] = cur[s]
                ptr[s] += 1
                done += 1
                progress = True
        if not progress:
            return -1.0
    return makespan


@njit(cache=True)
def rank_stage_times(fwd, bwd, a, m, V, vpp):
    """(V, m) forward and backward times of one DP rank's micro-batches a..a+m-1 of the flat per-stage arrays:
    the same on every pipeline stage, a model chunk's share 1/vpp of it (what the batched kernels simulate)."""
    f = np.empty((V, m), dtype=np.float64)
    b = np.empty((V, m), dtype=np.float64)
    for v in range(V):
        for u in range(m):
            f[v, u] = fwd[a + u] / vpp
            b[v, u] = bwd[a + u] / vpp
    return f, b


@njit(cache=True)
def rank_edges(e_offsets, e_src, e_dst, r):
    """DP rank r's slice edges (local micro-batch positions, src < dst) from the flat CSR arrays."""
    ea = e_offsets[r]
    eb = e_offsets[r + 1]
    return e_src[ea:eb].copy(), e_dst[ea:eb].copy()


@njit(cache=True)
def step_times_ranks(pp, vpp, kind, fwd, bwd, wgt, offsets, p2p):
    """Step time of each DP rank r whose micro-batches are offsets[r]..offsets[r+1]-1 of the flat per-stage
    fwd/bwd/wgt arrays (the same time on every stage; chunk times are these / vpp; wgt, the weight-gradient
    part of bwd, matters under ZB-H1 only). No slices, so the default backward order is FIFO."""
    no_edges = np.zeros(offsets.shape[0], dtype=np.int64)
    empty = np.zeros(0, dtype=np.int64)
    return step_times_ranks_sliced(pp, vpp, kind, fwd, bwd, wgt, offsets, no_edges, empty, empty, p2p)


@njit(cache=True)
def backward_order_kernel(m, src, dst):
    """Numba twin of `default_backward_order` for edges (src[i] < dst[i])."""
    key = np.arange(m)
    if src.shape[0] > 0:
        order = np.argsort(-src, kind="mergesort")  # edges by source, highest first
        for i in order:
            if key[dst[i]] > key[src[i]]:
                key[src[i]] = key[dst[i]]
    comp = key * (m + 1) + (m - 1 - np.arange(m))
    return np.argsort(comp, kind="mergesort").astype(np.int64)


@njit(cache=True)
def edge_csr(m, src, dst):
    """Slice edges (src[i] -> dst[i], micro-batch positions < m) as CSR by destination (what a forward waits
    for) and by source (what a backward waits for), with each entry's edge index for the KV memory terms."""
    E = src.shape[0]
    in_ptr = np.zeros(m + 1, dtype=np.int64)
    out_ptr = np.zeros(m + 1, dtype=np.int64)
    for i in range(E):
        in_ptr[dst[i] + 1] += 1
        out_ptr[src[i] + 1] += 1
    for u in range(m):
        in_ptr[u + 1] += in_ptr[u]
        out_ptr[u + 1] += out_ptr[u]
    in_src = np.zeros(max(E, 1), dtype=np.int64)
    in_eid = np.zeros(max(E, 1), dtype=np.int64)
    out_dst = np.zeros(max(E, 1), dtype=np.int64)
    out_eid = np.zeros(max(E, 1), dtype=np.int64)
    fi_in = in_ptr[:-1].copy()
    fi_out = out_ptr[:-1].copy()
    for i in range(E):
        in_src[fi_in[dst[i]]] = src[i]
        in_eid[fi_in[dst[i]]] = i
        fi_in[dst[i]] += 1
        out_dst[fi_out[src[i]]] = dst[i]
        out_eid[fi_out[src[i]]] = i
        fi_out[src[i]] += 1
    return in_ptr, in_src, in_eid, out_ptr, out_dst, out_eid


@njit(cache=True)
def step_times_ranks_sliced(pp, vpp, kind, fwd, bwd, wgt, offsets, e_offsets, e_src, e_dst, p2p):
    """Like step_times_ranks, with slice edges: rank r's edges are e_offsets[r]..e_offsets[r+1]-1 of e_src /
    e_dst (micro-batch indices local to the rank, src < dst); the backward order is the default FILO one.
    Returns -1.0 for a rank whose schedule deadlocks."""
    R = offsets.shape[0] - 1
    out = np.empty(R, dtype=np.float64)
    V = pp * vpp
    for r in range(R):
        a = offsets[r]
        m = offsets[r + 1] - a
        if m == 0:
            out[r] = 0.0
            continue
        f, b = rank_stage_times(fwd, bwd, a, m, V, vpp)
        w, _ = rank_stage_times(wgt, wgt, a, m, V, vpp)
        src, dst = rank_edges(e_offsets, e_src, e_dst, r)
        E = src.shape[0]
        order = backward_order_kernel(m, src, dst) if E > 0 else np.arange(m)  # no edges: FIFO, no sort
        ops = build_ops(pp, vpp, m, kind, order)
        in_ptr, in_src, in_eid, out_ptr, out_dst, out_eid = edge_csr(m, src, dst)
        zero_vm = np.zeros((V, m), dtype=np.float64)
        kv = np.zeros((V, max(E, 1)), dtype=np.float64)
        st, fin, mt, mb, pk, bz = sim_buffers(pp, vpp, m, kind)
        out[r] = simulate_kernel(pp, vpp, m, ops, f, b, w, p2p, in_ptr, in_src, in_eid, out_ptr, out_dst, out_eid,
                                 zero_vm, zero_vm, kv, st, fin, mt, mb, pk, bz)
    return out
