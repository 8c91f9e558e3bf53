"""Context-parallel attention over packed documents (all-gather K/V, per-document query runs).

Each CP rank holds the query, key and value rows of the tokens its shard owns (``CPRankShard.token_index``, in
increasing packed order; ``packloader.collate.cp_sequence_shards`` builds the shards for the sequence, document and
hierarchical modes). ``cp_attention``:

1. all-gathers the keys and values of the CP group (for GQA the Hkv heads only; one collective for K and V
   together; ranks with fewer tokens are padded to the group's largest shard inside the collective);
2. picks, for each local query run, the keys of its document from 0 (or the sliding window's left edge) up to the
   run's last token, out of the gathered buffer (``CPRankShard.key_layout``);
3. runs ``varlen_attention`` with those key counts as ``cu_seqlens_k``: bottom-right causal alignment then gives
   every query exactly its own document's keys up to itself;
4. in backward, autograd brings the gradients of the selected keys back to the gathered buffer (index_select's
   backward sums duplicates), and ``AllGatherKV.backward`` sends every key/value row's gradient to its owner:
   ``reduce_scatter`` (NCCL, and gloo where it has it), else ``all_reduce`` then slice.

Memory: a rank materialises its runs' keys, about ``sum over its runs of (offset + run length)`` rows, which is at
most about 1.5 x the document length per sharded document (two runs, the later one seeing almost all of it);
those rows are what the attention kernel saves for backward.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from packloader.runtime.attention import varlen_attention

__all__ = ["AllGatherKV", "all_gather_kv", "cp_attention"]


def _group_size(group) -> int:
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def _group_rank(group) -> int:
    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


def _all_gather(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    fn = getattr(dist, "all_gather_single", None) or getattr(dist, "all_gather_into_tensor", None)
    if fn is not None:
        try:
            fn(out, inp, group=group)
            return
        except (RuntimeError, NotImplementedError):  # a backend without the fused collective
            pass
    dist.all_gather(list(out.chunk(_group_size(group))), inp, group=group)


# Tests set this to exercise the all_reduce + slice path that works on any backend.
FORCE_ALL_REDUCE = False


def _reduce_scatter(grad: torch.Tensor, rows: int, group) -> torch.Tensor:
    """This rank's `rows`-row block of the sum over the group of `grad` [world * rows, ...]."""
    rank = _group_rank(group)
    fn = getattr(dist, "reduce_scatter_single", None) or getattr(dist, "reduce_scatter_tensor", None)
    if fn is not None and not FORCE_ALL_REDUCE:
        out = grad.new_empty((rows,) + tuple(grad.shape[1:]))
        try:
            fn(out, grad, group=group)
            return out
        except (RuntimeError, NotImplementedError, ValueError):  # e.g. an older gloo: no reduce_scatter
            pass
    total = grad.clone()
    dist.all_reduce(total, group=group)
    return total[rank * rows: (rank + 1) * rows]


class AllGatherKV(torch.autograd.Function):
    """[n, ...] local rows -> [world * max_local, ...] rank-major gathered rows (each rank's block zero-padded to
    max_local). Backward: each rank receives the sum over the group of the gradients of its own rows."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, max_local: int, group: Any) -> torch.Tensor:  # noqa: D102
        world = _group_size(group)
        n = local.shape[0]
        if n > max_local:
            raise ValueError(f"local shard has {n} rows, more than the group's max_local={max_local}")
        ctx.group, ctx.n, ctx.max_local = group, n, max_local
        padded = local.contiguous()
        if n < max_local:
            padded = torch.cat([padded, padded.new_zeros((max_local - n,) + tuple(local.shape[1:]))])
        if world == 1:
            return padded.clone() if padded is local else padded
        out = local.new_empty((world * max_local,) + tuple(local.shape[1:]))
        _all_gather(out, padded, group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: D102
        grad = grad.contiguous()
        if _group_size(ctx.group) == 1:
            mine = grad
        else:
            mine = _reduce_scatter(grad, ctx.max_local, ctx.group)
        return mine[: ctx.n], None, None


def all_gather_kv(local: torch.Tensor, max_local: int, group: Any = None) -> torch.Tensor:
    """Differentiable padded all-gather (see AllGatherKV)."""
    return AllGatherKV.apply(local, int(max_local), group)


def _device_layout(shard, device: torch.device, causal: bool, window: tuple[int, int]):
    key = ("device_layout", str(device), bool(causal), int(window[0]), int(window[1]))
    hit = shard._cache.get(key)
    if hit is None:
        rows, cu_k, max_k = shard.key_layout(causal, window)
        hit = (
            torch.from_numpy(rows).to(device),
            torch.from_numpy(shard.cu_seqlens_q).to(device),
            torch.from_numpy(cu_k).to(device),
            max_k,
        )
        shard._cache[key] = hit
    return hit


def cp_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    shard: Any,
    group: Any = None,
    *,
    causal: bool = True,
    window: tuple[int, int] = (-1, -1),
    softmax_scale: float | None = None,
    return_lse: bool = False,
    backend: str | None = None,
):
    """Attention of this CP rank's queries over its documents' keys on every rank of `group`.

    `q [n, Hq, D]`, `k/v [n, Hkv, D]`: the rows of this rank's shard (`shard.token_index` order). `shard`: this
    rank's `CPRankShard` (its `rank` must be this process's rank in `group`, its `cp_size` the group's size).
    `group`: the CP process group (None: the default group; a single process without torch.distributed also works
    for cp_size 1). Returns `out [n, Hq, D]` (and the lse `[Hq, n]` with `return_lse`), differentiable in q, k, v.
    """
    world = 1 if shard.cp_size == 1 and group is None else _group_size(group)
    if shard.cp_size != world:
        raise ValueError(f"the shard is for CP size {shard.cp_size} but the process group has {world} ranks")
    if world > 1 and shard.rank != _group_rank(group):
        raise ValueError(f"the shard is CP rank {shard.rank}'s but this process is rank {_group_rank(group)} of the group")
    n = shard.num_tokens
    if q.shape[0] != n or k.shape[0] != n or v.shape[0] != n:
        raise ValueError(f"q/k/v have {q.shape[0]}/{k.shape[0]}/{v.shape[0]} rows; this rank's shard owns {n} tokens")
    window = (int(window[0]), int(window[1]))
    rows, cu_q, cu_k, max_k = _device_layout(shard, q.device, causal, window)
    dk = k.shape[-1]
    if world == 1:  # nothing to gather: the shard is the whole micro-batch
        k_sel, v_sel = k.index_select(0, rows), v.index_select(0, rows)
    elif k.shape[1:] == v.shape[1:]:
        kv = all_gather_kv(torch.cat([k, v], dim=-1), shard.max_local, group)
        sel = kv.index_select(0, rows)
        k_sel, v_sel = sel[..., :dk], sel[..., dk:]
        if q.is_cuda:  # the CUDA kernels want dense key/value rows
            k_sel, v_sel = k_sel.contiguous(), v_sel.contiguous()
    else:
        k_sel = all_gather_kv(k, shard.max_local, group).index_select(0, rows)
        v_sel = all_gather_kv(v, shard.max_local, group).index_select(0, rows)
    res = varlen_attention(q, k_sel, v_sel, cu_q, cu_k, shard.max_seqlen_q, max_k, causal=causal, window=window,
                           softmax_scale=softmax_scale, return_lse=return_lse, backend=backend)
    if world > 1 and n == 0:
        # a rank that owns no token of this micro-batch must still run the backward of the collectives its inputs
        # came through (the gathers here, a layout remap before them): tie its empty output to q, k and v with a zero
        anchor = q.sum() * 0 + k_sel.sum() * 0 + v_sel.sum() * 0
        res = (res[0] + anchor, res[1]) if return_lse else res + anchor
    return res
