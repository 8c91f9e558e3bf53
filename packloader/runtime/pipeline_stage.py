"""The pipeline stage that runs a packloader step's micro-batches, slices included: carried keys and values
between a document's slices on one stage, the slice context per micro-batch, and receive buffers sized per
micro-batch (see `pipeline.py` for the schedule and how it matches the simulator)."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Iterable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage

from packloader.contracts import MicroBatch, Segment
from packloader.runtime.slice_cache import CacheEntry, SliceKVCache
from packloader.runtime.slices import SliceContext


class CarriedKVCache(SliceKVCache):
    """A stage's keys/values of earlier slices. Stored as views of the storing micro-batch's own key/value
    tensors, which its forward keeps alive until its backward anyway; only the gradient accumulators are new
    memory. `kv_nbytes`/`grad_nbytes` split what `nbytes` counts."""

    @staticmethod
    def _keep(t: torch.Tensor) -> torch.Tensor:
        return t.detach()

    def kv_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for es in self._store.values() for e in es for t in (e.k, e.v))

    def grad_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for es in self._store.values() for e in es for t in (e.gk, e.gv)
                   if t is not None)


class _AddCarriedGrad(torch.autograd.Function):
    """Identity on a micro-batch's keys and values; its backward adds the gradients later slices accumulated
    for the rows they read (complete by then: the readers' backwards ran first)."""

    @staticmethod
    def forward(ctx, k, v, spans):  # noqa: D401 - autograd API
        ctx.spans = spans
        return k.view_as(k), v.view_as(v)

    @staticmethod
    def backward(ctx, gk, gv):
        spans = ctx.spans
        if any(e.gk is not None for _, _, e in spans):
            gk = gk.clone()
            for lo, hi, e in spans:
                if e.gk is not None:
                    gk[lo:hi] += e.gk.to(gk.dtype)
        if any(e.gv is not None for _, _, e in spans):
            gv = gv.clone()
            for lo, hi, e in spans:
                if e.gv is not None:
                    gv[lo:hi] += e.gv.to(gv.dtype)
        return gk, gv, None


class PipelineSliceContext(SliceContext):
    """The SliceContext of one micro-batch on one pipeline stage: stores the segments later micro-batches read
    (views, with a gradient tap), reads cached prefixes as leaves whose gradients go to the cache."""

    def __init__(self, segments: Sequence[Segment], cache: CarriedKVCache, *, store: Iterable[int] = (), **opts: Any):
        super().__init__(segments, cache, track_prefix=True, **opts)
        self._carry = frozenset(store)

    def _cached(self, e: CacheEntry) -> tuple[torch.Tensor, torch.Tensor]:
        if not torch.is_grad_enabled():
            return e.k, e.v
        got = self._leaves.get(id(e))
        if got is None:
            kl, vl = e.k.detach().requires_grad_(), e.v.detach().requires_grad_()
            kl.register_post_accumulate_grad_hook(lambda t, e=e: _hand_over(t, e, True))
            vl.register_post_accumulate_grad_hook(lambda t, e=e: _hand_over(t, e, False))
            got = self._leaves[id(e)] = (e, kl, vl)
        return got[1], got[2]

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: Hashable | None = None,
                  **kwargs: Any) -> torch.Tensor:
        if layer is None:
            layer = self._calls
        if self.num_tokens == 0 and q.shape[0] == 0:  # an empty micro-batch (a planner's padding): keep the graph
            self._calls += 1
            return q.new_zeros((0, q.shape[1], v.shape[-1])) + 0 * (q.sum() + k.sum() + v.sum())
        if self._carry:
            spans = []
            for i in sorted(self._carry):
                s = self.segments[i]
                lo, hi = int(self._offsets[i]), int(self._offsets[i + 1])
                e = self.cache.put(layer, s.doc, s.start, s.end, k[lo:hi], v[lo:hi])
                spans.append((lo, hi, e))
            if torch.is_grad_enabled() and (k.requires_grad or v.requires_grad):
                k, v = _AddCarriedGrad.apply(k, v, spans)
        return super().attention(q, k, v, layer, **kwargs)


def _hand_over(t: torch.Tensor, e: CacheEntry, is_k: bool) -> None:
    if t.grad is not None:
        e.add_grad(t.grad, None) if is_k else e.add_grad(None, t.grad)
        t.grad = None


class _MergedContext:
    """Attention of a DP-Merge micro-batch: this rank's CP shard, over the micro-batch's group."""

    def __init__(self, mb: MicroBatch, shard: Any, attend: Callable[..., torch.Tensor], opts: dict) -> None:
        self.segments = list(mb.segments)
        self.shard = shard
        self._attend = attend
        self._opts = {k: v for k, v in opts.items() if v is not None}

    @property
    def num_tokens(self) -> int:
        return self.shard.num_tokens

    def attention(self, q, k, v, layer=None, **kwargs):
        opts = dict(self._opts)
        opts.update(kwargs)
        return self._attend(q, k, v, **opts)

    __call__ = attention

    def active(self):
        return SliceContext.active(self)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------------ stage


@dataclass
class KVSample:
    """Bytes a stage's KV cache holds right after one of its compute actions."""

    action: tuple[str, int, int]  # ("F" or "B", micro-batch, model chunk)
    kv_bytes: int  # carried keys/values (views of tensors the forward holds anyway)
    grad_bytes: int  # their gradient accumulators


@dataclass
class _StepInfo:
    micro_batches: list[MicroBatch]
    tokens: list[int]
    kept: list[frozenset[int]]
    readers: dict[int, set[int]]  # micro-batch -> later micro-batches that read its keys
    shards: dict[int, Any] = field(default_factory=dict)


class SlicedPipelineStage(PipelineStage):
    """A `PipelineStage` that runs packloader micro-batches: variable token counts per micro-batch, the slice
    KV carry of its own layers, and the micro-batch's attention context active while its module runs.

    `input_example` / `output_example`: one tensor (or tuple) per stage input/output with the right dtype and
    trailing dimensions; their token dimension (`token_dim`) is replaced by each micro-batch's token count.
    The first stage's inputs are the caller's (`arg_mbs`), so its `input_example` only fixes their number.
    Attention options (causal, window, softmax_scale, backend) go to every micro-batch's context.
    """

    def __init__(self, submodule: torch.nn.Module, stage_index: int, num_stages: int, device: torch.device | str, *,
                 input_example: torch.Tensor | tuple[torch.Tensor, ...],
                 output_example: torch.Tensor | tuple[torch.Tensor, ...],
                 group: dist.ProcessGroup | None = None, token_dim: int = 0, causal: bool = True,
                 window: tuple[int, int] = (-1, -1), softmax_scale: float | None = None,
                 backend: str | None = None) -> None:
        dev = torch.device(device)
        ins = input_example if isinstance(input_example, tuple) else (input_example,)
        outs = output_example if isinstance(output_example, tuple) else (output_example,)
        if stage_index > 0:  # received activations are leaves that need gradients; outputs send gradients back
            ins = tuple(t.detach().requires_grad_(t.is_floating_point()) for t in ins)
        outs = tuple(t.detach().requires_grad_(t.is_floating_point()) for t in outs)
        super().__init__(submodule, stage_index, num_stages, dev, input_args=ins, output_args=outs, group=group)
        self._in_examples = ins
        self._out_examples = outs
        self.token_dim = token_dim
        self.attention_options = dict(causal=causal, window=window, softmax_scale=softmax_scale, backend=backend)
        self.cache = CarriedKVCache()
        self.chunk = 0  # model chunk (set by the schedule: stage_index // pp)
        self.kv_trace: list[KVSample] = []
        self.order: list[tuple[str, int, int]] | None = None  # the rank's executed order (shared by its stages)
        self.executed: list[list] | None = None  # the same as [op, micro_batch, stage index] (the written form)
        self._step: _StepInfo | None = None
        self._contexts: dict[int, Any] = {}
        self._backwarded: set[int] = set()
        self._dp_merge: Callable[[MicroBatch, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    # -- per step --------------------------------------------------------------------------------------

    def _shape(self, t: torch.Tensor, n: int) -> tuple[int, ...]:
        shape = list(t.shape)
        if not shape:
            raise ValueError(f"stage {self.stage_index}: a 0-d example tensor has no token dimension")
        shape[self.token_dim] = n
        return tuple(shape)

    def size_buffers(self, tokens: Sequence[int]) -> None:
        """Give micro-batch j's activation and gradient receive buffers tokens[j] tokens (called per step,
        after the engine has built its buffers from the examples)."""
        m = len(tokens)
        self.chunks = m
        if self.args_recv_info:
            proto = self.args_recv_info[0]
            for j in range(m):
                infos = self.args_recv_info.get(j) or tuple(copy.copy(i) for i in proto)
                if len(infos) != len(self._in_examples):
                    raise RuntimeError(f"stage {self.stage_index}: {len(infos)} receive infos for "
                                       f"{len(self._in_examples)} input examples")
                for info, ex in zip(infos, self._in_examples):
                    if not info.is_root_arg:
                        info.buffer = torch.empty(self._shape(ex, tokens[j]), dtype=ex.dtype, device=self.device)
                self.args_recv_info[j] = infos
            for j in [j for j in self.args_recv_info if j >= m]:
                del self.args_recv_info[j]
        if self.has_backward and not self.is_last and self.grad_recv_info:
            proto = self.grad_recv_info[0]
            for j in range(m):
                infos = self.grad_recv_info.get(j) or tuple(copy.copy(i) for i in proto)
                for info, ex in zip(infos, self._out_examples):
                    if info.buffer is not None:
                        info.buffer = torch.empty(self._shape(ex, tokens[j]), dtype=ex.dtype, device=self.device)
                self.grad_recv_info[j] = infos
            for j in [j for j in self.grad_recv_info if j >= m]:
                del self.grad_recv_info[j]

    def begin_step(self, info: _StepInfo) -> None:
        if len(self.cache):
            raise RuntimeError(f"stage {self.stage_index}: the KV cache still holds {len(self.cache)} entries from "
                               f"the previous step")
        self._step = info
        self._contexts.clear()
        self._backwarded.clear()
        self.kv_trace = []

    def _context(self, j: int):
        ctx = self._contexts.get(j)
        if ctx is None:
            st = self._step
            if st is None:
                raise RuntimeError("SlicedPipelineStage runs under PlanPipelineSchedule.step_plan, which sets the "
                                   "step's micro-batches")
            mb = st.micro_batches[j]
            if j in st.shards:
                attend = self._dp_merge
                shard = st.shards[j]

                def merged(q, k, v, mb=mb, shard=shard, **kw):
                    return attend(mb, q, k, v, shard=shard, **kw)

                ctx = _MergedContext(mb, shard, merged, self.attention_options)
            else:
                ctx = PipelineSliceContext(mb.segments, self.cache, store=st.kept[j], **self.attention_options)
            self._contexts[j] = ctx
        return ctx

    def _sample(self, kind: str, j: int) -> None:
        self.kv_trace.append(KVSample((kind, j, self.chunk), self.cache.kv_nbytes(), self.cache.grad_nbytes()))
        if self.order is not None:
            self.order.append((kind, j, self.chunk))
        if self.executed is not None:
            self.executed.append([kind, j, self.stage_index])

    # -- the engine's calls ----------------------------------------------------------------------------

    def forward_one_chunk(self, fwd_chunk_id: int, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None,
                          save_forward_output: bool = True):
        ctx = self._context(fwd_chunk_id)
        with SliceContext.active(ctx):  # type: ignore[arg-type]
            out = super().forward_one_chunk(fwd_chunk_id, args, kwargs, save_forward_output)
        if isinstance(ctx, PipelineSliceContext) and ctx._calls == 0 and self._step.kept[fwd_chunk_id]:
            raise RuntimeError(f"stage {self.stage_index}: micro-batch {fwd_chunk_id} holds keys later slices read, "
                               f"but the stage module never called current_slice_context().attention")
        self._sample("F", fwd_chunk_id)
        return out

    def backward_one_chunk(self, bwd_chunk_id: int, loss=None, full_backward: bool = True, last_backward=False):
        """A whole backward ("B"), or with `full_backward=False` the input gradient alone (a "B" with a "W"
        of the same micro-batch): the engine differentiates the stage inputs only, so the keys and values this
        micro-batch read from earlier slices are added as inputs and their gradients handed to the cache, where
        the earlier slices' input gradients pick them up. On the first stage the engine defers the whole
        backward to W (no input gradient to send), and so does the cache."""
        deferred = not full_backward and self.is_first
        if not deferred:
            self._check_readers(bwd_chunk_id)
        ctx = self._contexts.get(bwd_chunk_id)
        leaves = list(ctx._leaves.values()) if not full_backward and not self.is_first and \
            isinstance(ctx, PipelineSliceContext) else []
        if leaves:
            out, inputs = self.fwd_cache[bwd_chunk_id]
            self.fwd_cache[bwd_chunk_id] = (out, list(inputs) + [t for _, kl, vl in leaves for t in (kl, vl)])
        super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward, last_backward=last_backward)
        for e, kl, vl in leaves:
            _hand_over(kl, e, True)
            _hand_over(vl, e, False)
        if not deferred:
            self._backwarded.add(bwd_chunk_id)
        if full_backward:
            self._finish(bwd_chunk_id)
        self._sample("B", bwd_chunk_id)

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward=False):
        """The weight gradient ("W"); the micro-batch's carried keys, values and their gradients are freed
        after it (the simulator's ZB-H1 memory rule)."""
        if self.is_first:
            self._check_readers(bwd_chunk_id)
        super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)
        self._backwarded.add(bwd_chunk_id)
        self._finish(bwd_chunk_id)
        self._sample("W", bwd_chunk_id)

    def _check_readers(self, j: int) -> None:
        st = self._step
        missing = (st.readers.get(j, set()) - self._backwarded) if st is not None else set()
        if missing:
            raise RuntimeError(
                f"stage {self.stage_index}: backward of micro-batch {j} before that of micro-batch(es) "
                f"{sorted(missing)}, which read its keys: their key/value gradients are not ready (a sliced "
                f"document's micro-batches go backward last slice first)")

    def _finish(self, j: int) -> None:
        """Drop a micro-batch's context and the cache entries it stored (its backward is complete)."""
        st = self._step
        ctx = self._contexts.pop(j, None)
        if st is not None and isinstance(ctx, PipelineSliceContext):
            ctx._leaves.clear()
            for i in st.kept[j]:
                s = st.micro_batches[j].segments[i]
                self.cache.drop(s.doc, s.start, s.end)
