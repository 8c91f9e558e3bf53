"""Best-fit-decreasing into fixed-length bins by token count: what NeMo and TRL do, and the baseline every
other planner is scored against."""

from __future__ import annotations

import numpy as np
from numba import njit

from packloader.balancers.planners.base import Model, PackingPlanner, StepLayout
from packloader.balancers.planners.packing import Packing, Pieces, check_cap, whole_pieces_packing
from packloader.balancers.planners.registry import AutoUse, NoOptions, Planner, register_planner
from packloader.contracts import PlanConfig, StepPlan


def best_fit_decreasing(lengths: np.ndarray, capacity: int, num_bins: int) -> np.ndarray | None:
    """Bin index per item, or None if the items do not fit into num_bins bins of `capacity` tokens.

    The readable reference; planning runs `bfd_pack` below, the same loop in numba (tests compare the two)."""
    order = np.argsort(-lengths, kind="stable")
    free = np.full(num_bins, capacity, dtype=np.int64)
    assign = np.empty(len(lengths), dtype=np.int64)
    for i in order:
        need = lengths[i]
        fits = np.nonzero(free >= need)[0]
        if len(fits) == 0:
            return None
        best = fits[np.argmin(free[fits])]
        free[best] -= need
        assign[i] = best
    return assign


class FixedPlanner(PackingPlanner):
    """Token counts only: no cost model."""

    name = "fixed"

    def __init__(self, config: PlanConfig, model: Model | None = None) -> None:
        super().__init__(config, uses_model=False)

    def solve(self, pieces: Pieces, layout: StepLayout, model: Model | None = None) -> Packing:
        """Best-fit decreasing into dp x V bins of max_tokens, bin b to rank b % dp at position b // dp, V (the
        fewest bins that hold the step unless pinned) grown until everything fits."""
        cfg = self.config
        dp, cap = cfg.parallel.dp, cfg.max_tokens
        check_cap(pieces, cap, self.name)
        per_rank = layout.micro_batches or cfg.num_micro_batches or max(1, -(-pieces.total_tokens // (cap * dp)))
        while True:
            assign, ok = bfd_pack(pieces.length, cap, per_rank * dp)
            if ok:
                break
            per_rank += 1
        b = np.arange(per_rank * dp, dtype=np.int64)
        rank_mbs = np.empty((dp, per_rank), np.int64)
        rank_mbs[b % dp, b // dp] = b
        return whole_pieces_packing(pieces, assign, rank_mbs, strategy=self.name)

    def priced(self, packing: Packing, step: int) -> StepPlan:
        """Without costs (no model to price them with)."""
        return packing.to_step_plan(step)


@register_planner("fixed", role="baseline", summary="best-fit-decreasing by tokens (NeMo, TRL)", report_order=20,
                  uses_model=False, auto=AutoUse(order=40, whole_pieces=True, max_work=2_000_000))
def _make(config: PlanConfig, options: NoOptions, model: None) -> Planner:
    return FixedPlanner(config)


@njit(cache=True)
def bfd_pack(lengths, capacity, num_bins):
    """Best-fit decreasing by token count (`fixed.best_fit_decreasing` in numba, same answer): longest first
    (stable), each to the fullest bin it fits, ties to the lowest bin. Returns (bin of each item, ok); ok is
    False when some item fits no bin."""
    n = lengths.shape[0]
    assign = np.full(n, -1, dtype=np.int64)
    free = np.full(num_bins, capacity, dtype=np.int64)
    order = np.argsort(-lengths, kind="mergesort")
    for k in range(n):
        i = order[k]
        need = lengths[i]
        best = -1
        for b in range(num_bins):
            if free[b] >= need and (best < 0 or free[b] < free[best]):
                best = b
        if best < 0:
            return assign, False
        free[best] -= need
        assign[i] = best
    return assign, True
