"""Timing slices for calibration: a slice of q query tokens after p earlier keys, in one varlen launch beside
short documents (as a packed micro-batch runs it), forward and backward. Its time is the launch's with the slice
less the launch's without it, so what is measured is what the slice adds to a micro-batch, the quantity the
planners price. `packloader.balancers.cost.slice_fit.fit_slice_term` fits the result."""

from __future__ import annotations

from itertools import accumulate
from typing import Callable, Sequence

import torch

from packloader.balancers.cost.slice_fit import SliceTimings
from packloader.runtime.calibrate import LayerShape, _time_fwd_bwd, geometric_points

MIN_SECONDS = 1e-9  # a slice lost in the launch's noise is recorded as this, not as a negative time


def slice_grid(max_len: int, points: int = 5) -> tuple[list[int], list[int]]:
    """(q, p) pairs for calibrate: q spread geometrically up to half the context, p = 0 (whole documents, the
    reference) and a quarter and a half of the context, within the context (q + p <= max_len)."""
    qs = geometric_points(max(1, min(128, max_len // 8)), max(1, max_len // 2), points).tolist()
    pairs = [(q, p) for p in (0, max_len // 4, max_len // 2) for q in qs if q + p <= max_len]
    return [q for q, _ in pairs], [p for _, p in pairs]


def _launch(shape: LayerShape, q_lens: list[int], p_lens: list[int], *, device, dtype, backend, gen):
    """A run() for the timer: one varlen_attention call of segments with q_lens queries after p_lens keys."""
    from packloader.runtime.attention import varlen_attention

    def rnd(n, h, grad=True):  # drawn on the device: a 128K-key slice is gigabytes, slow to draw on the CPU
        t = torch.randn(n, h, shape.head_dim, generator=gen, device=device, dtype=dtype)
        return t.requires_grad_() if grad else t

    k_lens = [a + b for a, b in zip(q_lens, p_lens)]
    cu_q = torch.tensor(list(accumulate(q_lens, initial=0)), dtype=torch.int32, device=device)
    cu_k = torch.tensor(list(accumulate(k_lens, initial=0)), dtype=torch.int32, device=device)
    mq, mk = max(q_lens), max(k_lens)
    tq, tk = sum(q_lens), sum(k_lens)
    q, k, v = rnd(tq, shape.heads), rnd(tk, shape.kv_heads), rnd(tk, shape.kv_heads)
    g = rnd(tq, shape.heads, grad=False)

    def run():
        for t in (q, k, v):
            t.grad = None
        return [varlen_attention(q, k, v, cu_q, cu_k, mq, mk, causal=True, backend=backend)], [g]

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
    fill_q, fill_p = [filler_len] * n_fill, [0] * n_fill
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
    return SliceTimings(q=out_q, p=out_p, fwd=out_f, bwd=out_b)
