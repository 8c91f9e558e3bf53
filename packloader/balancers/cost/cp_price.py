"""The one price of context parallelism, for fixed and per-document CP alike.

* Shard compute: one GPU's share of a document's attention at the device's measured shard factor
  (`cp_shard.shard_attention`, `cp_shard.cp_shard_factors`), and n / s tokens of the linear part.
* Traffic: the K/V exchange of a CP group of s GPUs over n tokens, from the device's link (`exchange_seconds`,
  the only place its formula is written; `CPComm.times` and `times_array` call it).
* Fixed CP: its group's all-gather is part of the per-rank price every planner balances: `fixed_cp_profile` folds
  it into the scaled profile's linear part (the all-gather is linear in the micro-batch's tokens plus one latency
  per ring step), and marks the profile with the group size it carries (`CostProfile.cp_traffic`).
* DP-Merge: a micro-batch run as CP over its dp_group's cp x g GPUs pays that larger group's traffic; what the
  profile does not carry yet is added by `fixed_with_comm`, which the report, the advice and cp_mode "auto" call.

Changing a price here moves the plans, the report and the runtime's estimate together.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import msgspec
import numpy as np

from packloader.balancers.cost.cp_shard_attention import scale_profile_to_cp, shard_attention, size_factors
from packloader.balancers.cost.devices import CPLink, Device
from packloader.contracts import CostProfile, LinTable, Poly, StepPlan

Exchange = Literal["allgather", "ring"]
BYTES_PER_VALUE = 2  # bf16


@dataclass(frozen=True)
class CPComm:
    """Seconds of CP communication on one GPU of one pipeline stage, forward and backward, for a document of n
    tokens sharded over s GPUs (`times`); the model shape and link rates it came from."""

    kv_bytes_per_token: float  # K and V of one token, all layers of the stage, on one GPU (its TP share)
    layers: float  # layers per pipeline stage
    tp: int
    link: CPLink
    exchange: Exchange = "allgather"

    def bandwidth_latency(self, s: int) -> tuple[float, float]:
        """(bytes per second, seconds per ring step) of a CP group of s GPUs (`cp_price.link_rates`)."""
        return link_rates(self, s)

    def times(self, n: float, s: int, attn_fwd: float = 0.0, attn_bwd: float = 0.0) -> tuple[float, float]:
        """(forward, backward) seconds of one document of n tokens at CP size s on each of its GPUs; the ring's
        overlap needs the GPU's attention share of that document (`attn_fwd`, `attn_bwd`, seconds). Priced by
        `cp_price.exchange_seconds`."""
        f, b = exchange_seconds(self, n, s, attn_fwd, attn_bwd)
        return float(f[0]), float(b[0])

    def times_array(self, n: np.ndarray, s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """`times` of many documents at once (no overlap credit)."""
        return exchange_seconds(self, n, s)


def shard_share(model, device: Device | None, q, p, s) -> tuple[np.ndarray, np.ndarray]:
    """(forward, backward) attention of each segment (q query tokens after p keys, `model` one GPU at CP 1) on one
    GPU of its group of s[k] GPUs: per-document term in full, the rest / s times the measured shard factor."""
    s = np.asarray(s, dtype=np.int64)
    fa, ba = model.segment_times(q, p)
    cf, cb = float(model.profile.attn_fwd.c), float(model.profile.attn_bwd.c)
    ff, fb = size_factors(device, s)
    return shard_attention(fa, cf, s, ff), shard_attention(ba, cb, s, fb)


def link_rates(comm: CPComm, s: int) -> tuple[float, float]:
    """(bytes per second, seconds per ring step) of a CP group of s GPUs: NVLink while tp x s GPUs fit a node."""
    link = comm.link
    if comm.tp * s <= link.gpus_per_node:
        return link.intra_node_gbps * 1e9, link.intra_node_latency_us * 1e-6
    return link.inter_node_gbps * 1e9, link.inter_node_latency_us * 1e-6


def exchange_seconds(comm: CPComm, n, s, attn_fwd=0.0, attn_bwd=0.0) -> tuple[np.ndarray, np.ndarray]:
    """(forward, backward) seconds of the K/V exchange on each GPU of a group of s GPUs for n tokens (arrays or
    scalars). All-gather: forward gathers (s - 1)/s of the rows, backward reduce-scatters as many, s - 1 latency
    steps per layer each way. Ring: backward passes twice the volume and each step hides behind the attention in
    hand (`attn_fwd`, `attn_bwd`), never below its latency."""
    n = np.atleast_1d(np.asarray(n, dtype=np.float64))
    s = np.broadcast_to(np.atleast_1d(np.asarray(s, dtype=np.int64)), n.shape)
    af = np.broadcast_to(np.asarray(attn_fwd, dtype=np.float64), n.shape)
    ab = np.broadcast_to(np.asarray(attn_bwd, dtype=np.float64), n.shape)
    f, b = np.zeros(n.shape), np.zeros(n.shape)
    for size in np.unique(s[s > 1]).tolist():
        k = (s == size) & (n > 0)
        bw, lat = link_rates(comm, size)
        steps = (size - 1) * comm.layers * lat
        volume = (size - 1) / size * n[k] * comm.kv_bytes_per_token / bw
        if comm.exchange == "allgather":
            f[k] = b[k] = steps + volume
        else:
            f[k] = np.maximum(steps + volume - af[k], steps)
            b[k] = np.maximum(steps + 2.0 * volume - ab[k], steps)
    return f, b


def allgather_terms(comm: CPComm, s: int) -> tuple[float, float]:
    """(seconds per token, seconds per micro-batch) of a fixed CP group's all-gather, each way (fwd = bwd)."""
    if s <= 1:
        return 0.0, 0.0
    bw, lat = link_rates(comm, s)
    return (s - 1) / s * comm.kv_bytes_per_token / bw, (s - 1) * comm.layers * lat


def with_fixed_traffic(profile: CostProfile, comm: CPComm, cp: int) -> CostProfile:
    """`profile` (one GPU's share at fixed CP `cp`) whose linear part also pays the group's all-gather: per token
    on b, one latency per ring step on the floor c; a measured `lin_table` gets the same at every knot."""
    if cp <= 1 or profile.cp_traffic == cp:
        return profile
    if profile.cp_traffic != 1:
        raise ValueError(f"cost profile {profile.name!r} already carries CP {profile.cp_traffic}'s traffic, not {cp}'s")
    rate, floor = allgather_terms(comm, cp)

    def lin(p: Poly) -> Poly:
        return Poly(p.a, p.b + rate, p.c + floor)

    t = profile.lin_table
    table = None if t is None else LinTable(tokens=list(t.tokens), fwd=[v + rate * n + floor for n, v in zip(t.tokens, t.fwd)],
                                            bwd=[v + rate * n + floor for n, v in zip(t.tokens, t.bwd)])
    return msgspec.structs.replace(profile, lin_fwd=lin(profile.lin_fwd), lin_bwd=lin(profile.lin_bwd), lin_table=table,
                                   cp_traffic=cp,
                                   source=(profile.source + f"; CP {cp} K/V all-gather priced in (device cp_link)").lstrip("; "))


def without_fixed_traffic(profile: CostProfile, comm: CPComm) -> CostProfile:
    """`profile` less the all-gather `with_fixed_traffic` folded in (the same `comm`): shard compute alone."""
    if profile.cp_traffic == 1:
        return profile
    rate, floor = allgather_terms(comm, profile.cp_traffic)

    def lin(p: Poly) -> Poly:
        return Poly(p.a, p.b - rate, p.c - floor)

    t = profile.lin_table
    table = None if t is None else LinTable(tokens=list(t.tokens), fwd=[v - rate * n - floor for n, v in zip(t.tokens, t.fwd)],
                                            bwd=[v - rate * n - floor for n, v in zip(t.tokens, t.bwd)])
    return msgspec.structs.replace(profile, lin_fwd=lin(profile.lin_fwd), lin_bwd=lin(profile.lin_bwd), lin_table=table,
                                   cp_traffic=1)


def fixed_cp_profile(profile: CostProfile, cp: int, device: Device | None, comm: CPComm | None) -> CostProfile:
    """One GPU's fixed-CP price from a CP-1 profile: shard compute (`scale_profile_to_cp`) and the group's
    traffic (`with_fixed_traffic`; none without `comm`)."""
    scaled = scale_profile_to_cp(profile, cp, device)
    return scaled if comm is None else with_fixed_traffic(scaled, comm, cp)


def group_size(mb, cp: int) -> int:
    """The GPUs a fixed-CP micro-batch runs on: its CP group, times its dp_group for a DP-Merge micro-batch."""
    return cp * max(1, len(mb.dp_group or ()))


def fixed_with_comm(plan: StepPlan, comm: CPComm, cp: int, paid: int = 1) -> StepPlan:
    """A fixed-CP plan whose micro-batches also pay the K/V all-gather of their group (`group_size`) beyond what
    their price already holds (`paid`: the group size the pricing profile carries, `CostProfile.cp_traffic`; 1:
    none). A copy; other plans come back as they are."""
    if plan.cp_mode != "fixed" or (cp <= 1 and not any(mb.dp_group for r in plan.ranks for mb in r.micro_batches)):
        return plan
    ranks = []
    for rank in plan.ranks:
        mbs = []
        for mb in rank.micro_batches:
            g = group_size(mb, cp)
            if mb.segments and g != paid:
                f, b = exchange_seconds(comm, [mb.num_tokens, mb.num_tokens], [g, paid])
                mb = msgspec.structs.replace(mb, fwd_cost=mb.fwd_cost + float(f[0] - f[1]),
                                             bwd_cost=mb.bwd_cost + float(b[0] - b[1]))
            mbs.append(mb)
        ranks.append(msgspec.structs.replace(rank, micro_batches=mbs))
    return msgspec.structs.replace(plan, ranks=ranks)
