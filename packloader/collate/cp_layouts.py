"""How a micro-batch's tokens can be laid out over CP ranks (runs of the packed row per rank: sequence,
document, hierarchical) and what each layout costs under the caller's estimate; `cp_sequence_shards` picks one and builds
the shard metadata."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

# ----------------------------------------------------------------------------------------------- cost model


class CPCost(Protocol):
    """The costs CP sharding balances, passed in by the caller that knows the model (`packloader.runtime.cp_cost`
    builds one from a cost model, preset name or profile)."""

    def segment_times(self, q: np.ndarray, p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Attention forward and backward time of each query run: q queries after p earlier keys."""

    def linear(self, n: float) -> float:
        """Linear-part time (forward + backward) of n tokens on one rank."""


class TileEstimate:
    """A unit tile-aware estimate that needs no cost model: the same attention formula with a = 1 (forward) and
    2.5 (backward), and a linear part of 3.5 * 4096 per token (forward + backward), about the ratio of a
    4096-wide model's GEMMs to its attention per key."""

    tile = 128

    def segment_times(self, q: np.ndarray, p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        qt = np.ceil(np.asarray(q, dtype=np.float64) / self.tile) * self.tile
        qt[np.asarray(q) <= 0] = 0.0
        f = qt * qt + 2.0 * qt * np.asarray(p, dtype=np.float64)
        return f, 2.5 * f

    def linear(self, n: float) -> float:
        return 3.5 * 4096.0 * float(n)


def check_cost(cost: Any) -> CPCost:
    missing = [m for m in ("segment_times", "linear") if not callable(getattr(cost, m, None))]
    if missing:
        raise TypeError(
            f"cost must have segment_times(q, p) -> (fwd, bwd) and linear(n) -> float; {type(cost).__name__} has no "
            f"{' or '.join(missing)} (packloader.runtime.cp_cost.cp_cost builds one from a cost model, a preset "
            "name or a profile; TileEstimate() needs none)")
    return cost


def _run_times(est: CPCost, q: np.ndarray, p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """est.segment_times, checked: one finite, non-negative forward and backward time per run."""
    f, b = est.segment_times(q, p)
    f, b = np.asarray(f, dtype=np.float64), np.asarray(b, dtype=np.float64)
    for name, t in (("forward", f), ("backward", b)):
        if t.shape != q.shape:
            raise ValueError(f"cost.segment_times gave {name} times of shape {t.shape} for {q.shape[0]} query runs")
        if not np.all(np.isfinite(t) & (t >= 0)):
            raise ValueError(f"cost.segment_times gave {name} times that are negative or not finite: "
                             f"{t[~(np.isfinite(t) & (t >= 0))][:5].tolist()}")
    return f, b


def _linear_time(est: CPCost, n: float) -> float:
    t = float(est.linear(n))
    if not (np.isfinite(t) and t >= 0):
        raise ValueError(f"cost.linear({n}) gave {t}: expected a finite time >= 0")
    return t


# ----------------------------------------------------------------------------------------------- layouts
#
# A layout is a list of runs tiling the packed row in order: (packed start, length, owner rank). Costs are computed
# from runs (no per-token work), and only the chosen layout is expanded to token indices.


@dataclass
class RowLayout:
    """Per-segment and per-token facts of a packed micro-batch."""

    lengths: np.ndarray
    starts: np.ndarray  # packed start of each segment
    seg_of: np.ndarray  # [T] segment of each token
    rel: np.ndarray  # [T] offset of each token in its segment

    @classmethod
    def of(cls, lengths: np.ndarray) -> "RowLayout":
        starts = np.zeros(lengths.size, dtype=np.int64)
        if lengths.size:
            np.cumsum(lengths[:-1], out=starts[1:])
        seg_of = np.repeat(np.arange(lengths.size, dtype=np.int64), lengths)
        rel = np.arange(seg_of.size, dtype=np.int64) - starts[seg_of] if seg_of.size else np.zeros(0, dtype=np.int64)
        return cls(lengths, starts, seg_of, rel)

    @property
    def total(self) -> int:
        return int(self.seg_of.size)


EMPTY = np.zeros(0, dtype=np.int64)


def merge_runs(start: np.ndarray, length: np.ndarray, owner: np.ndarray, lay: RowLayout):
    """Runs in packed order with empty ones dropped and neighbours of the same owner and segment joined."""
    keep = length > 0
    start, length, owner = start[keep], length[keep], owner[keep]
    if start.size == 0:
        return EMPTY, EMPTY, EMPTY
    seg = lay.seg_of[start]
    brk = np.ones(start.size, dtype=bool)
    brk[1:] = (owner[1:] != owner[:-1]) | (seg[1:] != seg[:-1])
    first = np.flatnonzero(brk)
    return start[first], np.add.reduceat(length, first), owner[first]


def sequence_runs(lay: RowLayout, cp: int):
    """Runs of per-sequence sharding and each rank's padding."""
    T, n = lay.total, 2 * cp
    chunk = max(1, -(-T // n))
    if T == 0:
        return EMPTY, EMPTY, EMPTY, np.zeros(cp, dtype=np.int64)
    bounds = np.union1d(lay.starts[lay.lengths > 0], np.arange(0, T, chunk))
    length = np.diff(np.append(bounds, T))
    c = bounds // chunk
    owner = np.where(c < cp, c, n - 1 - c)
    start, length, owner = merge_runs(bounds, length, owner, lay)
    counts = np.bincount(owner, weights=length, minlength=cp)[:cp].astype(np.int64)
    return start, length, owner, (2 * chunk - counts).astype(np.int64)


def document_runs(lay: RowLayout, cp: int, segs: np.ndarray):
    """Runs of per-document sharding of segments `segs` (packed order), remainder tokens dealt round-robin over
    the chunk slots with one pointer carried across those segments."""
    n = 2 * cp
    L = lay.lengths[segs]
    if L.size == 0:
        return EMPTY, EMPTY, EMPTY
    d, r = L // n, L % n
    ptr = (np.cumsum(r) - r) % n
    slot = np.arange(n)
    sizes = d[:, None] + (((slot[None, :] - ptr[:, None]) % n) < r[:, None])  # [k, 2CP] chunk sizes
    owners = np.where(slot < cp, slot, n - 1 - slot)
    rel = np.cumsum(sizes, axis=1) - sizes
    start = (lay.starts[segs][:, None] + rel).reshape(-1)
    return start, sizes.reshape(-1), np.broadcast_to(owners, sizes.shape).reshape(-1)


def layout_costs(start, length, owner, pad, lay: RowLayout, cp: int, est: Any, remapped: bool):
    """Per rank (attention fwd, attention bwd, linear fwd+bwd) of a layout given as merged runs."""
    fwd = np.zeros(cp)
    bwd = np.zeros(cp)
    if start.size:
        f, b = _run_times(est, length, lay.rel[start])
        fwd = np.bincount(owner, weights=f, minlength=cp)[:cp]
        bwd = np.bincount(owner, weights=b, minlength=cp)[:cp]
    lin = np.zeros(cp)
    if not remapped:
        counts = np.bincount(owner, weights=length, minlength=cp)[:cp] if start.size else np.zeros(cp)
        lin = np.array([_linear_time(est, float(counts[r] + pad[r])) for r in range(cp)])
    return fwd, bwd, lin


def hierarchical_runs(lay: RowLayout, cp: int, est: Any, remapped: bool, max_sharded: int, threshold: int | None):
    """(start, length, owner, sharded segments) of the best hierarchical partition found: the k longest segments
    sharded per document (k from 0 to max_sharded, or those >= threshold), the others whole, longest processing
    time first onto the least loaded rank."""
    import heapq

    L = lay.lengths
    nz = np.flatnonzero(L > 0)
    order = nz[np.argsort(-L[nz], kind="stable")]
    f_whole, b_whole = _run_times(est, L, np.zeros_like(L)) if L.size else (np.zeros(0), np.zeros(0))
    whole = np.asarray(f_whole, dtype=np.float64) + np.asarray(b_whole, dtype=np.float64)
    lin_on = not remapped
    per_token = (_linear_time(est, 1.0) - _linear_time(est, 0.0)) if lin_on else 0.0
    if threshold is not None:
        candidates = [int(np.sum(L[order] >= threshold))]
    else:
        candidates = list(range(0, min(order.size, max_sharded) + 1))
    zero = np.zeros(cp, dtype=np.int64)
    best = None
    for k in candidates:
        segs = np.sort(order[:k])
        s0, l0, o0 = merge_runs(*document_runs(lay, cp, segs), lay)
        fwd, bwd, _ = layout_costs(s0, l0, o0, zero, lay, cp, est, True)
        tokens = np.bincount(o0, weights=l0, minlength=cp)[:cp] if o0.size else np.zeros(cp)
        load = fwd + bwd + per_token * tokens
        heap = [(float(load[r]), r) for r in range(cp)]
        heapq.heapify(heap)
        rest = order[k:]
        owner_rest = np.empty(rest.size, dtype=np.int64)
        for j, s in enumerate(rest.tolist()):
            cost, r = heapq.heappop(heap)
            owner_rest[j] = r
            heapq.heappush(heap, (cost + float(whole[s]) + per_token * float(L[s]), r))
        fwd = fwd + np.bincount(owner_rest, weights=np.asarray(f_whole, dtype=np.float64)[rest], minlength=cp)[:cp]
        bwd = bwd + np.bincount(owner_rest, weights=np.asarray(b_whole, dtype=np.float64)[rest], minlength=cp)[:cp]
        tokens = tokens + np.bincount(owner_rest, weights=L[rest], minlength=cp)[:cp]
        lin = np.array([_linear_time(est, float(t)) for t in tokens]) if lin_on else np.zeros(cp)
        score = float(np.max(fwd + bwd + lin)) if cp else 0.0
        if best is None or score < best[0] * (1 - 1e-12):
            best = (score, segs, (s0, l0, o0), (rest, owner_rest))
    _, segs, (s0, l0, o0), (rest, owner_rest) = best
    start = np.concatenate([s0, lay.starts[rest]])
    length = np.concatenate([l0, L[rest]])
    owner = np.concatenate([o0, owner_rest])
    o = np.argsort(start, kind="stable")
    return start[o], length[o], owner[o], segs


