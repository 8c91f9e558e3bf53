"""The weight-gradient part of a micro-batch's backward, which ZB-H1 runs as its own action (W): half the
linear backward, since a linear layer's input gradient and weight gradient are two GEMMs of equal size, and
attention has no weights. A DP-Merge member computes its 1/g share of the tokens. The rest of the backward is
the input gradient (B), which the previous pipeline stage waits for."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from packloader.balancers.cost.coeffs import lin_times
from packloader.contracts import MicroBatch


def weight_times(mbs: Sequence[MicroBatch], models: Sequence) -> np.ndarray:
    """(len(models), m) weight-gradient time of each micro-batch under each CostModel."""
    tokens = np.array([mb.num_tokens / (len(mb.dp_group) if mb.dp_group else 1) for mb in mbs], dtype=np.float64)
    return np.stack([0.5 * lin_times(cm.coeffs, tokens, True) for cm in models]) if len(mbs) else \
        np.zeros((len(models), 0))


def packing_weight_times(packing, model, order: np.ndarray, bwd: np.ndarray) -> np.ndarray:
    """The same for the micro-batches `order` of a `planners.packing.Packing` (what `auto` scores), at most
    their backward times `bwd`."""
    ntok = np.bincount(packing.seg_mb, weights=(packing.seg_end - packing.seg_start).astype(np.float64),
                       minlength=packing.num_micro_batches)
    for i, g in (packing.groups or {}).items():
        ntok[i] /= len(g)
    return np.minimum(0.5 * lin_times(model.coeffs, np.ascontiguousarray(ntok[order]), True), bwd)
