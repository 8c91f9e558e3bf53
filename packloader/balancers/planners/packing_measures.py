"""What `auto` measures of a packing besides its time: the slice edges the pipeline simulator follows, and
WLB-LLM's imbalance degree that breaks ties."""

from __future__ import annotations

import numpy as np

from packloader.balancers.planners.packing import Packing, slice_edges_kernel


def slice_edges(packing: Packing) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-rank slice edges (CSR offsets, source position, destination position) of a Packing: an edge from
    the micro-batch holding a slice's prefix end to the slice's micro-batch, positions local to each rank (a
    DP-Merge micro-batch is listed by each member rank, so its edges appear on each)."""
    return slice_edges_prefix(packing)[:3]


def slice_edges_prefix(packing: Packing) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """`slice_edges` and, per edge, the tokens of keys the slice attends to before its start (its prefix, whose
    key/value gradients the simulator holds between the two backwards). One numba call
    (kernels.slice_edges_kernel); tests check it against the simulator's `slice_edges_of` on the StepPlan."""
    a = [np.ascontiguousarray(x, np.int64) for x in (packing.seg_doc, packing.seg_start, packing.seg_end, packing.seg_af,
                                                      packing.seg_mb, packing.rank_mbs)]
    return slice_edges_kernel(*a)


def imbalance_degree(packing: Packing) -> float:
    """WLB-LLM's imbalance degree of the worst rank: max micro-batch cost x count / total (costs filled in)."""
    c = (packing.mb_fwd + packing.mb_bwd)[packing.rank_mbs]
    tot = c.sum(axis=1)
    ok = tot > 0
    if not ok.any():
        return 1.0
    return float((c.max(axis=1)[ok] * c.shape[1] / tot[ok]).max())
