"""Measuring what context-parallel K/V exchange costs on this machine, for the device file's `cp_link`
(`balancers.cost.devices.CPLink`), which per-document CP planning prices it with (`balancers.cost.cp_comm`).

`time_all_gather` times the collective packloader's CP attention runs (`dist.all_gather_into_tensor` of every
rank's K/V rows over a group) at a few sizes; `fit_cp_link` fits time = steps x latency + bytes received /
bandwidth to the samples (least squares on both terms, steps = group size - 1). Run it once over a group inside a
node and once over one across nodes to fill both halves of `cp_link`. On CPU over gloo it is a dry run (tests);
the numbers that matter come from NCCL on the GPUs the plans are for.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path
from typing import Sequence

import msgspec
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
    return float(1.0 / inv_bw / 1e9), max(0.0, float(lat)) * 1e6


def measure_cp_groups(rows: Sequence[int], row_bytes: int, *, device: torch.device | None = None, repeats: int = 5,
                      warmup: int = 2) -> list[tuple[int, float, float]]:
    """`time_all_gather` over the first 2, 4, 8, ... ranks of the initialised process group (every power of two up
    to the world size), as CP groups of those sizes gather: every rank must call it; rank 0 (in every group)
    returns all the samples, the others []. Two sizes or more give the fit both of its terms apart."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if world < 2:
        raise ValueError(f"measuring a CP link needs a process group of at least 2 ranks, got {world}")
    samples = []
    size = 2
    while size <= world:
        group = dist.new_group(list(range(size)))  # every rank creates every group, members or not
        if rank < size:
            got = time_all_gather(rows, row_bytes, group=group, device=device, repeats=repeats, warmup=warmup)
            samples += got if rank == 0 else []
        dist.barrier()
        size *= 2
    return samples


def device_with_cp_link(base, half: str, gbps: float, latency_us: float, *, name: str,
                        gpus_per_node: int | None = None):
    """A copy of Device `base` (`balancers.cost.devices`) named `name`, with the `half` ("intra" or "inter" node)
    of its cp_link replaced by the fitted numbers; the other half kept."""
    if half not in ("intra", "inter"):
        raise ValueError(f"half: expected 'intra' or 'inter' (node), got {half!r}")
    link = msgspec.structs.replace(base.cp_link, **{f"{half}_node_gbps": float(gbps),
                                                      f"{half}_node_latency_us": float(latency_us)})
    if gpus_per_node is not None:
        link = msgspec.structs.replace(link, gpus_per_node=gpus_per_node)
    return msgspec.structs.replace(base, name=name, cp_link=link)


def write_device(device, path) -> None:
    """Device `device` as a device file at `path` (its name must be the file's stem, as `read_device` checks),
    its measured profile referenced relative to the new file's folder."""
    path = Path(path)
    if device.name != path.stem:
        raise ValueError(f"device file {path}: the device is named {device.name!r}; a device file's name is its stem")
    data = msgspec.to_builtins(device)
    data.pop("file", None)
    profile = device.measured_profile_path()
    if profile is not None:
        data["measured"]["profile"] = os.path.relpath(profile, path.resolve().parent)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
