"""Measuring what context-parallel K/V exchange costs on this machine, for the device file's `cp_link`
(`balancers.cost.devices.CPLink`), which per-document CP planning prices it with (`balancers.cost.cp_comm`).

`time_all_gather` times the collective packloader's CP attention runs (`dist.all_gather_into_tensor` of every
rank's K/V rows over a group) at a few sizes; `fit_cp_link` fits time = steps x latency + bytes received /
bandwidth to the samples (least squares on both terms, steps = group size - 1). Run it once over a group inside a
node and once over one across nodes to fill both halves of `cp_link`. On CPU over gloo it is a dry run (tests);
the numbers that matter come from NCCL on the GPUs the plans are for.
"""

from __future__ import annotations

import statistics
import time
from typing import Sequence

import numpy as np
import torch
import torch.distributed as dist


def time_all_gather(rows: Sequence[int], row_bytes: int, *, group=None, device: torch.device | None = None,
                    repeats: int = 5, warmup: int = 2) -> list[tuple[int, float, float]]:
    """(group size, bytes each rank receives, median seconds) of an all-gather of `rows[k]` rows of `row_bytes`
    bytes from every rank of `group`, for each k. Every rank of the group must call it with the same arguments."""
    device = device or torch.device("cpu")
    world = dist.get_world_size(group)
    cuda = device.type == "cuda"
    out = []
    for n in rows:
        local = torch.ones(int(n), max(1, row_bytes // 2), dtype=torch.bfloat16 if cuda else torch.float16, device=device)
        gathered = torch.empty(world * local.shape[0], local.shape[1], dtype=local.dtype, device=device)
        times = []
        for i in range(warmup + repeats):
            dist.barrier(group)
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            dist.all_gather_into_tensor(gathered, local, group=group)
            if cuda:
                torch.cuda.synchronize()
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        received = (world - 1) * local.numel() * local.element_size()
        out.append((world, received, statistics.median(times)))
    return out


def fit_cp_link(samples: Sequence[tuple[int, float, float]]) -> tuple[float, float]:
    """(bandwidth in GB/s, latency per ring step in microseconds) from (group size, bytes received, seconds)
    samples: the least-squares fit of seconds = (size - 1) x latency + bytes / bandwidth, latency clipped at 0."""
    a = np.array([[s - 1, b] for s, b, _ in samples], dtype=np.float64)
    t = np.array([x for _, _, x in samples], dtype=np.float64)
    if len(samples) < 2 or np.linalg.matrix_rank(a) < 2:
        raise ValueError(f"fit_cp_link needs samples of at least two different sizes, got {len(samples)}")
    (lat, inv_bw), *_ = np.linalg.lstsq(a, t, rcond=None)
    if inv_bw <= 0:
        raise ValueError("fit_cp_link: time does not grow with the bytes sent; time larger transfers")
    return 1.0 / inv_bw / 1e9, max(0.0, float(lat)) * 1e6
