"""Calibration: time attention and the linear part of a Llama layer on this device and fit a `CostProfile`.

What is measured (one layer of the given shape, then scaled to a pipeline stage):

* attention, forward and backward, through `varlen_attention` (the fastest backend for the device and dtype:
  flash-attn or PyTorch's varlen kernel on CUDA, the reference on CPU), for document lengths spread
  geometrically from 64 tokens to the context length. Each measurement packs `max_len // l` documents of
  length l into one call (what a packed micro-batch does) and divides by their number, so a short document's
  time is its share of a packed call, not a kernel launch;
* the linear part per micro-batch at several token counts: the Llama layer of `llama_layer` (RMSNorm, fused QKV
  projection, rope on q and k, O projection, RMSNorm, SwiGLU MLP, residual adds) with its attention call passing
  the queries through, forward and backward (weight and input gradients), plus the LM head's GEMM spread over
  the pipeline stages when the vocabulary is known. Attention is timed on its own contiguous q/k/v: what the
  layer hands it is q and k fresh from rope (contiguous) and v a view of the fused projection, which the CUDA
  kernels read in place (they need only the last dimension contiguous), so the layout costs nothing there.

Timing: warmup runs, then the median of several repeats; on CUDA with events after `torch.cuda.synchronize`.

The fit (`fit_profile`), the form of the shipped H100 profile: attention per document `a*l^2 + b*l + c` per
pass, by least squares with non-negative coefficients and residuals relative to the time
(`packloader.balancers.cost.fit_poly`), lengths rounded up to the tile first, as the cost model evaluates them;
the linear part as the measured table (`contracts.LinTable`: floor, interpolation, per-token rate past the
largest count) with a per-token rate plus floor summarising it for the planners. The tile is the candidate (1, 16, 32, 64, 128, 256 unless given) whose
fit is best. Every other measured length is held out of the fit (the shortest and longest stay in) and the fit's
mean absolute percentage error on those is reported in the profile's `fit_error` (`<part>_heldout_mape_pct`)
next to the in-sample largest relative error (`<part>`, a fraction).
"""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import replace
from typing import Callable

import msgspec
import numpy as np
import torch

from packloader.balancers.cost.fit import Timings, fit_profile
from packloader.contracts import CostProfile
from packloader.runtime.llama_layer import LlamaLayer, rope_cos_sin

PARTS = ("attn_fwd", "attn_bwd", "lin_fwd", "lin_bwd")


class LayerShape(msgspec.Struct, kw_only=True, frozen=True):
    """One transformer layer as measured (already divided by tensor parallelism)."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int | None = None  # LM head, timed when known
    name: str = "custom"
    layers: int | None = None  # the model's layer count, when known (a preset)

    def __post_init__(self) -> None:
        for f in ("hidden", "heads", "kv_heads", "head_dim", "ffn"):
            if getattr(self, f) < 1:
                raise ValueError(f"{f} must be >= 1, got {getattr(self, f)}")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")

    def sharded(self, tp: int) -> "LayerShape":
        if tp == 1:
            return self
        for f in ("heads", "kv_heads", "ffn"):
            if getattr(self, f) % tp:
                raise ValueError(f"{f}={getattr(self, f)} is not divisible by tp={tp}")
        vocab = -(-self.vocab // tp) if self.vocab else None
        return msgspec.structs.replace(self, heads=self.heads // tp, kv_heads=self.kv_heads // tp, ffn=self.ffn // tp, vocab=vocab)


def shape_from_preset(name: str) -> LayerShape:
    """A LayerShape from `packloader.balancers.cost.presets` (imported lazily: calibration works without it)."""
    try:
        from packloader.balancers.cost import presets
    except ImportError as e:  # pragma: no cover - the presets module ships with packloader
        raise ValueError(f"model presets are unavailable ({e}); give the shape with --hidden/--heads/...") from None
    s = presets.get_shape(name)
    return LayerShape(hidden=s.hidden, heads=s.heads, kv_heads=s.kv_heads, head_dim=s.head_dim, ffn=s.ffn,
                      vocab=s.vocab, name=s.name, layers=s.layers)


# ------------------------------------------------------------------------------------------------ fitting


def geometric_points(lo: int, hi: int, n: int) -> np.ndarray:
    """About n distinct integers spread geometrically from lo to hi (both included)."""
    if hi < lo:
        raise ValueError(f"upper end {hi} is below the lower end {lo}")
    pts = np.unique(np.round(np.geomspace(lo, hi, max(n, 2))).astype(np.int64))
    return pts


# ------------------------------------------------------------------------------------------------ timing


class _Clock:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def seconds(self, a, b) -> float:
        if self.cuda:
            b.synchronize()
            return a.elapsed_time(b) / 1e3
        return b - a

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


def _time_fwd_bwd(run: Callable[[], tuple[list[torch.Tensor], list[torch.Tensor]]], device: torch.device,
                  repeats: int, warmup: int) -> tuple[float, float]:
    """Median forward and backward seconds of `run`, which does a forward and returns (outputs, their grads)."""
    clock = _Clock(device)
    fw, bw = [], []
    gc_was_on = gc.isenabled()
    gc.disable()  # a collection inside a timed region is noise, not cost
    try:
        for i in range(warmup + repeats):
            clock.sync()
            t0 = clock.mark()
            outs, grads = run()
            t1 = clock.mark()
            torch.autograd.backward(outs, grads)
            t2 = clock.mark()
            clock.sync()
            if i >= warmup:
                fw.append(clock.seconds(t0, t1))
                bw.append(clock.seconds(t1, t2))
    finally:
        if gc_was_on:
            gc.enable()
    return statistics.median(fw), statistics.median(bw)


def time_attention(shape: LayerShape, lengths: np.ndarray, *, device: torch.device, dtype: torch.dtype,
                   backend: str | None, token_budget: int, repeats: int, warmup: int,
                   progress: Callable[[str], None] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Seconds per document of each length (forward, backward): `token_budget // l` documents packed in one
    varlen_attention call, its time divided by their count."""
    from packloader.runtime.attention import varlen_attention

    fwd, bwd = [], []
    gen = torch.Generator(device="cpu").manual_seed(0)
    for i, l in enumerate(lengths):
        l = int(l)
        count = max(1, token_budget // l)
        T = count * l
        q = torch.randn(T, shape.heads, shape.head_dim, generator=gen).to(device=device, dtype=dtype).requires_grad_()
        k = torch.randn(T, shape.kv_heads, shape.head_dim, generator=gen).to(device=device, dtype=dtype).requires_grad_()
        v = torch.randn(T, shape.kv_heads, shape.head_dim, generator=gen).to(device=device, dtype=dtype).requires_grad_()
        g = torch.randn(T, shape.heads, shape.head_dim, generator=gen).to(device=device, dtype=dtype)
        cu = torch.arange(0, T + 1, l, dtype=torch.int32, device=device)

        def run():
            for t in (q, k, v):
                t.grad = None
            return [varlen_attention(q, k, v, cu, cu, l, l, causal=True, backend=backend)], [g]

        f, b = _time_fwd_bwd(run, device, repeats, warmup)
        fwd.append(f / count)
        bwd.append(b / count)
        if progress:
            progress(f"  [{i + 1:>2d}/{len(lengths)}] attention l={l:>7d} x{count:<5d} fwd {fwd[-1] * 1e6:12.2f} us  bwd {bwd[-1] * 1e6:12.2f} us")
        q = k = v = g = None  # free them before the next length allocates
    return np.array(fwd), np.array(bwd)


class LinearPart(torch.nn.Module):
    """A Llama layer (`llama_layer.LlamaLayer`, the one the GPU proof runs) with its attention call replaced by
    passing the queries through: the layer's GEMM and element-wise work around attention, rope and the fused
    projection's views included. k and v come out beside the layer's output so their backward runs too."""

    def __init__(self, shape: LayerShape) -> None:
        super().__init__()
        self.layer = LlamaLayer.of(shape)

    def forward(self, x: torch.Tensor, rot: tuple[torch.Tensor, torch.Tensor]):
        kv: list[torch.Tensor] = []

        def pass_q(q, k, v):
            kv.extend((k, v))
            return q

        return self.layer(x, rot, pass_q), kv[0], kv[1]


def time_linear(shape: LayerShape, sizes: np.ndarray, *, device: torch.device, dtype: torch.dtype, repeats: int,
                warmup: int, progress: Callable[[str], None] | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Seconds per micro-batch of each token count: (layer fwd, layer bwd, head fwd, head bwd); the head's are
    zeros when the shape has no vocabulary."""
    torch.manual_seed(0)
    layer = LinearPart(shape).to(device=device, dtype=dtype)
    head = torch.nn.Parameter(torch.randn(shape.hidden, shape.vocab, device=device, dtype=dtype)) if shape.vocab else None
    lf, lb, hf, hb = [], [], [], []
    for i, n in enumerate(sizes):
        n = int(n)
        x = torch.randn(n, shape.hidden, device=device, dtype=dtype, requires_grad=True)
        gy = torch.randn(n, shape.hidden, device=device, dtype=dtype)
        gk = torch.randn(n, shape.kv_heads, shape.head_dim, device=device, dtype=dtype)
        rot = rope_cos_sin(torch.arange(n, device=device), shape.head_dim, dtype)  # once per micro-batch, untimed

        def run_layer():
            x.grad = None
            layer.zero_grad(set_to_none=True)
            y, k, v = layer(x, rot)
            return [y, k, v], [gy, gk, gk]

        f, b = _time_fwd_bwd(run_layer, device, repeats, warmup)
        lf.append(f)
        lb.append(b)
        if head is not None:
            gl = torch.randn(n, shape.vocab, device=device, dtype=dtype)

            def run_head():
                x.grad = None
                head.grad = None
                return [x @ head], [gl]

            f, b = _time_fwd_bwd(run_head, device, repeats, warmup)
            del gl
        else:
            f = b = 0.0
        hf.append(f)
        hb.append(b)
        if progress:
            progress(f"  [{i + 1:>2d}/{len(sizes)}] linear    n={n:>7d}       fwd {lf[-1] * 1e6:12.2f} us  bwd {lb[-1] * 1e6:12.2f} us"
                     + (f"  (head fwd {f * 1e6:.2f} us, bwd {b * 1e6:.2f} us)" if head is not None else ""))
    return np.array(lf), np.array(lb), np.array(hf), np.array(hb)


# ------------------------------------------------------------------------------------------------ driver


def device_label(device: torch.device, dtype: torch.dtype, backend: str) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return f"{device.type}:{name}/{backend}/{str(dtype).removeprefix('torch.')}"


def calibrate(
    shape: LayerShape,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    max_len: int = 8192,
    max_tokens: int | None = None,
    layers: float = 1.0,
    pp: int = 1,
    include_head: bool = True,
    num_lengths: int = 13,
    num_sizes: int = 9,
    min_len: int = 64,
    repeats: int = 5,
    warmup: int = 2,
    tile: int | None = None,
    backend: str | None = None,
    name: str | None = None,
    progress: Callable[[str], None] | None = None,
) -> tuple[CostProfile, Timings]:
    """Measure `shape` on `device` and fit the profile of a pipeline stage of `layers` layers (the LM head's time
    divided by `pp` added to every stage's linear part when `include_head` and the vocabulary is known)."""
    from packloader.runtime.attention import select_backend

    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda asked for, but torch sees no CUDA device here")
    chosen = select_backend(device, backend, dtype)
    max_tokens = int(max_tokens or max_len)
    lengths = geometric_points(min(min_len, max_len), max_len, num_lengths)
    sizes = geometric_points(min(min_len, max_tokens), max_tokens, num_sizes)
    if len(lengths) < 3 or len(sizes) < 3:
        raise ValueError(f"too few distinct points between {min_len} and {max_len}/{max_tokens}: use a longer range")
    say = progress or (lambda s: None)
    gc.collect()  # once: the timed regions run with the collector off
    say(f"calibrating {shape.name} (hidden {shape.hidden}, heads {shape.heads}/{shape.kv_heads} x {shape.head_dim}, "
        f"ffn {shape.ffn}) on {device_label(device, dtype, chosen)}: {len(lengths)} attention lengths, then "
        f"{len(sizes)} micro-batch sizes, {warmup} warmup + {repeats} timed runs each")
    af, ab = time_attention(shape, lengths, device=device, dtype=dtype, backend=chosen, token_budget=max_len,
                            repeats=repeats, warmup=warmup, progress=progress)
    head_shape = shape if include_head else replace(shape, vocab=None)
    lf, lb, hf, hb = time_linear(head_shape, sizes, device=device, dtype=dtype, repeats=repeats, warmup=warmup,
                                 progress=progress)
    m = Timings(lengths, af * layers, ab * layers, sizes, lf * layers + hf / pp, lb * layers + hb / pp)
    label = name or f"{shape.name}@{device_label(device, dtype, chosen)}/layers{layers:g}"
    prof = fit_profile(label, m, tile=tile, device=device_label(device, dtype, chosen))
    return prof, m


FIT_ERROR_WARN_PCT = 10.0  # held-out error above which a profile's predictions are called unreliable


def fit_warnings(profile: CostProfile, limit_pct: float = FIT_ERROR_WARN_PCT) -> list[str]:
    """One line per part whose held-out error (mean absolute percentage, on lengths the fit did not see) is above
    `limit_pct`: plans priced with it are balanced against times that far off."""
    out = []
    for part in PARTS:
        err = profile.fit_error.get(part + "_heldout_mape_pct")
        if err is not None and not err <= limit_pct:
            out.append(f"{part}: held-out error {err:.1f}% (above {limit_pct:g}%)")
    return out


def format_fit(profile: CostProfile) -> str:
    lines = [f"profile {profile.name}: tile {profile.tile}"]
    for part in PARTS:
        p = getattr(profile, part)
        lines.append(f"  {part:8s} a={p.a:.4e} b={p.b:.4e} c={p.c:.4e}   held-out MAPE "
                     f"{profile.fit_error.get(part + '_heldout_mape_pct', float('nan')):6.2f}%   "
                     f"in-sample max rel err {profile.fit_error.get(part, float('nan')) * 100:6.2f}%")
    if profile.lin_table is not None:
        lines.append(f"  linear part: the measured table at {len(profile.lin_table.tokens)} token counts "
                     f"({profile.lin_table.tokens[0]:g}..{profile.lin_table.tokens[-1]:g}); lin_* above summarise it "
                     f"(per-token rate b, floor c) for the planners")
    return "\n".join(lines)
