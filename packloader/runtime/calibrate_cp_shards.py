"""Measuring the CP-shard overhead on one GPU, for the device file's `cp_shard` (`balancers.cost.devices.
CPShardOverhead`), which fixed and per-document CP both price shards with (`balancers.cost.cp_shard_attention`).

The cost model prices a document's CP shard on each of s GPUs at 1/s of the document's attention. Under the zigzag
layout per-document CP shards with (`collate.cp_document_shards.plan_dynamic_cp`, each document in 2s chunks, rank i taking
chunks i and 2s - 1 - i), a rank runs two short query runs against their prefix keys: kernels run those below the
whole document's rate, and the ranks of a CP group wait for the slowest one every layer. `time_cp_shards` times,
for each document length and CP size, `varlen_attention` (forward and backward) on the whole document and on every
rank's shard against its keys, all on this one GPU; `ShardRow.factors` gives the slowest rank's time x s over the
whole document's (the factor the device file records) and the mean rank's. `fit_overhead` takes one factor per
size, weighted by the lengths' tokens. Only the attention kernel is timed: the K/V all-gather is `cp_link`'s
(`calibrate_cp`), and picking a shard's keys out of the gathered buffer is left out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import msgspec
import numpy as np
import torch

from packloader.balancers.cost.devices import CPShardOverhead, Device
from packloader.collate.cp_document_shards import plan_dynamic_cp
from packloader.contracts import CPPlacement, Segment
from packloader.runtime.calibrate import LayerShape, _time_fwd_bwd

GPU_LENGTHS = (131072, 65536, 32768, 16384)  # longest first: what a time budget keeps
GPU_SIZES = (2, 4, 8, 16)
CPU_SIZES = (2, 4, 8)  # a CPU dry run with the reference backend: the code path, not a GPU's numbers


@dataclass(frozen=True)
class ShardLayout:
    """One CP rank's zigzag shard of a document of `length` tokens: its queries (document positions, in runs) and
    each run's keys (document positions), as the per-document CP runtime hands them to `varlen_attention`."""

    length: int
    size: int
    rank: int
    query_index: np.ndarray  # int64 [n]
    cu_q: np.ndarray  # int32 [R + 1]
    key_index: np.ndarray  # int64 [K]
    cu_k: np.ndarray  # int32 [R + 1]
    max_q: int
    max_k: int


def shard_layout(length: int, size: int, rank: int) -> ShardLayout:
    """Rank `rank`'s shard of one document of `length` tokens on a CP group of `size` GPUs, from the collate's own
    per-document CP sharding (`plan_dynamic_cp`); its key rows of the gathered buffer mapped back to positions."""
    shard = plan_dynamic_cp([Segment(doc=0, start=0, end=int(length), attend_from=0)], [CPPlacement(size=size, first=0)],
                            gpu=rank, pool=size)
    group = shard.groups[0].shard
    rows, cu_k, max_k = group.key_layout(causal=True)
    position_of_row = np.full(size * max(group.max_local, 1), -1, dtype=np.int64)
    position_of_row[group.gather_index] = np.arange(group.gather_index.size)
    return ShardLayout(length=int(length), size=int(size), rank=int(rank), query_index=shard.token_index,
                       cu_q=shard.cu_seqlens_q, key_index=position_of_row[rows], cu_k=cu_k.astype(np.int32),
                       max_q=shard.max_seqlen_q, max_k=int(max_k))


class ShardRow(msgspec.Struct, frozen=True):
    """Seconds of one layer's attention (forward, backward) of a document of `length` tokens: whole, and each
    rank's shard at CP size `size`."""

    length: int
    size: int
    whole_fwd: float
    whole_bwd: float
    rank_fwd: list[float]
    rank_bwd: list[float]

    def factors(self) -> dict[str, float]:
        """Slowest and mean rank's shard time x size over the whole document's, per pass."""
        s = self.size
        return {"fwd": max(self.rank_fwd) * s / self.whole_fwd, "bwd": max(self.rank_bwd) * s / self.whole_bwd,
                "mean_fwd": float(np.mean(self.rank_fwd)) * s / self.whole_fwd,
                "mean_bwd": float(np.mean(self.rank_bwd)) * s / self.whole_bwd}


def _launch(q_all, k_all, v_all, g, lay: ShardLayout | None, device, backend):
    """A run() for the timer: varlen_attention over the whole document (lay None) or one rank's shard, on leaves."""
    from packloader.runtime.attention import varlen_attention

    if lay is None:
        cu = torch.tensor([0, q_all.shape[0]], dtype=torch.int32, device=device)
        q, k, v, cu_q, cu_k, mq, mk = q_all, k_all, v_all, cu, cu, q_all.shape[0], q_all.shape[0]
    else:
        qi, ki = (torch.from_numpy(x).to(device) for x in (lay.query_index, lay.key_index))
        q, k, v = q_all.index_select(0, qi), k_all.index_select(0, ki), v_all.index_select(0, ki)
        cu_q, cu_k = (torch.from_numpy(x.astype(np.int32)).to(device) for x in (lay.cu_q, lay.cu_k))
        mq, mk = lay.max_q, lay.max_k
    q, k, v = (t.detach().contiguous().requires_grad_() for t in (q, k, v))
    grad = g[: q.shape[0]]

    def run():
        for t in (q, k, v):
            t.grad = None
        return [varlen_attention(q, k, v, cu_q, cu_k, mq, mk, causal=True, backend=backend)], [grad]

    return run


def time_cp_shards(shape: LayerShape, lengths: Sequence[int], sizes: Sequence[int], *, device: torch.device,
                   dtype: torch.dtype, backend: str | None = None, repeats: int = 5, warmup: int = 2,
                   progress: Callable[[str], None] | None = None, stop: Callable[[], bool] | None = None) -> list[ShardRow]:
    """One `ShardRow` per (length, size) with 2 x size <= length, in the order of `lengths` (longest first keeps
    what matters most when a budget cuts the sweep); `stop()` ends the sweep early (a time budget) with the rows
    measured so far."""
    out: list[ShardRow] = []
    gen = torch.Generator(device=device).manual_seed(0)
    for length in (int(x) for x in lengths):
        if stop is not None and stop():
            break
        q_all = torch.randn(length, shape.heads, shape.head_dim, generator=gen, device=device, dtype=dtype)
        k_all = torch.randn(length, shape.kv_heads, shape.head_dim, generator=gen, device=device, dtype=dtype)
        v_all = torch.randn(length, shape.kv_heads, shape.head_dim, generator=gen, device=device, dtype=dtype)
        g = torch.randn(length, shape.heads, shape.head_dim, generator=gen, device=device, dtype=dtype)
        wf, wb = _time_fwd_bwd(_launch(q_all, k_all, v_all, g, None, device, backend), device, repeats, warmup)
        for size in sorted(int(s) for s in sizes if 1 < s <= length // 2):
            if stop is not None and stop():
                break
            times = [_time_fwd_bwd(_launch(q_all, k_all, v_all, g, shard_layout(length, size, r), device, backend),
                                   device, repeats, warmup) for r in range(size)]
            row = ShardRow(length, size, wf, wb, [t[0] for t in times], [t[1] for t in times])
            out.append(row)
            if progress:
                f = row.factors()
                progress(f"  length {length:>7d} CP {size:>2d}: whole {wf * 1e3:9.3f} / {wb * 1e3:9.3f} ms; slowest "
                         f"shard x{f['fwd']:.3f} fwd x{f['bwd']:.3f} bwd, mean x{f['mean_fwd']:.3f} / x{f['mean_bwd']:.3f}")
        del q_all, k_all, v_all, g
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def fit_overhead(rows: Sequence[ShardRow], source: str = "") -> tuple[CPShardOverhead, dict[int, dict[str, float]]]:
    """One factor per CP size and pass, the rows' factors weighted by their lengths (tokens), and those raw fits.
    The device file's factors are at least 1 (a shard measured faster than 1/s is recorded as 1: the planners'
    bound assumes no shard beats its share); the raw ones come back beside it."""
    if not rows:
        raise ValueError("fit_overhead: no shard timings (every length shorter than twice the CP sizes, or the time "
                         "budget spent before the first)")
    raw: dict[int, dict[str, float]] = {}
    for size in sorted({r.size for r in rows}):
        mine = [r for r in rows if r.size == size]
        w = np.array([r.length for r in mine], dtype=np.float64)
        raw[size] = {k: float(np.dot(w, [r.factors()[k] for r in mine]) / w.sum())
                     for k in ("fwd", "bwd", "mean_fwd", "mean_bwd")}
    table = {k: {s: max(1.0, v[k]) for s, v in raw.items()} for k in ("fwd", "bwd", "mean_fwd", "mean_bwd")}
    return CPShardOverhead(**table, source=source), raw


def device_with_cp_shard(base: Device, overhead: CPShardOverhead, *, name: str) -> Device:
    """A copy of Device `base` named `name` with `cp_shard` set (write it with `calibrate_cp.write_device`)."""
    return msgspec.structs.replace(base, name=name, cp_shard=overhead)
