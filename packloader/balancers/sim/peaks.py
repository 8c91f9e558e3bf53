"""Simulated peak memory of every DP rank of a plan held as arrays (a `planners.packing.Packing`), in one numba call:
what `auto` checks its candidates against the device with.

It is the same simulation as `simulator.simulate_step` with a `memory.MemoryModel` (the one the report shows):
the simulator's own kernel (`simulate_kernel`) runs each rank's schedule with the same task bytes
`simulate_rank` builds from the memory model (activations of a micro-batch's tokens, divided by the DP-Merge
group size, split over a rank's vpp chunks; transients; key/value gradients of each slice's prefix) and the
rank's backward order (the plan's own, else the default FILO one); only the Python plan objects are skipped.
Memory follows each rank's task order, not the task times, so the weight-gradient split of ZB-H1 needs no
times here (a W's durations are given as 0).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from packloader.balancers.sim.kernels import (
    SCHEDULES,
    backward_order_kernel,
    build_ops,
    edge_csr,
    rank_edges,
    rank_stage_times,
    sim_buffers,
    simulate_kernel,
)


@njit(cache=True)
def peaks_ranks_sliced(pp, vpp, kind, fwd, bwd, tokens, act_pt, trans_pt, kv_pt, offsets, e_offsets, e_src, e_dst,
                       e_prefix, bwd_order, has_order):
    """Peak bytes (activations, transients and key/value gradients; static memory not included) of each pipeline
    rank of each DP rank, (R, pp); a rank whose schedule deadlocks gets inf.

    Rank r's micro-batches are offsets[r]..offsets[r+1]-1 of the flat fwd / bwd / tokens arrays (tokens already
    divided by the DP-Merge group size); its slice edges e_offsets[r]..e_offsets[r+1]-1 of e_src / e_dst (local
    positions, src < dst) with e_prefix tokens of keys each; act_pt / trans_pt / kv_pt: bytes per token of each
    pipeline stage (MemoryModel.activation_bytes_per_token, transient_bytes_per_token, kv_grad_bytes_per_token);
    bwd_order[offsets[r]:offsets[r+1]] the rank's backward order where has_order[r], else the default."""
    R = offsets.shape[0] - 1
    out = np.zeros((R, pp), dtype=np.float64)
    V = pp * vpp
    for r in range(R):
        a = offsets[r]
        m = offsets[r + 1] - a
        if m == 0:
            continue
        f, b = rank_stage_times(fwd, bwd, a, m, V, vpp)
        act = np.empty((V, m), dtype=np.float64)
        trans = np.empty((V, m), dtype=np.float64)
        for v in range(V):
            s = v % pp
            for u in range(m):
                act[v, u] = tokens[a + u] * act_pt[s] / vpp
                trans[v, u] = tokens[a + u] * trans_pt[s]
        src, dst = rank_edges(e_offsets, e_src, e_dst, r)
        E = src.shape[0]
        ea = e_offsets[r]
        if has_order[r]:
            order = bwd_order[a:a + m].copy()
        else:
            order = backward_order_kernel(m, src, dst)
        ops = build_ops(pp, vpp, m, kind, order)
        in_ptr, in_src, in_eid, out_ptr, out_dst, out_eid = edge_csr(m, src, dst)
        kv = np.zeros((V, max(E, 1)), dtype=np.float64)
        for v in range(V):
            for i in range(E):
                kv[v, i] = e_prefix[ea + i] * (kv_pt[v % pp] / vpp)
        st, fin, mt, mb, pk, bz = sim_buffers(pp, vpp, m, kind)
        t = simulate_kernel(pp, vpp, m, ops, f, b, f * 0.0, 0.0, in_ptr, in_src, in_eid, out_ptr, out_dst, out_eid,
                            act, trans, kv, st, fin, mt, mb, pk, bz)
        for s in range(pp):
            out[r, s] = pk[s] if t >= 0.0 else np.inf
    return out


def stage_bytes(memory, pp: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per pipeline stage: activation, transient and key/value-gradient bytes per token, and static bytes, of
    a MemoryModel (what `simulate_rank` multiplies the micro-batches' tokens by)."""
    stages = range(pp)
    return (
        np.array([memory.activation_bytes_per_token(s) for s in stages], np.float64),
        np.array([memory.transient_bytes_per_token(s) for s in stages], np.float64),
        np.array([memory.kv_grad_bytes_per_token(s) for s in stages], np.float64),
        np.array([memory.static_bytes(s) for s in stages], np.float64),
    )


def packing_peaks(packing, memory, pp: int, vpp: int, kind: int, edges, stages=None) -> np.ndarray:
    """(dp, pp) simulated peak bytes of each DP rank's pipeline ranks, static memory included, for a Packing
    with costs filled in. `edges` = (offsets, src, dst, prefix) from `auto.slice_edges_prefix(packing)`;
    `memory` a MemoryModel; `kind` the simulator's schedule code; `stages` its `stage_bytes`, when cached."""
    dp, v = packing.rank_mbs.shape
    nmb = packing.num_micro_batches
    order = packing.rank_mbs.ravel()
    ntok = np.bincount(packing.seg_mb, weights=(packing.seg_end - packing.seg_start).astype(np.float64), minlength=nmb)
    if packing.groups:  # DP-Merge: each member holds its 1/g share of the tokens
        ids = np.fromiter(packing.groups.keys(), np.int64, len(packing.groups))
        g = np.fromiter((len(x) for x in packing.groups.values()), np.float64, len(packing.groups))
        ntok[ids] = ntok[ids] / g
    tokens = np.ascontiguousarray(ntok[order])
    f = np.ascontiguousarray(packing.mb_fwd[order])
    b = np.ascontiguousarray(packing.mb_bwd[order])
    offsets = np.arange(dp + 1, dtype=np.int64) * v
    bo = np.zeros(dp * v, np.int64)
    has = np.zeros(dp, np.bool_)
    if packing.backward_order is not None:
        for r, o in enumerate(packing.backward_order):
            if o is not None:
                bo[r * v:(r + 1) * v] = o
                has[r] = True
    act_pt, trans_pt, kv_pt, static = stages if stages is not None else stage_bytes(memory, pp)
    e_off, e_src, e_dst, e_prefix = edges
    e_prefix = np.ascontiguousarray(e_prefix, dtype=np.float64)
    if pp == 1 and vpp == 1 and kind == SCHEDULES["1f1b"]:  # 1F1B on one stage: ranks without slices need no simulation
        peaks = one_stage_peaks(tokens, act_pt[0], trans_pt[0], v, e_off, has)
        sim = np.nonzero(peaks[:, 0] < 0)[0]
        if len(sim):
            take = (sim[:, None] * v + np.arange(v)).ravel()
            counts = e_off[sim + 1] - e_off[sim]
            off = np.zeros(len(sim) + 1, np.int64)
            np.cumsum(counts, out=off[1:])
            at = np.repeat(e_off[sim] - off[:-1], counts) + np.arange(off[-1])
            peaks[sim] = peaks_ranks_sliced(1, 1, kind, f[take], b[take], tokens[take], act_pt, trans_pt, kv_pt,
                                            np.arange(len(sim) + 1, dtype=np.int64) * v, off, e_src[at], e_dst[at],
                                            e_prefix[at], bo[take], has[sim])
    else:
        peaks = peaks_ranks_sliced(pp, vpp, kind, f, b, tokens, act_pt, trans_pt, kv_pt, offsets, e_off, e_src, e_dst,
                                   e_prefix, bo, has)
    return peaks + static[None, :]


@njit(cache=True)
def one_stage_peaks(tokens, act_pt, trans_pt, v, e_off, has_order):
    """Peak bytes of each DP rank at PP 1 under 1F1B (F0 B0 F1 B1 ...) for the ranks without slice edges or a
    plan's own backward order, the simulator's memory steps written out (an F allocates its activations and
    transient and frees the transient; a B allocates its transient and frees it with the activations), in the
    same order and arithmetic, so bit for bit its peak; -1 for the other ranks, left to the simulator."""
    dp = e_off.shape[0] - 1
    out = np.empty((dp, 1), dtype=np.float64)
    for r in range(dp):
        if e_off[r + 1] > e_off[r] or has_order[r]:
            out[r, 0] = -1.0
            continue
        cur = 0.0
        peak = 0.0
        for u in range(r * v, (r + 1) * v):
            act = tokens[u] * act_pt
            trans = tokens[u] * trans_pt
            cur += act + trans
            peak = max(peak, cur)
            cur -= trans
            cur += trans
            peak = max(peak, cur)
            cur -= trans + act
        out[r, 0] = peak
    return out
