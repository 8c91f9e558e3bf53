"""Context-parallel shard metadata: which tokens of a packed micro-batch each CP rank owns, and what its attention
needs to run over the all-gathered keys and values.

A micro-batch is a packed row of segments (documents or independent pieces of them) of lengths ``L_0 .. L_{S-1}``.
Every mode assigns each packed token to one CP rank (an *owner*); everything else follows from the owners:

``sequence``      the packed row in ``2 x CP`` equal chunks (the last ones padded), rank i taking chunks i and
                  ``2CP-1-i`` (the usual load-balanced causal CP). Padding is counted (``num_padding``), never
                  materialised here.
``document``      each document in ``2 x CP`` chunks of ``D = L // 2CP`` tokens, rank i taking chunks i and
                  ``2CP-1-i`` (WLB-LLM 5.1). The ``R = L - 2CP*D`` remainder tokens are dealt round-robin over the
                  chunk slots ``0, 1, .., 2CP-1`` with a pointer that carries on across documents, so the ranks'
                  token counts differ by at most one and nothing is padded. A dealt token widens its slot's chunk
                  by one instead of becoming a stray single-token run at the document's end: each rank keeps at
                  most two query runs per document (fewer kernel tiles, less key duplication), and the slots'
                  ownership is still rank i <-> chunks i, 2CP-1-i.
``hierarchical``  Zeppelin: documents at or above a length threshold are sharded as in ``document``, shorter ones
                  stay whole on one rank, assigned longest-processing-time first to the rank with the least
                  estimated cost. The threshold is chosen per micro-batch by the same estimate (how many of the
                  longest documents to shard, 0..``max_sharded``). Token counts per rank are unequal: pair it with
                  the layout remapping of ``packloader.runtime.remap`` or accept the linear-layer imbalance.
``adaptive``      (WLB-LLM 5.3) every mode above is estimated and the lowest maximum per-rank latency wins. The
                  estimate is the caller's (``cost``, see ``CPCost``; ``packloader.runtime.cp_cost`` builds it from
                  a cost model): the attention time of every query run with its query count rounded up
                  to the kernel tile (``CostModel.segment_times``: a run of q queries after p earlier keys costs
                  ``a*(qt^2 + 2*qt*p) + b*qt + c``), forward + backward, plus, unless ``remapped``, the linear part
                  of the rank's tokens (padding included), since without remapping the linear layers run in the
                  attention layout.

A rank's query runs are maximal stretches of its tokens that are contiguous in the packed row and in one segment.
Under bottom-right causal alignment, a run whose first token sits at offset ``o`` of its document sees that
document's keys ``[0, o + lq)``: in the all-gathered keys, packed positions ``key_start .. key_start + o + lq``, so
``cu_seqlens_k`` of ``o + lq`` per run gives exactly "each query sees its document's keys up to itself".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

import numpy as np

from packloader.contracts import MicroBatch

MODES = ("sequence", "document", "hierarchical")

__all__ = ["MODES", "CPRankShard", "CPShardPlan", "plan_cp_shards", "shard_micro_batch", "CPCost", "TileEstimate"]


@dataclass
class CPRankShard:
    """What one CP rank owns of a packed micro-batch and what its attention needs. Arrays are numpy."""

    rank: int
    cp_size: int
    mode: str
    total_tokens: int  # tokens of the packed micro-batch (all ranks)
    token_index: np.ndarray  # int64 [n]: the packed positions this rank owns, increasing (its local token order)
    position_ids: np.ndarray  # int64 [n]: each local token's position (its segment's offset + index in it)
    cu_seqlens_q: np.ndarray  # int32 [R+1]: local query runs
    run_segment: np.ndarray  # int64 [R]: the micro-batch segment each run belongs to
    run_key_start: np.ndarray  # int64 [R]: packed (= all-gathered, reordered) position of that segment's first key
    run_key_visible: np.ndarray  # int64 [R]: keys the run's first query sees under causal = doc-relative offset + 1
    run_doc_len: np.ndarray  # int64 [R]: the segment's length (keys visible to any query without causality)
    max_seqlen_q: int
    num_padding: int  # tokens this rank would carry as padding (sequence mode with a length not divisible by 2CP)
    cost_fwd: float  # estimated attention forward time of this rank's runs (tile padding included)
    cost_bwd: float
    linear_cost: float  # estimated linear-part time (fwd + bwd) of this rank's tokens including padding
    counts: np.ndarray  # int64 [cp]: tokens each CP rank owns (the all-gather's per-rank sizes)
    gather_index: np.ndarray  # int64 [T]: packed token t is row gather_index[t] of the rank-major all-gather
    #                           buffer [cp * max(counts)] (rank r's tokens at rows r*max(counts) + 0..counts[r]-1)
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_tokens(self) -> int:
        return int(self.token_index.size)

    @property
    def num_runs(self) -> int:
        return int(self.run_segment.size)

    @property
    def cost(self) -> float:
        """Estimated attention time (forward + backward) of this rank."""
        return self.cost_fwd + self.cost_bwd

    @property
    def max_local(self) -> int:
        return int(self.counts.max()) if self.counts.size else 0

    def run_lengths(self) -> np.ndarray:
        return np.diff(self.cu_seqlens_q).astype(np.int64)

    def key_layout(self, causal: bool = True, window: tuple[int, int] = (-1, -1)) -> tuple[np.ndarray, np.ndarray, int]:
        """The keys each run attends to, as rows of the padded all-gather buffer.

        Returns ``(key_rows int64 [K], cu_seqlens_k int32 [R+1], max_seqlen_k)``: run b's keys are
        ``buffer[key_rows[cu_k[b]:cu_k[b+1]]]``. Causal: the document's keys from 0 (or from the left window edge of
        the run's first query) to the run's last query, so bottom-right alignment gives the exact causal / sliding
        window mask. Not causal: the whole document (only window (-1, -1) is possible then).
        """
        key = (bool(causal), int(window[0]), int(window[1]))
        hit = self._cache.get(("keys",) + key)
        if hit is not None:
            return hit
        left, right = int(window[0]), int(window[1])
        lq = self.run_lengths()
        first = self.run_key_visible - 1
        if causal:
            lo = np.zeros_like(first) if left < 0 else np.maximum(first - left, 0)
            hi = first + lq
        else:
            if left >= 0 or right >= 0:
                raise NotImplementedError("CP attention without causality supports only window=(-1, -1)")
            lo = np.zeros_like(first)
            hi = self.run_doc_len.copy()
        klen = (hi - lo).astype(np.int64)
        cu_k = np.zeros(klen.size + 1, dtype=np.int64)
        np.cumsum(klen, out=cu_k[1:])
        total = int(cu_k[-1])
        # packed key positions: run_key_start[b] + lo[b] + 0..klen[b]-1, for every run, concatenated
        base = np.repeat(self.run_key_start + lo - cu_k[:-1], klen)
        packed = base + np.arange(total, dtype=np.int64)
        rows = self.gather_index[packed] if total else np.zeros(0, dtype=np.int64)
        out = (rows, cu_k.astype(np.int32), int(klen.max()) if klen.size else 0)
        self._cache[("keys",) + key] = out
        return out

    def tensors(self, device: Any = "cpu") -> dict[str, Any]:
        """token_index, position_ids, cu_seqlens_q as torch tensors on `device` (cached per device)."""
        import torch

        dkey = ("tensors", str(device))
        hit = self._cache.get(dkey)
        if hit is None:
            hit = {
                "token_index": torch.from_numpy(self.token_index).to(device),
                "position_ids": torch.from_numpy(self.position_ids).to(device),
                "cu_seqlens_q": torch.from_numpy(self.cu_seqlens_q).to(device),
            }
            self._cache[dkey] = hit
        return hit


@dataclass
class CPShardPlan:
    """All CP ranks' shards of one micro-batch (every rank can compute it: it is a pure function of the lengths)."""

    mode: str
    cp_size: int
    lengths: np.ndarray  # int64 [S]
    ranks: list[CPRankShard]
    # mode -> estimated max per-rank latency, for every mode the choice considered (adaptive) or just the one used
    estimates: dict[str, float]
    sharded_segments: np.ndarray  # int64: segments split across ranks (all in document/sequence, long ones in hierarchical)

    def __getitem__(self, rank: int) -> CPRankShard:
        return self.ranks[rank]

    @property
    def costs(self) -> np.ndarray:
        """Estimated attention time (forward + backward) of each rank."""
        return np.array([r.cost for r in self.ranks], dtype=np.float64)

    @property
    def imbalance(self) -> float:
        """max / mean of the ranks' attention cost (1.0 = perfectly balanced)."""
        c = self.costs
        return float(c.max() / c.mean()) if c.size and c.mean() > 0 else 1.0


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


def _check_cost(cost: Any) -> CPCost:
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
class _Layout:
    """Per-segment and per-token facts of a packed micro-batch."""

    lengths: np.ndarray
    starts: np.ndarray  # packed start of each segment
    seg_of: np.ndarray  # [T] segment of each token
    rel: np.ndarray  # [T] offset of each token in its segment

    @classmethod
    def of(cls, lengths: np.ndarray) -> "_Layout":
        starts = np.zeros(lengths.size, dtype=np.int64)
        if lengths.size:
            np.cumsum(lengths[:-1], out=starts[1:])
        seg_of = np.repeat(np.arange(lengths.size, dtype=np.int64), lengths)
        rel = np.arange(seg_of.size, dtype=np.int64) - starts[seg_of] if seg_of.size else np.zeros(0, dtype=np.int64)
        return cls(lengths, starts, seg_of, rel)

    @property
    def total(self) -> int:
        return int(self.seg_of.size)


_EMPTY = np.zeros(0, dtype=np.int64)


def _merge(start: np.ndarray, length: np.ndarray, owner: np.ndarray, lay: _Layout):
    """Runs in packed order with empty ones dropped and neighbours of the same owner and segment joined."""
    keep = length > 0
    start, length, owner = start[keep], length[keep], owner[keep]
    if start.size == 0:
        return _EMPTY, _EMPTY, _EMPTY
    seg = lay.seg_of[start]
    brk = np.ones(start.size, dtype=bool)
    brk[1:] = (owner[1:] != owner[:-1]) | (seg[1:] != seg[:-1])
    first = np.flatnonzero(brk)
    return start[first], np.add.reduceat(length, first), owner[first]


def _sequence_runs(lay: _Layout, cp: int):
    """Runs of per-sequence sharding and each rank's padding."""
    T, n = lay.total, 2 * cp
    chunk = max(1, -(-T // n))
    if T == 0:
        return _EMPTY, _EMPTY, _EMPTY, np.zeros(cp, dtype=np.int64)
    bounds = np.union1d(lay.starts[lay.lengths > 0], np.arange(0, T, chunk))
    length = np.diff(np.append(bounds, T))
    c = bounds // chunk
    owner = np.where(c < cp, c, n - 1 - c)
    start, length, owner = _merge(bounds, length, owner, lay)
    counts = np.bincount(owner, weights=length, minlength=cp)[:cp].astype(np.int64)
    return start, length, owner, (2 * chunk - counts).astype(np.int64)


def _document_runs(lay: _Layout, cp: int, segs: np.ndarray):
    """Runs of per-document sharding of segments `segs` (packed order), remainder tokens dealt round-robin over
    the chunk slots with one pointer carried across those segments."""
    n = 2 * cp
    L = lay.lengths[segs]
    if L.size == 0:
        return _EMPTY, _EMPTY, _EMPTY
    d, r = L // n, L % n
    ptr = (np.cumsum(r) - r) % n
    slot = np.arange(n)
    sizes = d[:, None] + (((slot[None, :] - ptr[:, None]) % n) < r[:, None])  # [k, 2CP] chunk sizes
    owners = np.where(slot < cp, slot, n - 1 - slot)
    rel = np.cumsum(sizes, axis=1) - sizes
    start = (lay.starts[segs][:, None] + rel).reshape(-1)
    return start, sizes.reshape(-1), np.broadcast_to(owners, sizes.shape).reshape(-1)


def _costs(start, length, owner, pad, lay: _Layout, cp: int, est: Any, remapped: bool):
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


def _hierarchical_runs(lay: _Layout, cp: int, est: Any, remapped: bool, max_sharded: int, threshold: int | None):
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
        s0, l0, o0 = _merge(*_document_runs(lay, cp, segs), lay)
        fwd, bwd, _ = _costs(s0, l0, o0, zero, lay, cp, est, True)
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


# ----------------------------------------------------------------------------------------------- public API


def plan_cp_shards(
    lengths: Sequence[int] | np.ndarray,
    cp_size: int,
    mode: str = "adaptive",
    *,
    cost: CPCost,
    position_offsets: Sequence[int] | np.ndarray | None = None,
    remapped: bool = False,
    modes: Sequence[str] = MODES,
    max_sharded: int = 16,
    hierarchical_threshold: int | None = None,
) -> CPShardPlan:
    """Shard a packed micro-batch of segments of `lengths` over `cp_size` ranks.

    `mode`: "sequence", "document", "hierarchical" or "adaptive" (the lowest estimated max per-rank latency among
    `modes`). `cost`: the estimate to balance (`CPCost`: attention time per query run, linear time per rank), from
    the caller that knows the model (`packloader.runtime.cp_cost.cp_cost(model)`; `cp_cost()` is the llama3-8b
    preset, the measured H100 profile); a bad one is an error, never replaced. `position_offsets`: each segment's
    first position id (start - attend_from: 0 for a document or an independent piece, which restart their
    positions); default 0. `remapped`: the linear layers run in a separately balanced layout (runtime.remap), so
    only attention counts in the estimate. `hierarchical_threshold`: shard exactly the
    segments at least this long instead of searching over the `max_sharded` longest.
    """
    cp = int(cp_size)
    if cp < 1:
        raise ValueError(f"cp_size must be >= 1, got {cp_size}")
    L = np.asarray(lengths, dtype=np.int64).reshape(-1)
    if np.any(L < 0):
        raise ValueError(f"segment lengths must be >= 0, got {L.tolist()}")
    pos0 = np.zeros_like(L) if position_offsets is None else np.asarray(position_offsets, dtype=np.int64).reshape(-1)
    if pos0.shape != L.shape:
        raise ValueError(f"{pos0.size} position offsets for {L.size} segments")
    if mode not in MODES and mode != "adaptive":
        raise ValueError(f"unknown CP sharding mode {mode!r}; expected one of {', '.join(MODES)} or 'adaptive'")
    for m in modes:
        if m not in MODES:
            raise ValueError(f"unknown CP sharding mode {m!r} in modes; expected {', '.join(MODES)}")
    est = _check_cost(cost)
    lay = _Layout.of(L)
    zero = np.zeros(cp, dtype=np.int64)

    def build(m: str):
        if m == "sequence":
            start, length, owner, pad = _sequence_runs(lay, cp)
            sharded = np.flatnonzero(L > 0)
        elif m == "document":
            sharded = np.flatnonzero(L > 0)
            start, length, owner = _merge(*_document_runs(lay, cp, sharded), lay)
            pad = zero
        else:
            start, length, owner, sharded = _hierarchical_runs(lay, cp, est, remapped, max_sharded, hierarchical_threshold)
            pad = zero
        fwd, bwd, lin = _costs(start, length, owner, pad, lay, cp, est, remapped)
        score = float(np.max(fwd + bwd + lin)) if cp else 0.0
        return (start, length, owner), pad, sharded, (fwd, bwd, lin), score

    if mode == "adaptive":
        built = {m: build(m) for m in modes}
        estimates = {m: b[4] for m, b in built.items()}
        chosen = min(modes, key=lambda m: (estimates[m], list(modes).index(m)))
    else:
        built = {mode: build(mode)}
        estimates = {mode: built[mode][4]}
        chosen = mode
    (start, length, owner), pad, sharded, (fwd, bwd, lin), _ = built[chosen]
    token_owner = np.repeat(owner, length) if start.size else _EMPTY
    return _assemble(chosen, cp, L, pos0, lay, token_owner, pad, sharded, fwd, bwd, lin, estimates)


def _runs(idx: np.ndarray, lay: _Layout) -> tuple[np.ndarray, np.ndarray]:
    """(start positions into idx, run lengths) of the maximal runs of consecutive packed tokens of one segment."""
    n = idx.size
    if n == 0:
        return _EMPTY, _EMPTY
    brk = np.ones(n, dtype=bool)
    brk[1:] = (np.diff(idx) != 1) | (lay.seg_of[idx[1:]] != lay.seg_of[idx[:-1]])
    starts = np.flatnonzero(brk).astype(np.int64)
    lens = np.diff(np.append(starts, n)).astype(np.int64)
    return starts, lens


def _assemble(mode, cp, L, pos0, lay, owner, pad, sharded, fwd, bwd, lin, estimates) -> CPShardPlan:
    counts = np.bincount(owner, minlength=cp).astype(np.int64)[:cp] if owner.size else np.zeros(cp, dtype=np.int64)
    max_local = int(counts.max()) if cp else 0
    T = int(owner.size)
    # gather_index: packed token -> row of the rank-major padded all-gather buffer
    order = np.argsort(owner, kind="stable")  # rank-major, increasing packed position within a rank
    local_pos = np.arange(T, dtype=np.int64) - np.repeat(np.concatenate([[0], np.cumsum(counts)[:-1]]), counts)
    gather_index = np.empty(T, dtype=np.int64)
    gather_index[order] = owner[order] * max_local + local_pos
    ranks = []
    for r in range(cp):
        idx = order[np.sum(counts[:r]): np.sum(counts[: r + 1])].astype(np.int64)
        s, q = _runs(idx, lay)
        first = idx[s] if s.size else np.zeros(0, dtype=np.int64)
        seg = lay.seg_of[first]
        cu_q = np.zeros(q.size + 1, dtype=np.int32)
        np.cumsum(q, out=cu_q[1:])
        ranks.append(CPRankShard(
            rank=r, cp_size=cp, mode=mode, total_tokens=T,
            token_index=idx,
            position_ids=(pos0[lay.seg_of[idx]] + lay.rel[idx]).astype(np.int64),
            cu_seqlens_q=cu_q,
            run_segment=seg.astype(np.int64),
            run_key_start=lay.starts[seg].astype(np.int64),
            run_key_visible=(lay.rel[first] + 1).astype(np.int64),
            run_doc_len=L[seg].astype(np.int64),
            max_seqlen_q=int(q.max()) if q.size else 0,
            num_padding=int(pad[r]),
            cost_fwd=float(fwd[r]), cost_bwd=float(bwd[r]), linear_cost=float(lin[r]),
            counts=counts, gather_index=gather_index,
        ))
    return CPShardPlan(mode=mode, cp_size=cp, lengths=L, ranks=ranks, estimates=estimates,
                       sharded_segments=np.asarray(sharded, dtype=np.int64))


def shard_micro_batch(mb: MicroBatch, cp_size: int, *, mode: str | None = None, **kwargs: Any) -> CPShardPlan:
    """plan_cp_shards for a planner's MicroBatch: its segments' lengths, position offsets (start - attend_from, the
    collate's: 0 for every segment here, since slices are refused), and mode (`mode`, else the micro-batch's
    `cp_mode`, else adaptive).

    Slices (``attend_from < start``, SlimPack) need their document's earlier keys from a KV cache that lives
    outside the micro-batch; CP sharding of those is not supported and is refused here.
    """
    for s in mb.segments:
        if s.attend_from != s.start:
            raise NotImplementedError(
                f"segment of document {s.doc} is a slice (attend_from={s.attend_from} < start={s.start}); "
                "context-parallel sharding of slices is not supported: plan with allow_slicing=False when CP > 1")
    lengths = [s.end - s.start for s in mb.segments]
    offsets = [s.start - s.attend_from for s in mb.segments]
    return plan_cp_shards(lengths, cp_size, mode or mb.cp_mode or "adaptive", position_offsets=offsets, **kwargs)
