"""Best-fit-decreasing into fixed-length bins by token count: what NeMo and TRL do, and the baseline every
other planner is scored against."""

from __future__ import annotations

import numpy as np

from packloader.balancers.kernels import bfd_pack
from packloader.balancers.registry import Planner, Window, register_planner
from packloader.contracts import MicroBatch, PlanConfig, PlannerState, RankPlan, Segment, StepPlan


def best_fit_decreasing(lengths: np.ndarray, capacity: int, num_bins: int) -> np.ndarray | None:
    """Bin index per item, or None if the items do not fit into num_bins bins of `capacity` tokens.

    The readable reference; planning runs `kernels.bfd_pack`, the same loop in numba (tests compare the two)."""
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


def pieces_of(window: Window, state: PlannerState) -> Window:
    """The step's pieces: what earlier steps queued first (oldest first), then the newly drawn window."""
    if not state.queued:
        return window
    q = state.queued
    return Window(
        np.concatenate([np.array([d.doc for d in q], np.int64), window.doc]),
        np.concatenate([np.array([d.offset for d in q], np.int64), window.offset]),
        np.concatenate([np.array([d.length for d in q], np.int64), window.length]),
    )


class FixedPlanner:
    def __init__(self, config: PlanConfig) -> None:
        self.config = config

    def plan(self, window: Window, state: PlannerState, step: int) -> tuple[StepPlan, PlannerState]:
        cfg = self.config
        dp, cap = cfg.parallel.dp, cfg.max_tokens
        pieces = pieces_of(window, state)
        if len(pieces.length) and int(pieces.length.max()) > cap:
            raise ValueError(
                f"a piece of {int(pieces.length.max())} tokens exceeds max_tokens={cap}; cut documents at a context "
                f"length <= max_tokens or allow slicing with another strategy"
            )
        per_rank = cfg.num_micro_batches or max(1, -(-pieces.total_tokens // (cap * dp)))
        while True:
            assign, ok = bfd_pack(np.ascontiguousarray(pieces.length, dtype=np.int64), cap, per_rank * dp)
            if ok:
                break
            per_rank += 1
        bins: list[list[Segment]] = [[] for _ in range(per_rank * dp)]
        for b, d, start, n in zip(assign.tolist(), pieces.doc.tolist(), pieces.offset.tolist(), pieces.length.tolist()):
            bins[b].append(Segment(d, start, start + n, start))  # draw order within a bin
        # Deal the bins to ranks so bin b goes to rank b % dp: each rank gets per_rank micro-batches.
        ranks = [RankPlan(micro_batches=[MicroBatch(segments=bins[b]) for b in range(r, per_rank * dp, dp)]) for r in range(dp)]
        return StepPlan(step=step, ranks=ranks), PlannerState()


@register_planner("fixed")
def _make(config: PlanConfig) -> Planner:
    return FixedPlanner(config)
