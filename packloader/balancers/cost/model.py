"""`CostModel`: a cost profile with its flat coefficients, and the Python-side prices of micro-batches,
documents and plans that the planners, simulator and report use."""

from __future__ import annotations

from typing import Sequence

import msgspec
import numpy as np

from packloader.balancers.cost.coeffs import (
    LIN_BWD,
    LIN_FWD,
    doc_time_kernel,
    doc_time_split,
    lin_time,
    microbatch_time,
    profile_coeffs,
    segment_times_kernel,
)
from packloader.contracts import CostProfile, LinTable, MicroBatch, Poly, StepPlan

# ----------------------------------------------------------------------------------------------- model


def segments_arrays(mb: MicroBatch) -> tuple[np.ndarray, np.ndarray]:
    """(q, p) int64 arrays of a micro-batch's segments."""
    segs = mb.segments
    q = np.fromiter((s.end - s.start for s in segs), dtype=np.int64, count=len(segs))
    p = np.fromiter((s.start - s.attend_from for s in segs), dtype=np.int64, count=len(segs))
    return q, p


class CostModel:
    """A CostProfile with its flat coefficients and the Python-side conveniences around the kernels."""

    def __init__(self, profile: CostProfile) -> None:
        self.profile = profile
        self.coeffs = profile_coeffs(profile)

    def __repr__(self) -> str:
        return f"CostModel({self.profile.name!r}, tile={self.profile.tile}, memory_cap={self.profile.memory_cap})"

    @property
    def name(self) -> str:
        return self.profile.name

    def segment_times(self, q: np.ndarray, p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Attention-only forward and backward time of each segment (q query tokens after p earlier keys)."""
        q = np.ascontiguousarray(q, dtype=np.int64)
        p = np.ascontiguousarray(p, dtype=np.int64)
        if q.shape != p.shape:
            raise ValueError(f"q and p differ in shape: {q.shape} vs {p.shape}")
        return segment_times_kernel(self.coeffs, q, p)

    def microbatch_times(self, mb: MicroBatch) -> tuple[float, float]:
        """(forward, backward) seconds of a micro-batch on one pipeline stage of one rank.

        A DP-Merge micro-batch (dp_group of g ranks running it as context parallelism) costs each member
        1/g of the attention and the linear part of n/g tokens (ideal sharding), plus the full floor.
        """
        q, p = segments_arrays(mb)
        g = len(mb.dp_group) if mb.dp_group else 1
        if g <= 1:
            f, b = microbatch_time(self.coeffs, q, p)
            return float(f), float(b)
        fa, ba = segment_times_kernel(self.coeffs, q, p)
        n = float(q.sum()) / g
        return (
            float(fa.sum()) / g + float(lin_time(self.coeffs, n, False)),
            float(ba.sum()) / g + float(lin_time(self.coeffs, n, True)),
        )

    def microbatch_time_of(self, q: Sequence[int] | np.ndarray, p: Sequence[int] | np.ndarray | None = None) -> tuple[float, float]:
        """(forward, backward) of a micro-batch given as arrays; p defaults to zeros (whole documents)."""
        q = np.ascontiguousarray(q, dtype=np.int64)
        p = np.zeros_like(q) if p is None else np.ascontiguousarray(p, dtype=np.int64)
        f, b = microbatch_time(self.coeffs, q, p)
        return float(f), float(b)

    def doc_time(self, lengths: np.ndarray) -> np.ndarray:
        """Forward + backward of each length as its own micro-batch's attention + linear share (no floor)."""
        return doc_time_kernel(self.coeffs, np.ascontiguousarray(lengths, dtype=np.int64))

    def doc_time_split(self, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Forward and backward separately (see doc_time)."""
        return doc_time_split(self.coeffs, np.ascontiguousarray(lengths, dtype=np.int64))

    def floor(self) -> tuple[float, float]:
        """The per-micro-batch floor (forward, backward): the polynomials' c (for a measured table, the floor
        its polynomial summary puts under the per-token rate)."""
        return float(self.coeffs[LIN_FWD + 2]), float(self.coeffs[LIN_BWD + 2])

    def memory_cap(self) -> int | None:
        """Most tokens a micro-batch may hold on one rank given memory (None: no memory cap known)."""
        return self.profile.memory_cap

    def with_memory_cap(self, memory_cap: int | None) -> "CostModel":
        return CostModel(msgspec.structs.replace(self.profile, memory_cap=memory_cap))

    def scaled(self, factor: float) -> "CostModel":
        """The same model on a device `factor` times slower (heterogeneous ranks); floors scale too."""
        def s(poly: Poly) -> Poly:
            return Poly(poly.a * factor, poly.b * factor, poly.c * factor)

        pr = self.profile
        t = pr.lin_table
        table = None if t is None else LinTable(tokens=t.tokens, fwd=[x * factor for x in t.fwd], bwd=[x * factor for x in t.bwd])
        return CostModel(
            msgspec.structs.replace(
                pr, name=f"{pr.name}x{factor:g}", attn_fwd=s(pr.attn_fwd), attn_bwd=s(pr.attn_bwd),
                lin_fwd=s(pr.lin_fwd), lin_bwd=s(pr.lin_bwd), lin_table=table,
                slice_term=None if pr.slice_term is None else pr.slice_term.scaled(factor),
            )
        )

    def lin_time(self, n: float, bwd: bool = False) -> float:
        """Linear-part time of a micro-batch of n tokens (floor included)."""
        return float(lin_time(self.coeffs, float(n), bwd))


def annotate_costs(plan: StepPlan, model: CostModel | Sequence[CostModel]) -> StepPlan:
    """Fill fwd_cost/bwd_cost of every micro-batch of `plan` (in place; the plan is returned).

    `model` is one CostModel for all ranks, or one per DP rank (heterogeneous ranks, e.g. `RankCosts.models`).
    """
    models = _per_rank(model, len(plan.ranks))
    for r, rank in enumerate(plan.ranks):
        m = models[r]
        for mb in rank.micro_batches:
            f, b = m.microbatch_times(mb)
            mb.fwd_cost = f
            mb.bwd_cost = b
    return plan


def _per_rank(model: object, dp: int) -> list[CostModel]:
    if isinstance(model, CostModel):
        return [model] * dp
    models = list(getattr(model, "models", model))  # RankCosts or a plain sequence
    if len(models) != dp:
        raise ValueError(f"{len(models)} cost models for {dp} DP ranks")
    return models
