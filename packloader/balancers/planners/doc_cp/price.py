"""Prices of a per-document CP plan: what each GPU of the DP x CP pool spends on each micro-batch slot.

A segment of q query tokens (p earlier keys) on a subgroup of s GPUs costs each of them its share of the attention,
(attn(q, p) - c) / s x factor + c (the per-document term c is paid by every GPU that runs the document, as the
measured profile's CP scaling has it; factor: the device file's measured CP-shard overhead at size s, 1 without
one, `cost.cp_shard_attention`), and q / s tokens of the linear part; a GPU's micro-batch costs lin(its tokens) once
(the floor with it), plus, per subgroup it is part of in that slot, the subgroup's K/V exchange (`cost.cp_comm`,
one collective per layer for all that subgroup's documents). GPUs that share a document wait for each other at
every layer, so a micro-batch ends when the slowest GPU of its connected subgroups ends (`synced`): the pool's
subgroups are aligned powers of two, so the connected ones form aligned blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import numpy as np

from packloader.balancers.cost.coeffs import LIN_BWD, LIN_FWD, lin_times
from packloader.balancers.cost.cp_comm import CPComm, cp_comm_for
from packloader.balancers.cost.cp_price import shard_share
from packloader.balancers.cost.cp_shard_attention import size_factors
from packloader.balancers.cost.devices import Device, load_device
from packloader.balancers.cost.lookup import cost_model_for
from packloader.balancers.cost.model import CostModel
from packloader.contracts import PlanConfig


@dataclass
class Placed:
    """Segments placed in slots: segment k is q[k] query tokens after p[k] earlier keys, in slot m[k] on GPUs
    first[k] .. first[k] + size[k] - 1 of the pool."""

    q: np.ndarray
    p: np.ndarray
    m: np.ndarray
    first: np.ndarray
    size: np.ndarray


@dataclass
class SlotTimes:
    """Seconds per (slot, pool GPU): own work (attention share, linear part, CP traffic) and with the wait for
    the slowest GPU of its connected subgroups (`synced_*`, what the GPU's micro-batch takes)."""

    own_fwd: np.ndarray
    own_bwd: np.ndarray
    synced_fwd: np.ndarray
    synced_bwd: np.ndarray
    tokens: np.ndarray  # tokens per (slot, GPU)


@dataclass
class DynamicCPCost:
    """The per-GPU cost model of per-document CP: the config's layout at CP 1 (one GPU's stage), CP traffic, and
    the tokens one GPU may hold in one micro-batch (max_tokens / cp: the memory a fixed-CP GPU is given)."""

    model: CostModel
    comm: CPComm
    cap: int
    pool: int
    device: Device | None = None  # its cp_shard prices shards (None, or none in the file: exactly 1/s)

    @classmethod
    def for_config(cls, config: PlanConfig, exchange: str = "allgather") -> "DynamicCPCost":
        par = config.parallel
        one = msgspec.structs.replace(config, parallel=msgspec.structs.replace(par, cp=1))
        comm = cp_comm_for(config.model, par, device=config.device, exchange=exchange)  # type: ignore[arg-type]
        device = load_device(config.device)
        pool = par.dp * par.cp
        size_factors(device, 1 << np.arange(1, pool.bit_length()))  # a size its cp_shard lacks fails here, not mid-plan
        return cls(cost_model_for(one), comm, -(-config.max_tokens // par.cp), pool, device)

    def attention_share(self, q: np.ndarray, p: np.ndarray, s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Forward and backward attention of each segment on one GPU of its subgroup."""
        return shard_share(self.model, self.device, q, p, s)  # `cost.cp_price`, as fixed CP's

    def estimate(self, q: np.ndarray, p: np.ndarray, s: np.ndarray) -> np.ndarray:
        """Forward + backward seconds a segment adds to each GPU of its subgroup (the planner's balancing weight:
        linear part at its per-token rate, CP traffic as if the segment had its subgroup to itself)."""
        s = np.asarray(s, dtype=np.int64)
        fa, ba = self.attention_share(q, p, s)
        rate = float(self.model.coeffs[LIN_FWD + 1] + self.model.coeffs[LIN_BWD + 1])
        cf, cb = self.comm.times_array(q, s)
        return fa + ba + rate * np.asarray(q, dtype=np.float64) / s + cf + cb

    def slot_times(self, placed: Placed, slots: int) -> SlotTimes:
        G = self.pool
        fa, ba = self.attention_share(placed.q, placed.p, placed.size)
        size = np.asarray(placed.size, dtype=np.int64)
        k = np.repeat(np.arange(len(size)), size)  # (segment, GPU) pairs, as bincount keys slot x G + GPU
        gpu = placed.first[k] + np.arange(len(k)) - np.repeat(np.cumsum(size) - size, size)
        key = placed.m[k] * G + gpu

        def per_gpu(w: np.ndarray) -> np.ndarray:
            return np.bincount(key, weights=w[k], minlength=slots * G).reshape(slots, G)

        own_f, own_b = per_gpu(fa), per_gpu(ba)
        tok = per_gpu(placed.q / size)
        wide = np.nonzero(size > 1)[0]
        if len(wide):  # one K/V exchange per (slot, subgroup) over its documents' tokens
            gk = np.stack([placed.m[wide], placed.first[wide], size[wide]], axis=1)
            groups, inv = np.unique(gk, axis=0, return_inverse=True)
            inv = inv.ravel()
            n = np.bincount(inv, weights=placed.q[wide].astype(np.float64), minlength=len(groups))
            af = np.bincount(inv, weights=fa[wide], minlength=len(groups))
            ab = np.bincount(inv, weights=ba[wide], minlength=len(groups))
            for j, (m, f, s) in enumerate(groups.tolist()):
                cf, cb = self.comm.times(float(n[j]), s, float(af[j]), float(ab[j]))
                own_f[m, f:f + s] += cf
                own_b[m, f:f + s] += cb
        held = tok > 0
        lf = lin_times(self.model.coeffs, tok.ravel(), False)
        lb = lin_times(self.model.coeffs, tok.ravel(), True)
        own_f += np.where(held, lf.reshape(tok.shape), 0.0)
        own_b += np.where(held, lb.reshape(tok.shape), 0.0)
        blocks = connected_blocks(placed, slots, G)
        return SlotTimes(own_f, own_b, block_max(own_f, blocks), block_max(own_b, blocks), tok)


def connected_blocks(placed: Placed, slots: int, pool: int) -> np.ndarray:
    """block[m, g]: the first GPU of g's connected block in slot m (aligned subgroups nest, so a larger one
    placed over smaller ones takes them in)."""
    first = np.tile(np.arange(pool, dtype=np.int64), (slots, 1))
    size = np.ones((slots, pool), dtype=np.int64)
    wide = np.nonzero(placed.size > 1)[0]  # size 1 joins no block
    for k in wide[np.argsort(-placed.size[wide], kind="stable")]:
        m, f, s = int(placed.m[k]), int(placed.first[k]), int(placed.size[k])
        if size[m, f] < s:
            first[m, f:f + s] = f
            size[m, f:f + s] = s
    return first


def block_max(t: np.ndarray, blocks: np.ndarray) -> np.ndarray:
    """Each (slot, GPU)'s time raised to its connected block's slowest member."""
    key = (np.arange(t.shape[0])[:, None] * t.shape[1] + blocks).ravel()
    top = np.full(t.size, -np.inf)
    np.maximum.at(top, key, t.ravel())
    return top[key].reshape(t.shape)


def placed_of(plan) -> tuple[Placed, int]:
    """The unique placed segments of a per-document CP StepPlan (each listed by its subgroup's first GPU) and its
    slot count: what `DynamicCPCost.slot_times` prices, for plans from any planner (a peer's included)."""
    rows = []
    for g, rank in enumerate(plan.ranks):
        for m, mb in enumerate(rank.micro_batches):
            for s, c in zip(mb.segments, mb.cp or []):
                if c.first == g:
                    rows.append((s.end - s.start, s.start - s.attend_from, m, c.first, c.size))
    a = np.array(rows, dtype=np.int64).reshape(-1, 5)
    slots = max((len(r.micro_batches) for r in plan.ranks), default=0)
    return Placed(a[:, 0], a[:, 1], a[:, 2], a[:, 3], a[:, 4]), slots


def priced_dynamic(plan, cost: DynamicCPCost):
    """A copy of a per-document CP StepPlan with every micro-batch's cost from `cost` (waits included), so plans
    of different planners are priced alike."""
    placed, slots = placed_of(plan)
    t = cost.slot_times(placed, slots)
    ranks = []
    for g, rank in enumerate(plan.ranks):
        mbs = [msgspec.structs.replace(mb, fwd_cost=float(t.synced_fwd[m, g]) if mb.segments else 0.0,
                                       bwd_cost=float(t.synced_bwd[m, g]) if mb.segments else 0.0)
               for m, mb in enumerate(rank.micro_batches)]
        ranks.append(msgspec.structs.replace(rank, micro_batches=mbs))
    return msgspec.structs.replace(plan, ranks=ranks)


def idle_share(plan, cost: DynamicCPCost, step_time: float) -> float:
    """Share of the pool's GPU time not spent on its own work (pipeline bubbles, waits for subgroup peers, DP
    waiting) in a per-document CP plan: 1 - own work / (GPUs x pp x step time)."""
    placed, slots = placed_of(plan)
    t = cost.slot_times(placed, slots)
    busy = float(t.own_fwd.sum() + t.own_bwd.sum())
    return 1.0 - busy / (cost.pool * step_time) if step_time > 0 else 0.0
