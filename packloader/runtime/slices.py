"""Sliced execution (SlimPack): a slice of a long document attends to its document's earlier slices.

A plan may cut a document longer than a micro-batch into slices (`Segment.attend_from < Segment.start`): the
slice in micro-batch k attends to its own tokens and to the keys and values of the same document's earlier
slices, computed by earlier micro-batches of the same step on the same rank. Three pieces here:

* `SliceKVCache`: the keys and values of earlier slices, per (layer, document, token range), kept between
  micro-batches of a step, with a gradient accumulator each so that the later slices' gradients flow back to the
  earlier slices' computation.
* `SliceContext`: what a model's attention layer calls for one micro-batch (`ctx.attention(q, k, v, layer)`):
  it prepends each slice's cached prefix keys/values, runs `varlen_attention` with `cu_seqlens_k` counting the
  prefix (bottom-right causal alignment gives the right mask), and stores or receives what the executor asks.
* `SliceExecutor`: for trainers without a pipeline engine, runs a step's micro-batches (a chain of slices, mixed
  with whole documents) forward in order and backward in reverse (recomputing activations, or keeping them with
  `recompute=False`), and accumulates the gradients into the parameters' `.grad` exactly as if each sliced
  document had run whole.
  `require_no_slices(plan)` is the check for consumers that cannot run slices.

How the executor runs a step (micro-batches 0..n-1; micro-batch j is *kept* when a later micro-batch attends to
keys of one of its segments), with `recompute=True` (the default):

1. forward in order: a kept micro-batch runs under `torch.no_grad()` (its RNG state saved) and stores its kept
   segments' keys/values (detached copies) in the cache; a micro-batch that no later one needs runs forward with
   autograd and its backward at once. Whenever a micro-batch (in either pass) reads cached prefix keys/values
   with autograd on, it reads them as leaf tensors and adds their gradients to the cache entry's accumulators.
2. backward in reverse: each kept micro-batch, last first, is recomputed with autograd (RNG restored) and
   back-propagated with its loss *and* the accumulated gradients of its kept keys/values injected at the
   tensors that produced them (`torch.autograd.backward([loss, k_rows..., v_rows...], [1, gk..., gv...])`).
   By then every later micro-batch that read those keys has run its backward, so the accumulators are complete
   (reverse order is a topological order of the dependencies). Its cache entries are then freed.

Memory bound (argued, not measured): at any moment autograd holds the activations of one micro-batch only
(a kept micro-batch's first forward keeps none; the one running forward+backward or recompute+backward frees
them when its backward ends). Beyond that the executor holds, for the sliced documents only, the keys and values
of their earlier slices and their gradient accumulators: 2 x 2 x layers x prefix_tokens x kv_heads x head_dim
elements (SlimPack's KV cache, what its planner's memory model charges to slices), plus one saved RNG state per
kept micro-batch. The micro-batches' inputs (token ids) are the caller's. So peak activation memory is bounded
by the largest micro-batch, not by the whole document. The price is one extra forward of each kept micro-batch
(like full activation checkpointing of that micro-batch).

With `recompute=False` a kept micro-batch runs forward once, with autograd, storing its keys/values in the cache
as above and holding on to its loss and the key/value row tensors it stored; the reverse pass calls
`torch.autograd.backward([loss, k_rows..., v_rows...], [1, gk..., gv...])` on those, without a second forward.
Same gradients (up to summation order), one forward per micro-batch, but memory is no longer bounded by one
micro-batch: every kept micro-batch's activations (its whole autograd graph) stay alive from its forward until
its backward in the reverse pass, on top of the cache, e.g. all but the last slice of a chain at once. That is
what a planner whose memory check charges a chain's kept activations assumes (dynamic-cp's does).

Gradients are exact up to floating-point summation order, given (with recomputation) a deterministic forward
(the recomputation must reproduce the first forward: dropout is handled by restoring the RNG state;
nondeterministic kernels are not).
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable, Hashable, Iterable, Sequence

import numpy as np
import torch

from packloader.contracts import Segment
from packloader.runtime.scoped import scoped
from packloader.runtime.slice_cache import CacheEntry, SliceKVCache
from packloader.runtime.slice_check import SliceRef, SlicesNotSupported, find_slices, require_no_slices, segments_of

__all__ = [
    "SlicesNotSupported",
    "find_slices",
    "require_no_slices",
    "SliceKVCache",
    "SliceContext",
    "SliceExecutor",
    "current_slice_context",
]


_CURRENT: contextvars.ContextVar["SliceContext | None"] = contextvars.ContextVar("packloader_slice_context", default=None)


def current_slice_context() -> "SliceContext | None":
    """The SliceContext of the micro-batch the executor is running (None outside one), for attention layers that
    are not handed the context explicitly."""
    return _CURRENT.get()


class SliceContext:
    """Attention over one micro-batch's segments, with the earlier slices' keys/values from a cache.

    `segments` are the micro-batch's segments in packed order (q/k/v rows follow them). `store` names the
    segments (indices) whose keys/values to put in the cache; `inject` the segments whose keys/values receive the
    cache's accumulated gradients (recomputation); with `track_prefix` the cached prefixes are read as leaves
    whose gradients go to the cache's accumulators after backward (`collect_prefix_grads`). Without a cache a
    slice may only attend to earlier segments of the same micro-batch.
    """

    def __init__(self, segments: Sequence[Segment], cache: SliceKVCache | None = None, *, store: Iterable[int] = (),
                 inject: Iterable[int] = (), track_prefix: bool = False, causal: bool = True,
                 window: tuple[int, int] = (-1, -1), softmax_scale: float | None = None,
                 backend: str | None = None) -> None:
        self.segments = list(segments)
        self.cache = cache
        self.store = frozenset(store)
        self.inject = frozenset(inject)
        self.track_prefix = track_prefix
        self.causal, self.window, self.softmax_scale, self.backend = causal, window, softmax_scale, backend
        q_len = np.array([s.end - s.start for s in self.segments], dtype=np.int64)
        self._offsets = np.concatenate([[0], np.cumsum(q_len)]).astype(np.int64)
        self._cu_q_np = self._offsets.astype(np.int32)
        self._max_q = int(q_len.max()) if len(q_len) else 0
        self._calls = 0
        self._leaves: dict[int, tuple[CacheEntry, torch.Tensor, torch.Tensor]] = {}
        self._injections: list[tuple[torch.Tensor, torch.Tensor, CacheEntry]] = []
        self._cu: dict[tuple, torch.Tensor] = {}

    @property
    def num_tokens(self) -> int:
        return int(self._offsets[-1])

    def _cu_tensor(self, arr: np.ndarray, device: torch.device) -> torch.Tensor:
        key = (arr.tobytes(), str(device))
        t = self._cu.get(key)
        if t is None:
            t = self._cu[key] = torch.as_tensor(arr, dtype=torch.int32, device=device)
        return t

    def _cached(self, e: CacheEntry) -> tuple[torch.Tensor, torch.Tensor]:
        if not (self.track_prefix and torch.is_grad_enabled()):
            return e.k, e.v
        got = self._leaves.get(id(e))
        if got is None:
            got = self._leaves[id(e)] = (e, e.k.detach().requires_grad_(), e.v.detach().requires_grad_())
        return got[1], got[2]

    def _prefix(self, layer: Hashable, i: int, k: Sequence[torch.Tensor], v: Sequence[torch.Tensor]):
        """Keys/values of segment i's tokens attend_from..start-1: earlier segments of this micro-batch first
        (`k`, `v`: the micro-batch's keys split per segment), then the cache."""
        s = self.segments[i]
        ks, vs = [], []
        pos = s.attend_from
        while pos < s.start:
            src = None
            for j in range(i):  # an earlier segment of the same document in this micro-batch
                t = self.segments[j]
                if t.doc == s.doc and t.start <= pos < t.end:
                    hi = min(t.end, s.start)
                    src = (k[j][pos - t.start : hi - t.start], v[j][pos - t.start : hi - t.start], hi)
                    break
            if src is None and self.cache is not None:
                e = self.cache.find(layer, s.doc, pos)
                if e is not None:
                    hi = min(e.end, s.start)
                    ck, cv = self._cached(e)
                    src = (ck[pos - e.start : hi - e.start], cv[pos - e.start : hi - e.start], hi)
            if src is None:
                raise RuntimeError(
                    f"segment {i} (document {s.doc}, tokens {s.start}..{s.end - 1}) attends from token "
                    f"{s.attend_from}, but the keys of token {pos} at layer {layer!r} are neither in this micro-batch "
                    f"nor in the slice KV cache: run the document's earlier slices first, in earlier micro-batches "
                    f"of the same SliceExecutor.run"
                )
            ks.append(src[0])
            vs.append(src[1])
            pos = src[2]
        return ks, vs

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: Hashable | None = None,
                  **kwargs: Any) -> torch.Tensor:
        """Causal varlen attention of this micro-batch: q [T, Hq, D], k/v [T, Hkv, D] in packed order.

        `layer` identifies the layer for the cache (any hashable); None numbers the calls of this micro-batch
        in order (the same model gives the same numbering on every micro-batch). Extra keyword arguments go to
        varlen_attention (they override the context's causal/window/softmax_scale/backend).
        """
        from packloader.runtime.attention import varlen_attention

        if layer is None:
            layer = self._calls
        self._calls += 1
        if q.shape[0] != self.num_tokens or k.shape[0] != self.num_tokens:
            raise ValueError(f"q/k hold {q.shape[0]}/{k.shape[0]} tokens, the micro-batch's segments {self.num_tokens}")
        has_prefix = [i for i, s in enumerate(self.segments) if s.attend_from < s.start]
        if has_prefix or self.store or self.inject:
            # one split per tensor: its backward is one concatenation of the pieces' gradients. Indexing k[lo:hi]
            # per segment instead makes every piece's backward a zero-filled tensor of all T rows, summed: memory
            # traffic of segments x T per layer, 12-18 ns per (segment, token) and layer on an H200, 20-28 ms
            # backward for 49 segments of 25K tokens (docs/benchmarks.md, "The small end of the cost model").
            sizes = np.diff(self._offsets).tolist()
            k_seg, v_seg = k.split(sizes), v.split(sizes)
        if has_prefix:
            k_parts, v_parts, k_len = [], [], []
            for i, s in enumerate(self.segments):
                pk, pv = self._prefix(layer, i, k_seg, v_seg) if s.attend_from < s.start else ([], [])
                k_parts += pk + [k_seg[i]]
                v_parts += pv + [v_seg[i]]
                k_len.append(int(k_seg[i].shape[0]) + sum(int(t.shape[0]) for t in pk))
            kk, vv = torch.cat(k_parts), torch.cat(v_parts)
            k_len_np = np.array(k_len, dtype=np.int64)
            cu_k_np = np.concatenate([[0], np.cumsum(k_len_np)]).astype(np.int32)
            max_k = int(k_len_np.max())
        else:
            kk, vv, cu_k_np, max_k = k, v, self._cu_q_np, self._max_q
        opts = dict(causal=self.causal, window=self.window, softmax_scale=self.softmax_scale, backend=self.backend)
        opts.update(kwargs)
        cu_q = self._cu_tensor(self._cu_q_np, q.device)
        cu_k = cu_q if cu_k_np is self._cu_q_np else self._cu_tensor(cu_k_np, q.device)
        out = varlen_attention(q, kk, vv, cu_q, cu_k, self._max_q, max_k, **opts)
        for i in sorted(self.store | self.inject):
            s = self.segments[i]
            if i in self.store:
                if self.cache is None:
                    raise RuntimeError("SliceContext(store=...) needs a cache")
                self.cache.put(layer, s.doc, s.start, s.end, k_seg[i], v_seg[i])
            if i in self.inject and self.cache is not None:
                self.inject_at(self.cache.entry(layer, s.doc, s.start, s.end), k_seg[i], v_seg[i])
        return out

    __call__ = attention

    def inject_at(self, e: CacheEntry | None, k: torch.Tensor, v: torch.Tensor) -> None:
        """Let `backward` inject cache entry `e`'s accumulated gradients at the rows `k`/`v` that produced its keys
        (read when `backward` runs: without recomputation the later micro-batches have not run theirs yet)."""
        if e is not None:
            self._injections.append((k, v, e))

    def injections(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(rows, gradient) pairs to inject now: each kept key/value row block with its accumulated gradient."""
        out = []
        for k, v, e in self._injections:
            out += [(t, g) for t, g in ((k, e.gk), (v, e.gv)) if g is not None]
        return out

    def backward(self, loss: torch.Tensor) -> None:
        """Back-propagate `loss` plus the injected key/value gradients, then hand the prefix leaves' gradients to
        the cache."""
        inj = self.injections()
        tensors = [loss] + [t for t, _ in inj]
        grads = [torch.ones_like(loss)] + [g.to(t.dtype) for t, g in inj]
        torch.autograd.backward(tensors, grads)
        self._injections.clear()
        self.collect_prefix_grads()

    def collect_prefix_grads(self) -> None:
        for e, kl, vl in self._leaves.values():
            e.add_grad(kl.grad, vl.grad)
        self._leaves.clear()

    def active(self):
        """Make this the `current_slice_context()` inside the block."""
        return scoped(_CURRENT, self)


# --------------------------------------------------------------------------------------------- executor


def _rng_state() -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


@contextlib.contextmanager
def _restored_rng(state):
    cpu, cuda = state
    devices = list(range(len(cuda))) if cuda is not None else []
    with torch.random.fork_rng(devices=devices):
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        yield


def analyse_chain(micro_batches: Sequence[Any], *, step: int | None = None,
                  rank: int | None = None) -> list[frozenset[int]]:
    """Check that every slice's prefix comes from earlier micro-batches (or earlier segments of its own) and
    return, per micro-batch, the indices of its segments whose keys later micro-batches read."""
    segs = [segments_of(mb) for mb in micro_batches]
    kept: list[set[int]] = [set() for _ in segs]
    for m, ss in enumerate(segs):
        for i, s in enumerate(ss):
            if s.attend_from >= s.start:
                continue
            covered = np.zeros(s.start - s.attend_from, dtype=bool)
            for j in range(m + 1):
                for t_i, t in enumerate(segs[j]):
                    if j == m and t_i >= i:
                        break
                    if t.doc != s.doc:
                        continue
                    lo, hi = max(t.start, s.attend_from), min(t.end, s.start)
                    if lo < hi:
                        covered[lo - s.attend_from : hi - s.attend_from] = True
                        if j < m:
                            kept[j].add(t_i)
            if not covered.all():
                ref = SliceRef(step if step is not None else getattr(micro_batches[m], "step", None), rank,
                               getattr(micro_batches[m], "index_in_step", m), s)
                miss = int(np.argmin(covered)) + s.attend_from
                raise ValueError(f"{ref.describe()}, but token {miss} of the document is in no earlier micro-batch "
                                 f"of this chain: a slice's earlier slices must run first, on the same rank")
    return [frozenset(k) for k in kept]


class SliceExecutor:
    """Runs one step's micro-batches on one rank, slices included, for trainers without a pipeline engine.

    `run(micro_batches, step_fn)`: `step_fn(mb, ctx)` runs the model on micro-batch `mb` and returns its scalar
    loss (already scaled as the trainer wants it summed over micro-batches, e.g. divided by the step's loss
    tokens); every attention layer of the model calls `ctx.attention(q, k, v, layer)` (or finds the context with
    `current_slice_context()`). Parameter gradients accumulate into `.grad` as with a plain loop of
    `loss.backward()`; call the optimizer after `run`. Returns the detached losses in micro-batch order.

    `recompute` (module docstring): True recomputes each kept micro-batch in the backward pass (one extra forward,
    activations of one micro-batch at a time); False keeps its graph until then (one forward, every kept
    micro-batch's activations alive until its backward).

    With `supports_slices=False` the executor is a plain loop that refuses sliced micro-batches with the step,
    rank and document named (for trainers that want the check without the machinery).
    """

    def __init__(self, *, supports_slices: bool = True, causal: bool = True, window: tuple[int, int] = (-1, -1),
                 softmax_scale: float | None = None, backend: str | None = None, rank: int | None = None,
                 recompute: bool = True) -> None:
        self.supports_slices = supports_slices
        self.opts = dict(causal=causal, window=window, softmax_scale=softmax_scale, backend=backend)
        self.rank = rank
        self.recompute = recompute
        self.cache = SliceKVCache()

    def _rank(self) -> int | None:
        if self.rank is not None:
            return self.rank
        import torch.distributed as dist

        return dist.get_rank() if dist.is_available() and dist.is_initialized() else None

    def _deferred(self, mbs: Sequence[Any], kept: list[frozenset[int]]) -> list[bool]:
        """Which micro-batches run their backward in the reverse pass (recomputed first, with `recompute`): those
        whose keys later ones read (`cp_chains.DynamicCPExecutor`: in any of the pool's GPUs)."""
        return [bool(k) for k in kept]

    def _context(self, mb: Any, segs: list[Segment], **kw: Any) -> SliceContext:
        return SliceContext(segs, self.cache, **kw, **self.opts)

    def run(self, micro_batches: Sequence[Any], step_fn: Callable[[Any, SliceContext], torch.Tensor], *,
            step: int | None = None) -> list[torch.Tensor]:
        mbs = list(micro_batches)
        rank = self._rank()
        if not self.supports_slices:
            require_no_slices(mbs, consumer="this SliceExecutor (supports_slices=False)", step=step, rank=rank)
        kept = analyse_chain(mbs, step=step, rank=rank)
        deferred = self._deferred(mbs, kept)
        self.cache.clear()
        losses: list[torch.Tensor | None] = [None] * len(mbs)
        held: dict[int, Any] = {}  # deferred micro-batch -> its RNG state (recompute) or (context, loss) (kept graph)
        try:
            for j, mb in enumerate(mbs):
                losses[j] = self._forward(j, mb, kept[j], deferred[j], step_fn, held)
            for j in reversed(range(len(mbs))):
                if deferred[j]:
                    self._backward(j, mbs[j], kept[j], step_fn, held.pop(j))
        finally:
            self.cache.clear()
        return losses  # type: ignore[return-value]

    def _forward(self, j: int, mb: Any, kept: frozenset[int], deferred: bool, step_fn: Callable, held: dict) -> torch.Tensor:
        segs = segments_of(mb)
        if deferred and self.recompute:  # later micro-batches read its keys: forward without a graph, recompute later
            held[j] = _rng_state()
            ctx = self._context(mb, segs, store=kept)
            with torch.no_grad(), ctx.active():
                return step_fn(mb, ctx).detach()
        # with its graph: backward now, or (kept, recompute=False) in the reverse pass with its keys' gradients
        keep = kept if deferred else frozenset()
        ctx = self._context(mb, segs, store=keep, inject=keep, track_prefix=True)
        with ctx.active():
            loss = step_fn(mb, ctx)
        if deferred:
            held[j] = (ctx, loss)
        else:
            ctx.backward(loss)
        return loss.detach()

    def _backward(self, j: int, mb: Any, kept: frozenset[int], step_fn: Callable, held: Any) -> None:
        """Micro-batch j's backward, every later reader of its keys having run its own (the accumulators are
        complete); then its cache entries are freed."""
        segs = segments_of(mb)
        if self.recompute:
            ctx = self._context(mb, segs, inject=kept, track_prefix=True)
            with _restored_rng(held), ctx.active():
                loss = step_fn(mb, ctx)
        else:
            ctx, loss = held
        ctx.backward(loss)
        for i in kept:
            self.cache.drop(segs[i].doc, segs[i].start, segs[i].end)
