"""The pipeline schedule `auto` scores a packing under: the configured one, or with `PlanConfig.schedule`
"auto" the faster of 1F1B and ZB-H1 by simulated step time, ZB-H1 only where its simulated peak memory fits the
device (it holds activations until each micro-batch's weight gradient). The plan records the choice
(`StepPlan.schedule`), and the simulator, the scores and the action lists follow it."""

from __future__ import annotations

import math
from typing import Callable

import numpy as np
from numba import njit

from packloader.balancers.sim.kernels import SCHEDULES, ZB_H1, step_times_ranks_sliced
from packloader.balancers.sim.weights import packing_weight_times

KIND_NAMES = {v: k for k, v in SCHEDULES.items()}


def schedule_kinds(config) -> tuple[int, ...]:
    """The simulator's schedule codes to try, the default first: the configured schedule alone (interleaved at
    vpp 1 is 1F1B); under "auto" 1F1B then ZB-H1, or interleaved alone at vpp > 1 (ZB-V is not modelled)."""
    if config.schedule != "auto":
        kind = SCHEDULES[config.schedule]
        return (SCHEDULES["1f1b"] if kind == SCHEDULES["interleaved"] and config.parallel.vpp == 1 else kind,)
    return (SCHEDULES["interleaved"],) if config.parallel.vpp > 1 else (SCHEDULES["1f1b"], ZB_H1)


def packing_step_time(packing, edges, parallel, kind: int, model) -> float:
    """The slowest DP rank's simulated step time of a packing (costs filled in) under one schedule; inf when
    the schedule deadlocks at this micro-batch count (interleaved)."""
    dp, v = packing.rank_mbs.shape
    order = packing.rank_mbs.ravel()
    f = np.ascontiguousarray(packing.mb_fwd[order])
    b = np.ascontiguousarray(packing.mb_bwd[order])
    offsets = np.arange(dp + 1, dtype=np.int64) * v
    e_off, e_src, e_dst = edges[:3]
    if parallel.pp == 1 and parallel.vpp == 1 and kind == SCHEDULES["1f1b"]:
        t = one_stage_times(f, b, v, e_off)  # ranks with slice edges left to the simulator (-1)
        sim = np.nonzero(t < 0)[0]
        if len(sim):
            t[sim] = _simulate_ranks(sim, v, kind, f, b, e_off, e_src, e_dst)
    else:
        w = packing_weight_times(packing, model, order, b) if kind == ZB_H1 else np.zeros_like(b)
        t = step_times_ranks_sliced(parallel.pp, parallel.vpp, kind, f, b, w, offsets, e_off, e_src, e_dst, 0.0)
    return math.inf if (t < 0).any() else float(t.max())


@njit(cache=True)
def one_stage_times(fwd, bwd, v, e_off):
    """1F1B on one pipeline stage runs F0 B0 F1 B1 ... back to back, so a DP rank without slice edges takes the
    sum of its micro-batches' times, added in that order (the simulator's clock, bit for bit); -1 for a rank
    with edges, whose backward order the simulator works out. At DP 1024 it spares ~3 ms of simulation per
    candidate."""
    dp = e_off.shape[0] - 1
    out = np.empty(dp, dtype=np.float64)
    for r in range(dp):
        if e_off[r + 1] > e_off[r]:
            out[r] = -1.0
            continue
        t = 0.0
        for u in range(r * v, (r + 1) * v):
            t += fwd[u]
            t += bwd[u]
        out[r] = t
    return out


def _simulate_ranks(ranks, v, kind, f, b, e_off, e_src, e_dst) -> np.ndarray:
    """step_times_ranks_sliced at PP 1 for some DP ranks only (their micro-batches and edges cut out)."""
    take = (ranks[:, None] * v + np.arange(v)).ravel()
    counts = e_off[ranks + 1] - e_off[ranks]
    off = np.zeros(len(ranks) + 1, np.int64)
    np.cumsum(counts, out=off[1:])
    at = np.repeat(e_off[ranks] - off[:-1], counts) + np.arange(off[-1])
    fs, bs = np.ascontiguousarray(f[take]), np.ascontiguousarray(b[take])
    return step_times_ranks_sliced(1, 1, kind, fs, bs, np.zeros_like(bs), np.arange(len(ranks) + 1, dtype=np.int64) * v,
                                   off, np.ascontiguousarray(e_src[at]), np.ascontiguousarray(e_dst[at]), 0.0)


def fastest_schedule(packing, edges, parallel, kinds: tuple[int, ...], model, peak: Callable[[int], float],
                     limit: float | None) -> tuple[float, int]:
    """(step time, schedule code): the fastest of `kinds`, a later one only where `peak(kind)` is within
    `limit` (None: no memory check)."""
    best, best_kind = packing_step_time(packing, edges, parallel, kinds[0], model), kinds[0]
    for kind in kinds[1:]:
        t = packing_step_time(packing, edges, parallel, kind, model)
        if t < best and (limit is None or peak(kind) <= limit):
            best, best_kind = t, kind
    return best, best_kind
