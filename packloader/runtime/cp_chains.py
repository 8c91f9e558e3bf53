"""Per-document CP with slices: a dynamic-cp chain's slices (or the slices of a piece longer than the pool) run on
one CP subgroup in consecutive micro-batches, each attending to the earlier slices' keys.

The fixed-CP slice executor's mechanism, run per pool GPU: `DynamicCPExecutor` is a `SliceExecutor` whose contexts
(`DynamicCPContext`) run `dynamic_cp_attention`. A micro-batch whose slices later ones read keeps, per layer, those
slices' keys and values as its group all-gathered them (every GPU of the group holds the whole slice, in document
order) in the `SliceKVCache`; a later slice's runs read them as their first keys (`DynamicCPShard.run_prefix`), as
leaves whose gradients add up in the cache entry on each GPU. In the backward pass (reverse order) the earlier
micro-batch's backward runs with every GPU's accumulated gradient injected at the gathered rows; the gather's
reduce-scatter sums the GPUs' parts into the rows' owners, so each owner gets the whole gradient of its keys.

By default (`recompute=False`) the earlier micro-batch runs forward once and keeps its graph until then: what the
dynamic-cp planner's memory check charges a chain (its kept activations) and its simulated times assume (no extra
forward). `recompute=True` runs it forward without a graph first and recomputes it in the backward pass
(`SliceExecutor`'s default: one extra forward, activations of one micro-batch at a time).

Collectives must line up across the pool: a micro-batch deferred on one GPU runs its gathers' reduce-scatters in the
reverse pass (and, recomputed, its gathers twice), so the GPUs that share another group with it in that slot must
defer it too, whether or not they keep anything of it. Which slots are deferred is therefore agreed over the pool
(one all-reduce of a flag per micro-batch at the start of each step), in both modes: without it, a GPU that keeps
nothing in a slot would run that slot's backward at once and its reduce-scatter would meet its partners' next
gathers (the "4-nested" case of the tests hangs without the agreement).
"""

from __future__ import annotations

from typing import Any, Hashable, Sequence

import torch
import torch.distributed as dist

from packloader.collate.cp_document_shards import check_chains
from packloader.contracts import CPPlacement, MicroBatch, Segment
from packloader.runtime.cp_document_attention import dynamic_cp_attention
from packloader.runtime.groups import ProcessGroupCache, cp_pool_group
from packloader.runtime.slice_cache import SliceKVCache
from packloader.runtime.slices import SliceContext, SliceExecutor

__all__ = ["DynamicCPContext", "DynamicCPExecutor"]


class _Hooks:
    """One attention call's side of the cache (`cp_document_attention.ChainHooks`)."""

    def __init__(self, ctx: "DynamicCPContext", layer: Hashable) -> None:
        self.ctx, self.layer = ctx, layer
        self.wanted = ctx.store | ctx.inject

    def prefix(self, seg: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        ctx, s = self.ctx, self.ctx.segments[seg]
        ks, vs, pos = [], [], s.attend_from
        while pos < s.start:
            e = ctx.cache.find(self.layer, s.doc, pos) if ctx.cache is not None else None
            if e is None:
                raise RuntimeError(f"segment {seg} (document {s.doc}, tokens {s.start}..{s.end - 1}) attends from token "
                                   f"{s.attend_from}, but the keys of token {pos} at layer {self.layer!r} are not kept: "
                                   "run the document's earlier slices first, in earlier micro-batches of the same "
                                   "DynamicCPExecutor.run")
            hi = min(e.end, s.start)
            ck, cv = ctx._cached(e)
            ks.append(ck[pos - e.start:hi - e.start])
            vs.append(cv[pos - e.start:hi - e.start])
            pos = hi
        k, v = torch.cat(ks), torch.cat(vs)
        assert k.shape[0] == n
        return k, v

    def keep(self, seg: int, k: torch.Tensor, v: torch.Tensor) -> None:
        ctx, s = self.ctx, self.ctx.segments[seg]
        if seg in ctx.store:
            ctx.cache.put(self.layer, s.doc, s.start, s.end, k, v)  # type: ignore[union-attr]
        if seg in ctx.inject and ctx.cache is not None:
            ctx.inject_at(ctx.cache.entry(self.layer, s.doc, s.start, s.end), k, v)


class DynamicCPContext(SliceContext):
    """A `SliceContext` for one pool GPU's per-document CP micro-batch (`PackedBatch` with `.cp`): its attention is
    `dynamic_cp_attention` with the earlier slices' keys from the cache."""

    def __init__(self, batch: Any, cache: SliceKVCache | None, *, groups: ProcessGroupCache | None = None,
                 rank_map: Sequence[int] | None = None, **kw: Any) -> None:
        if getattr(batch, "cp", None) is None:
            raise ValueError(f"step {getattr(batch, 'step', None)}, micro-batch {getattr(batch, 'index_in_step', None)}"
                             " is not a per-document CP batch (PackedBatch.cp is None)")
        super().__init__(batch.segments, cache, **kw)
        self.shard, self.groups, self.rank_map = batch.cp, groups, rank_map

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: Hashable | None = None,
                  **kwargs: Any) -> torch.Tensor:
        """Causal attention of this GPU's rows (`dynamic_cp_attention`); `layer` as `SliceContext.attention`."""
        if layer is None:
            layer = self._calls
        self._calls += 1
        opts = dict(softmax_scale=self.softmax_scale, backend=self.backend)
        opts.update(kwargs)
        return dynamic_cp_attention(q, k, v, self.shard, self.groups, rank_map=self.rank_map,
                                    chain=_Hooks(self, layer), **opts)

    __call__ = attention

    def backward(self, loss: torch.Tensor) -> None:
        """As `SliceContext.backward`; a GPU with nothing to differentiate (an empty slot) has nothing to run."""
        inj = self.injections()
        if loss.requires_grad or any(t.requires_grad for t, _ in inj):
            if not loss.requires_grad:
                loss = loss + sum(t.sum() for t, _ in inj if t.requires_grad) * 0
            super().backward(loss)
        else:
            self._injections.clear()
            self.collect_prefix_grads()


def placements_of(batch: Any) -> MicroBatch:
    """The batch's segments with their CP placements, as the shard's groups hold them."""
    at: dict[int, CPPlacement] = {}
    for g in batch.cp.groups:
        for seg in g.segments.tolist():
            at[seg] = CPPlacement(g.size, g.first)
    segs: list[Segment] = list(batch.segments)
    return MicroBatch(segments=segs, cp=[at[i] for i in range(len(segs))])


class DynamicCPExecutor(SliceExecutor):
    """Runs one step's per-document CP micro-batches on one pool GPU, chains of slices included (module docstring).

    `run(batches, step_fn)` as `SliceExecutor.run`: `batches` are this GPU's micro-batches of the step in order
    (`PackedLoader(..., cp_rank=...)`'s, each with `.cp`), every GPU of the pool calls it for the same step; the
    model's attention calls `ctx.attention(q, k, v, layer)` on its local rows. `pool`: the GPUs of the DP x CP pool;
    `groups`/`rank_map` as `dynamic_cp_attention`; `recompute` as `SliceExecutor` but False by default (module
    docstring)."""

    def __init__(self, *, pool: int, groups: ProcessGroupCache | None = None, rank_map: Sequence[int] | None = None,
                 softmax_scale: float | None = None, backend: str | None = None, recompute: bool = False) -> None:
        super().__init__(softmax_scale=softmax_scale, backend=backend, recompute=recompute)
        self.opts = dict(softmax_scale=softmax_scale, backend=backend)
        self.pool, self.groups, self.rank_map = int(pool), groups, rank_map

    def _context(self, mb: Any, segs: list[Segment], **kw: Any) -> SliceContext:
        return DynamicCPContext(mb, self.cache, groups=self.groups, rank_map=self.rank_map, **kw, **self.opts)

    def _deferred(self, mbs: Sequence[Any], kept: list[frozenset[int]]) -> list[bool]:
        if not mbs:
            return []
        gpu = mbs[0].cp.gpu
        check_chains([placements_of(b) for b in mbs], gpu=gpu, step=getattr(mbs[0], "step", None))
        local = [bool(k) for k in kept]
        if self.pool == 1:
            return local
        pg = cp_pool_group(self.pool, 0, gpu=gpu, rank_map=self.rank_map, groups=self.groups)
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(pg) == "nccl" else None
        flags = torch.tensor(local, dtype=torch.int32, device=device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=pg)
        return [bool(f) for f in flags.tolist()]
