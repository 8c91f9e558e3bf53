"""Layout remapping between the linear layers and attention (Zeppelin's remapping layer).

Linear layers (projections, MLP, norms) cost the same per token, so they want every rank to hold the same number
of tokens. Attention costs grow with the square of a document's length, so it wants every rank to hold the same
*attention cost*: short documents kept whole on one rank, long ones cut into chunks spread over all ranks
(Zeppelin's hierarchical partitioning). Between the two, activations move with an all-to-all.

A `Layout` says, for each rank of a process group, which global token indices (positions in the packed
micro-batch) it holds, in its local order. `micro_batch_layouts` builds both layouts of a micro-batch from its
segments (the attention layout is `packloader.collate.cp_sequence_shards`'s hierarchical CP sharding, whose per-rank
metadata `packloader.runtime.cp_attention` runs); `Remapper` (or the functional `remap`) moves `[tokens, ...]` activations from one layout to the other
as an autograd operation: the backward pass is the inverse exchange of the gradients, so gradients are exact
(a layout is a permutation of the tokens: each token is held by exactly one rank).

Transport: `torch.distributed.all_to_all_single` with uneven splits (NCCL; gloo on CPU in recent torch). Where
the backend lacks it (gloo in some versions), an all-gather exchange gives the same result: every rank gathers
every rank's tokens (padded to the largest count) and keeps those it needs. It moves world_size times more data,
so it is a fallback, not a transport for production sizes. `method="auto"` probes all_to_all once per backend.
Checked here: torch 2.14's gloo runs all_to_all_single with uneven splits on CPU.

A layer then runs: projections in the linear layout, `to_attention(q)`, `to_attention(k)`, `to_attention(v)`,
`cp_attention(..., layout.shards[rank])`, `to_linear(out)`, output projection and MLP in the linear layout
(tests/test_remap_distributed.py does exactly this and matches the single-process layer).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Literal, Sequence

import numpy as np
import torch
import torch.distributed as dist

from packloader.contracts import Segment

log = logging.getLogger(__name__)

Method = Literal["auto", "all_to_all", "all_gather"]

# ------------------------------------------------------------------------------------------------ layouts


@dataclass(frozen=True, eq=False)
class Layout:
    """Which global tokens each rank holds: `indices[r]` (int64) are rank r's tokens in its local order.

    `shards`, on an attention layout built by `micro_batch_layouts`, is the `packloader.collate.cp_sequence_shards`
    plan it came from: per rank, the query runs, position ids and key ranges that its attention needs (whole
    documents run locally; a sharded one through `packloader.runtime.cp_attention`), and the estimated cost.
    """

    indices: tuple[np.ndarray, ...]
    num_tokens: int
    shards: Any = field(default=None)

    def __post_init__(self) -> None:
        object.__setattr__(self, "indices", tuple(np.ascontiguousarray(i, dtype=np.int64) for i in self.indices))

    @property
    def world_size(self) -> int:
        return len(self.indices)

    @property
    def counts(self) -> np.ndarray:
        return np.array([len(i) for i in self.indices], dtype=np.int64)

    def owner(self) -> tuple[np.ndarray, np.ndarray]:
        """(rank, local position) of every global token; raises unless each token is held exactly once."""
        rank = np.full(self.num_tokens, -1, dtype=np.int64)
        pos = np.empty(self.num_tokens, dtype=np.int64)
        for r, idx in enumerate(self.indices):
            if len(idx) and (idx.min() < 0 or idx.max() >= self.num_tokens):
                raise ValueError(f"rank {r} holds token indices outside 0..{self.num_tokens - 1}")
            if np.any(rank[idx] >= 0) or len(np.unique(idx)) != len(idx):
                dup = idx[rank[idx] >= 0][:5] if np.any(rank[idx] >= 0) else idx[:0]
                raise ValueError(f"rank {r} holds tokens another rank (or itself) already holds, e.g. {dup.tolist()}")
            rank[idx] = r
            pos[idx] = np.arange(len(idx))
        missing = np.nonzero(rank < 0)[0]
        if len(missing):
            raise ValueError(f"{len(missing)} of {self.num_tokens} tokens are held by no rank, e.g. {missing[:5].tolist()}")
        return rank, pos

    def validate(self) -> "Layout":
        self.owner()
        return self


def linear_layout(num_tokens: int, world_size: int) -> Layout:
    """Equal contiguous token counts per rank (the first `num_tokens % world_size` ranks hold one more)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    parts = np.array_split(np.arange(num_tokens, dtype=np.int64), world_size)
    return Layout(tuple(parts), num_tokens)


def micro_batch_layouts(
    segments: Sequence[Segment] | Sequence[int] | np.ndarray,
    world_size: int,
    *,
    mode: str = "hierarchical",
    cost_model: Any = None,
    **shard_options: Any,
) -> tuple[Layout, Layout]:
    """The linear layout and the attention layout of one micro-batch over `world_size` ranks.

    `segments`: the micro-batch's segments (packed in order; positions as the collate gives them, from 0 at each
    document or independent piece) or plain lengths. The linear layout: equal contiguous token counts. The attention layout: the CP
    shards of `packloader.collate.cp_sequence_shards.plan_cp_shards` in `mode` (default Zeppelin's hierarchical: short
    documents whole on one rank, long ones in 2 x world_size chunks, rank i taking chunks i and 2W-1-i,
    balancing the estimated attention time of `cost_model`) with `remapped=True`, since the linear layers run in
    the linear layout and only attention counts; `shard_options` go to plan_cp_shards. Slices (attend_from <
    start) are refused: their earlier keys live in a KV cache outside the micro-batch.
    """
    from packloader.collate.cp_sequence_shards import plan_cp_shards
    from packloader.runtime.cp_cost import cp_cost

    W = int(world_size)
    if W < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    segs = list(segments)
    if segs and isinstance(segs[0], Segment):
        for s in segs:
            if s.attend_from < s.start:
                raise NotImplementedError(
                    f"document {s.doc} is sliced (tokens {s.start}..{s.end - 1} attend from {s.attend_from}): layout "
                    f"remapping of slices is not supported; plan with allow_slicing=False when remapping")
        lengths = np.array([s.end - s.start for s in segs], dtype=np.int64)
        offsets = np.array([s.start - s.attend_from for s in segs], dtype=np.int64)
    else:
        lengths = np.asarray(segs, dtype=np.int64).reshape(-1)
        offsets = None
    shards = plan_cp_shards(lengths, W, mode, cost=cp_cost(cost_model), position_offsets=offsets, remapped=True,
                            **shard_options)
    total = int(lengths.sum())
    attention = Layout(tuple(r.token_index for r in shards.ranks), total, shards=shards)
    return linear_layout(total, W), attention


# --------------------------------------------------------------------------------------------- transport


@dataclass(frozen=True, eq=False)
class _RankPlan:
    """What one rank sends and receives to move a tensor from layout `src` to layout `dst`."""

    rank: int
    send_pos: np.ndarray  # local positions (in src order) in send order, grouped by destination rank
    send_counts: list[int]
    recv_counts: list[int]
    recv_pos: np.ndarray  # local positions (in dst order) of the received tokens, in receive order
    # all-gather fallback: every rank's src count, and for each local dst token its (source rank, source position)
    src_counts: list[int]
    gather_rank: np.ndarray
    gather_pos: np.ndarray
    num_out: int


def _rank_plan(src: Layout, dst: Layout, rank: int) -> _RankPlan:
    if src.world_size != dst.world_size or src.num_tokens != dst.num_tokens:
        raise ValueError(
            f"layouts differ in shape: {src.world_size} ranks x {src.num_tokens} tokens vs "
            f"{dst.world_size} ranks x {dst.num_tokens} tokens"
        )
    W = src.world_size
    src_rank, src_pos = src.owner()
    dst.owner()  # validates
    send_pos, send_counts = [], []
    for d in range(W):
        g = dst.indices[d]
        mine = g[src_rank[g] == rank]  # in d's order
        send_pos.append(src_pos[mine])
        send_counts.append(len(mine))
    g = dst.indices[rank]
    owners = src_rank[g]
    recv_pos, recv_counts = [], []
    for s in range(W):
        where = np.nonzero(owners == s)[0]  # positions in my dst order, in s's send order (= my order)
        recv_pos.append(where)
        recv_counts.append(len(where))
    return _RankPlan(
        rank=rank,
        send_pos=np.concatenate(send_pos).astype(np.int64),
        send_counts=send_counts,
        recv_counts=recv_counts,
        recv_pos=np.concatenate(recv_pos).astype(np.int64),
        src_counts=[len(i) for i in src.indices],
        gather_rank=owners.astype(np.int64),
        gather_pos=src_pos[g].astype(np.int64),
        num_out=len(g),
    )


_A2A_SUPPORT: dict[str, bool] = {}


def _a2a(out: torch.Tensor, inp: torch.Tensor, plan: _RankPlan, group) -> None:
    dist.all_to_all_single(out, inp, plan.recv_counts, plan.send_counts, group=group)


def _exchange(x: torch.Tensor, plan: _RankPlan, group, method: Method) -> torch.Tensor:
    W = len(plan.src_counts)
    if x.shape[0] != plan.src_counts[plan.rank]:
        raise ValueError(f"rank {plan.rank} holds {x.shape[0]} tokens, its source layout says {plan.src_counts[plan.rank]}")
    dev = x.device
    if W == 1:
        return x[torch.as_tensor(plan.gather_pos, device=dev)]
    if method == "auto":
        backend = str(dist.get_backend(group))
        supported = _A2A_SUPPORT.get(backend)
        if supported is None:
            try:
                out = _exchange(x, plan, group, "all_to_all")
            except (RuntimeError, NotImplementedError) as e:  # same on every rank: the backend lacks the op
                if "support" not in str(e).lower() and "not implemented" not in str(e).lower():
                    raise
                _A2A_SUPPORT[backend] = False
                log.info("all_to_all_single unavailable on %s (%s); layout remapping falls back to all_gather", backend, e)
                return _exchange(x, plan, group, "all_gather")
            _A2A_SUPPORT[backend] = True
            return out
        method = "all_to_all" if supported else "all_gather"
    if method == "all_to_all":
        send = x[torch.as_tensor(plan.send_pos, device=dev)].contiguous()
        buf = x.new_empty((int(sum(plan.recv_counts)), *x.shape[1:]))
        _a2a(buf, send, plan, group)
        out = x.new_empty((plan.num_out, *x.shape[1:]))
        out[torch.as_tensor(plan.recv_pos, device=dev)] = buf
        return out
    if method == "all_gather":
        n = max(max(plan.src_counts), 1)
        padded = x.new_zeros((n, *x.shape[1:]))
        padded[: x.shape[0]] = x
        parts = [torch.empty_like(padded) for _ in range(W)]
        dist.all_gather(parts, padded.contiguous(), group=group)
        gathered = torch.stack(parts)  # [W, n, ...]
        return gathered[torch.as_tensor(plan.gather_rank, device=dev), torch.as_tensor(plan.gather_pos, device=dev)]
    raise ValueError(f"unknown remap method {method!r}; expected 'auto', 'all_to_all' or 'all_gather'")


class _RemapFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fwd: _RankPlan, bwd: _RankPlan, group, method):  # noqa: D401 - autograd API
        ctx.bwd, ctx.group, ctx.method = bwd, group, method
        return _exchange(x.contiguous(), fwd, group, method)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad.contiguous(), ctx.bwd, ctx.group, ctx.method), None, None, None, None


def _group_rank(group) -> int:
    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


class Remapper:
    """Moves `[tokens, ...]` activations of one micro-batch between its linear and attention layouts.

    Build it once per micro-batch (the plans are numpy work over the token indices) and call `to_attention`
    before attention and `to_linear` after it; both are differentiable. All ranks of `group` must call them
    in the same order (they are collectives). The layouts' ranks are ranks within `group`.
    """

    def __init__(self, linear: Layout, attention: Layout, *, group=None, method: Method = "auto") -> None:
        if linear.world_size > 1 and not dist.is_initialized():
            raise RuntimeError("layout remapping over several ranks needs torch.distributed to be initialised")
        if dist.is_initialized() and linear.world_size != dist.get_world_size(group):
            raise ValueError(f"layouts have {linear.world_size} ranks, the process group {dist.get_world_size(group)}")
        rank = _group_rank(group)
        self.linear, self.attention, self.group, self.method = linear, attention, group, method
        self._to_attn = _rank_plan(linear, attention, rank)
        self._to_lin = _rank_plan(attention, linear, rank)

    def to_attention(self, x: torch.Tensor) -> torch.Tensor:
        return _RemapFn.apply(x, self._to_attn, self._to_lin, self.group, self.method)

    def to_linear(self, x: torch.Tensor) -> torch.Tensor:
        return _RemapFn.apply(x, self._to_lin, self._to_attn, self.group, self.method)


def remap(x: torch.Tensor, src: Layout, dst: Layout, *, group=None, method: Method = "auto") -> torch.Tensor:
    """Move this rank's `x` (its tokens of layout `src`, in local order) to layout `dst`; differentiable."""
    rank = _group_rank(group)
    return _RemapFn.apply(x, _rank_plan(src, dst, rank), _rank_plan(dst, src, rank), group, method)
