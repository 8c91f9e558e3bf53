"""The memory check of the dynamic-cp planner's slice chains: a long piece cut into SlimPack slices that run at a
smaller CP size than the piece needs whole, on one subgroup in consecutive slots, each slice attending to the
earlier ones' keys (a 128K document as two 64K slices on CP 2 instead of one 128K piece on CP 4;
`doc_cp.units.chained` cuts them).

A chain keeps every slice's activations on its GPUs until its backward (and each later slice's prefix key/value
gradients between two backwards), which the per-slot token cap does not bound. The check is the one the fixed-CP
planners' `auto` runs (`sim.peaks.packing_peaks`), with the pool's GPUs as its ranks: a GPU's micro-batch m holds
its tokens of slot m, and every slice links its previous slice's slot to its own on each GPU of its subgroup, with
its shard of the prefix keys (p / size).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from packloader.balancers.planners.packing import Packing
from packloader.balancers.sim.peaks import packing_peaks

if TYPE_CHECKING:
    from packloader.balancers.planners.doc_cp.price import Placed, SlotTimes
    from packloader.balancers.planners.doc_cp.units import Units


def chain_peak(units: "Units", placed: "Placed", times: "SlotTimes", memory, pp: int, vpp: int, kind: int) -> float:
    """Simulated peak bytes of the busiest pool GPU (static memory included) of a placement with chains."""
    slots, G = times.tokens.shape
    n = G * slots
    ids = np.arange(n, dtype=np.int64)
    zeros = np.zeros(n, np.int64)
    tokens = np.ceil(times.tokens.T.ravel() - 1e-9).astype(np.int64)  # micro-batch g * slots + m: GPU g, slot m
    packing = Packing(zeros, zeros, tokens, zeros, ids, ids.reshape(G, slots))
    packing.mb_fwd = np.ascontiguousarray(times.synced_fwd.T.ravel())
    packing.mb_bwd = np.ascontiguousarray(times.synced_bwd.T.ravel())
    edges = []
    for k in np.nonzero(units.after >= 0)[0]:  # every slice: chains' and those of pieces longer than the pool
        f, s = int(placed.first[k]), int(placed.size[k])
        edges += [(g, int(placed.m[units.after[k]]), int(placed.m[k]), float(placed.p[k]) / s) for g in range(f, f + s)]
    edges.sort()
    e = np.array(edges, dtype=np.float64).reshape(-1, 4)
    off = np.zeros(G + 1, np.int64)
    np.cumsum(np.bincount(e[:, 0].astype(np.int64), minlength=G), out=off[1:])
    peaks = packing_peaks(packing, memory, pp, vpp, kind, (off, e[:, 1].astype(np.int64), e[:, 2].astype(np.int64),
                                                           e[:, 3]))
    return float(peaks.max())
