"""Numba kernels of the pipeline simulator: build a schedule's per-rank action order, list-schedule its DAG,
and step times for many ranks at once (what `auto` calls per candidate). `simulator.py` wraps them for plans."""

from __future__ import annotations

import numpy as np
from numba import njit

SCHEDULES = {"1f1b": 0, "gpipe": 1, "interleaved": 2}


# ----------------------------------------------------------------------------------------------- kernels


@njit(cache=True)
def _enc(vs, u, isb, m):
    return (vs * m + u) * 2 + isb


@njit(cache=True)
def build_ops(pp, vpp, m, kind, bwd_order):
    """Per pipeline rank, the order in which it runs its 2*m*vpp tasks (encoded as (vs*m + u)*2 + is_bwd).

    kind: 0 = 1F1B, 1 = GPipe, 2 = interleaved 1F1B (same as 1F1B when vpp == 1).
    """
    n = 2 * m * vpp
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
        if kind == 1:
            warm = nv
        elif vpp > 1:
            warm = min((pp - s - 1) * 2 + (vpp - 1) * pp, nv)
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
            nb += 1
    return ops


@njit(cache=True)
def sim_buffers(pp, vpp, m):
    """The output buffers `simulate_kernel` fills: task start and finish (V*m*2), the memory timeline (pp, 2*n
    events for the n = 2*m*vpp tasks of a stage), peak and busy per stage."""
    V = pp * vpp
    n = 2 * m * vpp
    return (np.empty(V * m * 2, dtype=np.float64), np.empty(V * m * 2, dtype=np.float64),
            np.empty((pp, 2 * n), dtype=np.float64), np.empty((pp, 2 * n), dtype=np.float64),
            np.empty(pp, dtype=np.float64), np.empty(pp, dtype=np.float64))


@njit(cache=True, inline="always")
def _after(ready, done, lag):
    """When a task may start given one more dependency that finished at `done` (-1: has not run) and takes
    `lag` to arrive; -1 once any dependency has not run."""
    if ready < 0.0 or done < 0.0:
        return -1.0
    return done + lag if done + lag > ready else ready


@njit(cache=True)
def simulate_kernel(pp, vpp, m, ops, fwd, bwd, p2p, in_ptr, in_src, in_eid, out_ptr, out_dst, out_eid,
                    act, trans, edge_kv, start, finish, mem_t, mem_b, peak, busy):
    """Resolve the DAG. fwd, bwd, act, trans: (V, m) per virtual stage; edge_kv: (V, E). Fills start/finish
    (V*m*2), the per-rank memory timeline mem_t/mem_b (pp, 2*n: after each task start and end), peak and busy
    (pp). Returns the step time, or -1.0 when the order deadlocks."""
    V = pp * vpp
    n = 2 * m * vpp
    total = V * m * 2
    for i in range(total):
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
                isb = t % 2
                vu = t // 2
                vs = vu // m
                u = vu % m
                ready = 0.0
                if isb == 0:
                    if vs > 0:
                        ready = _after(ready, finish[_enc(vs - 1, u, 0, m)], p2p)
                    for e in range(in_ptr[u], in_ptr[u + 1]):
                        ready = _after(ready, finish[_enc(vs, in_src[e], 0, m)], 0.0)
                    dur = fwd[vs, u]
                else:
                    ready = _after(ready, finish[_enc(vs, u, 0, m)], 0.0)
                    if vs < V - 1:
                        ready = _after(ready, finish[_enc(vs + 1, u, 1, m)], p2p)
                    for e in range(out_ptr[u], out_ptr[u + 1]):
                        ready = _after(ready, finish[_enc(vs, out_dst[e], 1, m)], 0.0)
                    dur = bwd[vs, u]
                if ready < 0.0:
                    break
                st = ready if ready > free_at[s] else free_at[s]
                fi = st + dur
                start[t] = st
                finish[t] = fi
                free_at[s] = fi
                busy[s] += dur
                if fi > makespan:
                    makespan = fi
                # memory: allocate at start, free at end
                k = ptr[s]
                if isb == 0:
                    cur[s] += act[vs, u] + trans[vs, u]
                else:
                    cur[s] += trans[vs, u]
                    for e in range(in_ptr[u], in_ptr[u + 1]):
                        cur[s] += edge_kv[vs, in_eid[e]]
                if cur[s] > peak[s]:
                    peak[s] = cur[s]
                mem_t[s, 2 * k] = st
                mem_b[s, 2 * k] = cur[s]
                if isb == 0:
                    cur[s] -= trans[vs, u]
                else:
                    cur[s] -= act[vs, u] + trans[vs, u]
                    for e in range(out_ptr[u], out_ptr[u + 1]):
                        cur[s] -= edge_kv[vs, out_eid[e]]
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
def step_times_ranks(pp, vpp, kind, fwd, bwd, offsets, p2p):
    """Step time of each DP rank r whose micro-batches are offsets[r]..offsets[r+1]-1 of the flat per-stage
    fwd/bwd arrays (the same time on every stage; chunk times are these / vpp). No slices, so the default
    backward order is FIFO."""
    no_edges = np.zeros(offsets.shape[0], dtype=np.int64)
    empty = np.zeros(0, dtype=np.int64)
    return step_times_ranks_sliced(pp, vpp, kind, fwd, bwd, offsets, no_edges, empty, empty, p2p)


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
def step_times_ranks_sliced(pp, vpp, kind, fwd, bwd, offsets, e_offsets, e_src, e_dst, p2p):
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
        src, dst = rank_edges(e_offsets, e_src, e_dst, r)
        E = src.shape[0]
        order = backward_order_kernel(m, src, dst) if E > 0 else np.arange(m)  # no edges: FIFO, no sort
        ops = build_ops(pp, vpp, m, kind, order)
        in_ptr, in_src, in_eid, out_ptr, out_dst, out_eid = edge_csr(m, src, dst)
        zero_vm = np.zeros((V, m), dtype=np.float64)
        kv = np.zeros((V, max(E, 1)), dtype=np.float64)
        st, fin, mt, mb, pk, bz = sim_buffers(pp, vpp, m)
        out[r] = simulate_kernel(pp, vpp, m, ops, f, b, p2p, in_ptr, in_src, in_eid, out_ptr, out_dst, out_eid,
                                 zero_vm, zero_vm, kv, st, fin, mt, mb, pk, bz)
    return out
