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
from typing import Any, Sequence

import numpy as np

from packloader.collate.cp_layouts import (
    EMPTY,
    CPCost,
    RowLayout,
    TileEstimate,
    check_cost,
    document_runs,
    hierarchical_runs,
    layout_costs,
    merge_runs,
    sequence_runs,
)
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
    est = check_cost(cost)
    lay = RowLayout.of(L)
    zero = np.zeros(cp, dtype=np.int64)

    def build(m: str):
        if m == "sequence":
            start, length, owner, pad = sequence_runs(lay, cp)
            sharded = np.flatnonzero(L > 0)
        elif m == "document":
            sharded = np.flatnonzero(L > 0)
            start, length, owner = merge_runs(*document_runs(lay, cp, sharded), lay)
            pad = zero
        else:
            start, length, owner, sharded = hierarchical_runs(lay, cp, est, remapped, max_sharded, hierarchical_threshold)
            pad = zero
        fwd, bwd, lin = layout_costs(start, length, owner, pad, lay, cp, est, remapped)
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
    token_owner = np.repeat(owner, length) if start.size else EMPTY
    return _assemble(chosen, cp, L, pos0, lay, token_owner, pad, sharded, fwd, bwd, lin, estimates)


def _runs(idx: np.ndarray, lay: RowLayout) -> tuple[np.ndarray, np.ndarray]:
    """(start positions into idx, run lengths) of the maximal runs of consecutive packed tokens of one segment."""
    n = idx.size
    if n == 0:
        return EMPTY, EMPTY
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
    collate's: 0 for every segment here, since slices are refused), and mode (`mode`, else adaptive).

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
    return plan_cp_shards(lengths, cp_size, mode or "adaptive", position_offsets=offsets, **kwargs)
