"""What `auto` plans and scores with: a candidate (planner, micro-batch count), the step's shared context, one
scored candidate, and a candidate's queue as arrays."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from packloader.balancers.planners.base import StepLayout
from packloader.balancers.planners.packing import Packing, Pieces, QueuedPieces
from packloader.balancers.planners.packing_measures import imbalance_degree


@dataclass(frozen=True)
class Candidate:
    planner: str
    micro_batches: int | None  # None: the planner's own choice
    run_share: float = 0.0  # slimpack with runs of linked packs bounded (SlimPackPlanner.run_share): memory fallback


def queued_arrays(packing: Packing) -> tuple[np.ndarray, np.ndarray]:
    """The lengths and drawn steps of what a packing holds back, as arrays (wlb holds ~10^4 pieces at DP 1024:
    sums over them in Python cost milliseconds)."""
    q = packing.queued
    if isinstance(q, QueuedPieces):
        return q.length, q.drawn
    return (np.fromiter((x.length for x in q), np.int64, len(q)), np.fromiter((x.drawn_step for x in q), np.int64, len(q)))


@dataclass(frozen=True)
class StepContext:
    """What every candidate of one step is planned and scored against."""

    pieces: Pieces
    layout: StepLayout
    small: bool
    total_work: float
    whole_bound: float
    run_tokens: int
    run_delay: int
    piece_delay: int


@dataclass
class Scored:
    """A scored candidate: its score (simulated time per unit of work), position in the candidate list, plan,
    slice edges, simulated peak bytes (None until checked: only checked ones count in the report's memory
    summary) and imbalance degree (computed when a tie asks)."""

    score: float
    idx: int
    packing: Packing
    cand: Candidate
    edges: tuple
    peak: float | None = None
    _imbalance: float | None = None
    peak_ahead: float | None = None  # simulated in a thread (`evaluate_ahead`); `fits` takes it when it asks

    def imbalance(self) -> float:
        if self._imbalance is None:
            self._imbalance = imbalance_degree(self.packing)
        return self._imbalance
