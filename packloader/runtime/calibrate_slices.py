"""Timing slices for calibration: a slice of q query tokens after p earlier keys, in one varlen launch beside
short documents (as a packed micro-batch runs it), forward and backward. Its time is the launch's with the slice
less the launch's without it, so what is measured is what the slice adds to a micro-batch, the quantity the
planners price. `packloader.balancers.cost.slice_fit.fit_slice_term` fits the result.

The launch is the runtime's own (`SliceContext.attention` with the prefix in a `SliceKVCache`, read as leaves
that take gradients): a micro-batch holding a slice copies its earlier keys/values in front of the slice's own
and concatenates its key buffer, forward, and splits the key gradients backward, and the slice's time includes
that. The launch without the slice holds a 1-token slice after 1 key, so that both pay the assembly of the
short documents' keys and the difference is the slice's: its attention and the copy of its q + p keys. (The
executor's accumulation of prefix gradients into the cache after backward is not timed.)"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from packloader.balancers.cost.slice_fit import SliceTimings
from packloader.contracts import Segment
from packloader.runtime.calibrate import LayerShape, _time_fwd_bwd, geometric_points
from packloader.runtime.slice_cache import SliceKVCache
from packloader.runtime.slices import SliceContext

MIN_SECONDS = 1e-9  # a slice lost in the launch's noise is recorded as this, not as a negative time
ASSEMBLE = (1, 1)  # (q, p) of the slice in the launch without the measured one: it makes the runtime assemble keys


def slice_grid(max_len: int, points: int = 5) -> tuple[list[int], list[int]]:
    """(q, p) pairs for calibrate: q spread geometrically up to half the context, p = 0 (whole documents, the
    reference) and a quarter and a half of the context, within the context (q + p <= max_len)."""
    qs = geometric_points(max(1, min(128, max_len // 8)), max(1, max_len // 2), points).tolist()
    pairs = [(q, p) for p in (0, max_len // 4, max_len // 2) for q in qs if q + p <= max_len]
    return [q for q, _ in pairs], [p for _, p in pairs]


def _launch(shape: LayerShape, q_lens: list[int], p_lens: list[int], *, device, dtype, backend, gen):
    """A run() for the timer: one attention call of the runtime's `SliceContext` over segments (one document
    each) with q_lens queries after p_lens earlier keys, those keys in its cache."""
    def rnd(n, h, grad=True):  # drawn on the device: a 128K-key slice is gigabytes, slow to draw on the CPU
        t = torch.randn(n, h, shape.head_dim, generator=gen, device=device, dtype=dtype)
        return t.requires_grad_() if grad else t

    segments = [Segment(doc=i, start=p, end=p + q, attend_from=0) for i, (q, p) in enumerate(zip(q_lens, p_lens))]
    cache = SliceKVCache()
    for s in segments:
        if s.start > 0:
            cache.put(0, s.doc, 0, s.start, rnd(s.start, shape.kv_heads, False), rnd(s.start, shape.kv_heads, False))
    tq = sum(q_lens)
    q, k, v = rnd(tq, shape.heads), rnd(tq, shape.kv_heads), rnd(tq, shape.kv_heads)
    g = rnd(tq, shape.heads, grad=False)

    def run():
        for t in (q, k, v):
            t.grad = None
        ctx = SliceContext(segments, cache, track_prefix=True, backend=backend)
        return [ctx.attention(q, k, v, layer=0)], [g]

    return run


def time_slices(shape: LayerShape, qs: Sequence[int], ps: Sequence[int], *, device: torch.device, dtype: torch.dtype,
                backend: str | None = None, filler_len: int = 512, filler_tokens: int = 16384, repeats: int = 5,
                warmup: int = 2, progress: Callable[[str], None] | None = None,
                stop: Callable[[], bool] | None = None) -> SliceTimings:
    """Seconds each (q[i], p[i]) slice adds to a launch of `filler_tokens // filler_len` documents of
    `filler_len` tokens (one layer's attention, forward and backward). `stop()` ends the sweep early (a time
    budget): the rows measured so far come back."""
    gen = torch.Generator(device=device).manual_seed(0)
    n_fill = max(1, filler_tokens // filler_len)
    fill_q, fill_p = [filler_len] * n_fill + [ASSEMBLE[0]], [0] * n_fill + [ASSEMBLE[1]]
    base_f, base_b = _time_fwd_bwd(_launch(shape, fill_q, fill_p, device=device, dtype=dtype, backend=backend, gen=gen),
                                   device, repeats, warmup)
    out_q, out_p, out_f, out_b = [], [], [], []
    for q, p in zip(qs, ps):
        if stop is not None and stop():
            break
        run = _launch(shape, fill_q + [int(q)], fill_p + [int(p)], device=device, dtype=dtype, backend=backend, gen=gen)
        f, b = _time_fwd_bwd(run, device, repeats, warmup)
        run = None
        out_q.append(int(q)), out_p.append(int(p))
        out_f.append(max(f - base_f, MIN_SECONDS)), out_b.append(max(b - base_b, MIN_SECONDS))
        if progress:
            progress(f"  slice q={q:>6d} p={p:>7d}  fwd {out_f[-1] * 1e6:11.2f} us  bwd {out_b[-1] * 1e6:11.2f} us")
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return SliceTimings(q=out_q, p=out_p, fwd=out_f, bwd=out_b, launch_segments=len(fill_q),
                        launch_tokens=sum(fill_q))
