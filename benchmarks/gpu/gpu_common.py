"""What every part of the GPU proof shares: the run's settings (device, dtype, shapes, dry-run), each part's time
budget, the timing helper and the long-tail lengths. A dry run is the same code on CPU with tiny shapes, the
reference attention backend and float32, so CI keeps every code path alive without a GPU."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from packloader.runtime.calibrate import LayerShape, _time_fwd_bwd

# Llama-2-7B's layer: what the shipped H100 profile measured (32 heads x 128, hidden 4096, FFN 11008).
SHAPE_7B = LayerShape(hidden=4096, heads=32, kv_heads=32, head_dim=128, ffn=11008, name="llama2-7b", layers=32)
# A smaller GQA layer (Llama-3.2-1B's): 32 query / 8 key-value heads of 64, hidden 2048, FFN 8192.
SHAPE_1B = LayerShape(hidden=2048, heads=32, kv_heads=8, head_dim=64, ffn=8192, name="llama3.2-1b", layers=16)
# The dry run's stand-in shape (CPU, float32): small enough that every part runs in seconds.
SHAPE_TINY = LayerShape(hidden=32, heads=4, kv_heads=2, head_dim=8, ffn=64, name="tiny-dry-run", layers=2)


class BudgetExceeded(RuntimeError):
    """A part ran past its time budget: it stops and reports what it measured so far."""


@dataclass
class Budget:
    """Seconds one part may take; loops ask `left()` / `check()` between measurements."""

    seconds: float
    started: float = field(default_factory=time.perf_counter)

    def used(self) -> float:
        return time.perf_counter() - self.started

    def left(self) -> float:
        return self.seconds - self.used()

    def check(self, what: str = "") -> None:
        if self.left() <= 0:
            raise BudgetExceeded(f"time budget of {self.seconds:.0f} s spent{' at ' + what if what else ''}")


@dataclass
class Ctx:
    """The run's settings, handed to every part."""

    device: torch.device
    dtype: torch.dtype
    dry_run: bool
    backend: str | None  # forced attention backend (None: the dispatcher's choice)
    repeats: int
    warmup: int
    seed: int = 0
    quick: bool = False  # the main shape only, and no `packloader calibrate` CLI run: a rerun on a short lease
    results: dict = field(default_factory=dict)  # what earlier parts produced (e.g. calibrated profiles)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def shapes(self) -> list[LayerShape]:
        return [SHAPE_TINY] if self.dry_run else [SHAPE_7B] if self.quick else [SHAPE_7B, SHAPE_1B]

    def main_shape(self) -> LayerShape:
        return SHAPE_TINY if self.dry_run else SHAPE_7B

    def randn(self, *shape: int, gen: torch.Generator, grad: bool = False) -> torch.Tensor:
        t = torch.randn(*shape, generator=gen, device=self.device, dtype=self.dtype)  # gen: on self.device
        return t.requires_grad_() if grad else t

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def free(self) -> None:
        if self.cuda:
            torch.cuda.empty_cache()


def time_fwd_bwd(ctx: Ctx, run: Callable[[], tuple[list[torch.Tensor], list[torch.Tensor]]], *,
                 repeats: int | None = None, warmup: int | None = None) -> tuple[float, float]:
    """Median forward and backward seconds (CUDA events on a GPU): calibrate's own timer, so every part times
    the way the shipped profile was measured."""
    return _time_fwd_bwd(run, ctx.device, ctx.repeats if repeats is None else repeats,
                         ctx.warmup if warmup is None else warmup)


def long_tail_lengths(n: int, seed: int, *, scale: float = 1.0, lo: int = 16, hi: int = 262144) -> np.ndarray:
    """Document lengths with a web-crawl-like long tail: a log-normal body (median 1000 tokens) and 1 % Pareto
    outliers from 16K up (benchmarks/planner.py's synthetic-cc), times `scale` (the dry run shrinks them)."""
    rng = np.random.default_rng(seed)
    body = rng.lognormal(np.log(1000), 1.6, n)
    long = 16384 * (1 + rng.pareto(1.2, n))
    x = np.where(rng.random(n) < 0.01, long, body) * scale
    return np.clip(np.rint(x), max(1, int(lo * scale)), int(hi * scale)).astype(np.int64)


def mape(pred, meas) -> float:
    pred, meas = np.asarray(pred, dtype=np.float64), np.asarray(meas, dtype=np.float64)
    return float(np.mean(np.abs(pred - meas) / np.maximum(meas, 1e-30)) * 100.0) if len(meas) else float("nan")


def cu_seqlens(lengths, device: torch.device) -> torch.Tensor:
    return torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32, device=device)
