"""Attention of one pool GPU under per-document context parallelism: CP groups of different sizes in one step.

A GPU's local rows (``DynamicCPShard``, ``packloader.collate.cp_document_shards``) are its CP groups' shards one after the
other. ``dynamic_cp_attention``:

1. all-gathers the keys and values of every group of size > 1 over that group's process group (created once for the
   whole pool by ``groups.prepare_cp_pool_groups``), in the shard's group order, and keeps the rows of size-1 groups
   as they are;
2. picks for every local query run its document's keys up to its last query out of its group's buffer
   (``CPRankShard.key_layout``) and runs one ``varlen_attention`` over all runs (bottom-right causal alignment gives
   each query its document's keys up to itself);
3. in backward, sends every gathered row's gradient back to its owner (reduce-scatter, or all-reduce and slice).

All the gathers of a call are one autograd node, so the backward issues its reduce-scatters in the same order as the
forward's gathers on every GPU: larger groups first, then by first GPU. That order is global, so GPUs whose groups
nest never wait on each other in a cycle. A GPU that owns no row of a gathered group still runs the node's backward
(its output is tied to the gathered rows with a zero), so its partners' reduce-scatters complete.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

import numpy as np
import torch
import torch.distributed as dist

from packloader.runtime.attention import varlen_attention
from packloader.runtime.cp_attention import _all_gather, _reduce_scatter
from packloader.runtime.groups import ProcessGroupCache, cp_pool_group

__all__ = ["ChainHooks", "GatherGroups", "dynamic_cp_attention", "prefix_segments", "segment_rows"]


class GatherGroups(torch.autograd.Function):
    """Rows [n_i, ...] of each group -> its rank-major gathered rows [size_i * max_local_i, ...] (each rank's block
    zero-padded), one group after another; backward: each rank's own rows' gradient summed over its group."""

    @staticmethod
    def forward(ctx, specs, *rows: torch.Tensor):  # noqa: D102
        ctx.specs, ctx.ns = specs, [r.shape[0] for r in rows]
        out = []
        for (max_local, group), local in zip(specs, rows):
            n = local.shape[0]
            padded = local.contiguous()
            if n < max_local:
                padded = torch.cat([padded, padded.new_zeros((max_local - n,) + tuple(local.shape[1:]))])
            full = local.new_empty((dist.get_world_size(group) * max_local,) + tuple(local.shape[1:]))
            _all_gather(full, padded, group)
            out.append(full)
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):  # noqa: D102
        mine = [_reduce_scatter(g.contiguous(), max_local, group)[:n]
                for (max_local, group), g, n in zip(ctx.specs, grads, ctx.ns)]
        return (None, *mine)


def _layout(shard, device: torch.device, gathered: Sequence[bool]):
    """Key rows into the concatenated group buffers, then the slices' prefix block (cached per device): each run's
    earlier-slice keys first (`run_prefix`), then its own; and whether any row comes from a gathered group."""
    key = ("dynamic_layout", str(device))
    hit = shard._cache.get(key)
    if hit is None:
        rows, cus, at, k_at, from_gathered = [], [np.zeros(1, np.int64)], 0, 0, 0
        for g, is_gathered in zip(shard.groups, gathered):
            r, cu, _ = g.shard.key_layout(causal=True)
            rows.append(r + at)
            cus.append(k_at + cu[1:].astype(np.int64))
            at += g.size * g.shard.max_local if is_gathered else g.shard.num_tokens
            k_at += int(cu[-1])
            from_gathered += int(r.size) if is_gathered else 0
        own, own_cu = (np.concatenate(rows) if rows else np.zeros(0, np.int64)), np.concatenate(cus)
        idx = _with_prefix(shard, own, own_cu, at)
        hit = (torch.from_numpy(idx).to(device), torch.from_numpy(shard.cu_seqlens_q).to(device),
               torch.from_numpy(shard.cu_seqlens_k).to(device), from_gathered > 0)
        shard._cache[key] = hit
    return hit


def prefix_segments(shard) -> list[tuple[int, int]]:
    """(segment, prefix length) of every slice with a run on this GPU, in the order their earlier keys follow the
    group buffers."""
    pre = shard.run_prefix
    return sorted({(int(s), int(p)) for s, p in zip(shard.run_segment[pre > 0], pre[pre > 0])})


def _with_prefix(shard, own: np.ndarray, own_cu: np.ndarray, base: int) -> np.ndarray:
    pre = shard.run_prefix.astype(np.int64)
    if not pre.any():
        return own
    block, at = {}, base
    for seg, n in prefix_segments(shard):
        block[seg], at = at, at + n
    lens = np.diff(own_cu)
    cu = np.concatenate([[0], np.cumsum(lens + pre)]).astype(np.int64)
    if not np.array_equal(cu, shard.cu_seqlens_k.astype(np.int64)):
        raise ValueError(f"pool GPU {shard.gpu}: cu_seqlens_k does not count each run's earlier-slice keys and its "
                         "own (a shard from another plan_dynamic_cp)")
    out = np.empty(int(cu[-1]), np.int64)
    run = np.repeat(np.arange(lens.size), lens)
    out[cu[run] + pre[run] + np.arange(own.size) - own_cu[run]] = own
    for b in np.nonzero(pre)[0]:
        out[cu[b]:cu[b] + pre[b]] = block[int(shard.run_segment[b])] + np.arange(pre[b])
    return out


def segment_rows(shard, gathered: Sequence[bool]) -> dict[int, np.ndarray]:
    """Rows of each micro-batch segment's tokens, in order, in the concatenated group buffers (what a chain keeps)."""
    hit = shard._cache.get("segment_rows")
    if hit is None:
        hit, at = {}, 0
        for g, is_gathered in zip(shard.groups, gathered):
            for j, seg in enumerate(g.segments.tolist()):
                hit[seg] = at + g.shard.gather_index[g.offsets[j]:g.offsets[j + 1]]
            at += g.size * g.shard.max_local if is_gathered else g.shard.num_tokens
        shard._cache["segment_rows"] = hit
    return hit


class ChainHooks(Protocol):
    """What `dynamic_cp_attention` asks of a chain's context (`runtime.cp_chains.DynamicCPContext`)."""

    wanted: frozenset[int]  # segments whose gathered keys/values `keep` receives

    def prefix(self, seg: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys, values of the n earlier-slice tokens of segment `seg`, in document order."""

    def keep(self, seg: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Segment `seg`'s keys/values (all its tokens, document order, gathered over its group)."""


def dynamic_cp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shard: Any,
                         groups: ProcessGroupCache | None = None, *, rank_map: Sequence[int] | None = None,
                         softmax_scale: float | None = None, backend: str | None = None,
                         chain: ChainHooks | None = None) -> torch.Tensor:
    """Causal attention of this pool GPU's rows over its documents' keys on every GPU of their CP groups.

    `q [n, Hq, D]`, `k/v [n, Hkv, D]`: the rows of `shard` (a `DynamicCPShard`: `PackedBatch.cp` of a dynamic-CP
    batch, the order of its tokens). `groups`: the pool's process groups (`prepare_cp_pool_groups`, called on every
    rank before the first step; default: the shared cache); `rank_map`: pool GPU -> global rank, as given there.
    `chain`: where a shard holds slices, the step's context that keeps and hands back earlier slices' keys
    (`runtime.cp_chains.DynamicCPExecutor` passes it). Returns `out [n, Hq, D]`, differentiable in q, k and v."""
    n = shard.num_tokens
    if q.shape[0] != n or k.shape[0] != n or v.shape[0] != n:
        raise ValueError(f"q/k/v have {q.shape[0]}/{k.shape[0]}/{v.shape[0]} rows; pool GPU {shard.gpu}'s part of "
                         f"this micro-batch holds {n} tokens")
    if k.shape[:2] != v.shape[:2]:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} differ in rows or heads")
    slices = prefix_segments(shard)
    if slices and chain is None:
        raise ValueError(f"pool GPU {shard.gpu}'s micro-batch holds slices (segments {[s for s, _ in slices]}) whose "
                         "earlier keys ran in earlier micro-batches: run the step with runtime.cp_chains."
                         "DynamicCPExecutor, which keeps them")
    dk = k.shape[-1]
    kv = torch.cat([k, v], dim=-1)
    specs, gathered_rows = [], []
    gathered = [g.size > 1 for g in shard.groups]
    for g in shard.groups:
        if g.size > 1:
            pg = cp_pool_group(g.size, g.first, gpu=shard.gpu, rank_map=rank_map, groups=groups)
            specs.append((g.shard.max_local, pg))
            gathered_rows.append(kv[g.lo:g.hi])
    bufs = iter(GatherGroups.apply(tuple(specs), *gathered_rows) if specs else ())
    parts = [next(bufs) if is_g else kv[g.lo:g.hi] for g, is_g in zip(shard.groups, gathered)]
    if chain is not None:
        whole = torch.cat(parts) if parts and chain.wanted else kv[:0]
        for seg in sorted(chain.wanted):
            key = ("segment_rows", seg, str(q.device))
            if key not in shard._cache:
                shard._cache[key] = torch.from_numpy(segment_rows(shard, gathered)[seg]).to(q.device)
            own = whole.index_select(0, shard._cache[key])
            chain.keep(seg, own[..., :dk], own[..., dk:])
        parts = parts + [torch.cat(chain.prefix(seg, n), dim=-1) for seg, n in slices]
    rows, cu_q, cu_k, uses_gathered = _layout(shard, q.device, gathered)
    sel = torch.cat(parts).index_select(0, rows) if parts else kv[:0]
    k_sel, v_sel = sel[..., :dk], sel[..., dk:]
    if q.is_cuda:
        k_sel, v_sel = k_sel.contiguous(), v_sel.contiguous()
    out = varlen_attention(q, k_sel, v_sel, cu_q, cu_k, shard.max_seqlen_q, shard.max_seqlen_k, causal=True,
                           softmax_scale=softmax_scale, backend=backend)
    if specs and not uses_gathered:
        # no row of a gathered group is this GPU's: tie the output to the gathers with a zero so their backward
        # (the partners' reduce-scatters) still runs here
        out = out + sum(p.sum() for p, is_g in zip(parts, gathered) if is_g) * 0
    return out
