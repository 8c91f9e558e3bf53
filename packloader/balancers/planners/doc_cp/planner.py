"""`dynamic-cp`: context parallelism sized per document over the DP x CP pool (issue 26; megatron-core's hybrid
context parallelism, cost-balanced).

Each step's pieces (the queued ones first) become units: a piece whole, or, where even the whole pool cannot hold
it in one slot (more than G x cap tokens; G = dp x cp GPUs, cap = max_tokens / cp tokens per GPU), its SlimPack
slices, one per slot in order. A unit's CP size is a power of two from 1 to G: the smallest whose shard fits cap,
then doubled while the unit alone would take more than `lift` x the even share of a GPU's step time and doubling
makes it faster (CP traffic included, `cost.cp_comm`). Units are placed longest-first (size, then cost) by
`doc_cp.kernels.place_pieces` on aligned subgroups of micro-batch slots; short documents land side by side at
CP 1. Candidates (slot counts x lifts, and on steps of few documents for the pool also every unit at least 2, 4,
... G GPUs) are priced per GPU (`doc_cp.price`) and simulated per GPU with the configured pipeline schedule;
the fastest wins (ties: fewer slots, then the earlier candidate). With slicing allowed, the winner's sizing is
tried again with every piece on 2, 4, ... or more GPUs run as a chain of as many slices at that fraction of its CP
size, on one subgroup in consecutive slots (`doc_cp.chains`: less CP traffic and per-GPU overhead for the
same tokens per GPU and slot), kept where faster and where the chain's simulated peak memory fits the device.
Then each long piece's CP size is tried on its own, down to a chain of the fewest slices that fit a GPU's cap at
that size, with short pieces beside its slices (`doc_cp.mix`, `mixed`), kept on the same terms.

The StepPlan has cp_mode "dynamic": one RankPlan per pool GPU (dp_rank x cp + cp_rank), micro-batch m of every
GPU in slot m, a unit on s GPUs listed with the same `CPPlacement(s, first)` in micro-batch m of each of them,
its costs what the GPU's micro-batch takes waiting included. Nothing is held back (queued pieces from another
planner's state are planned), so it composes with outlier delay upstream, slicing and pipelines.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import msgspec
import numpy as np

from packloader.balancers.cost.memory import memory_model_for
from packloader.balancers.cost.schedules import dynamic_cp_schedule
from packloader.balancers.planners.doc_cp.chains import chain_peak
from packloader.balancers.planners.doc_cp.kernels import place_pieces
from packloader.balancers.planners.doc_cp.mix import best_mixed
from packloader.balancers.planners.doc_cp.price import DynamicCPCost, Placed, SlotTimes
from packloader.balancers.planners.doc_cp.units import NAME, Units, chained, units_of
from packloader.balancers.planners.packing import Pieces
from packloader.balancers.planners.registry import StepLayout, Window, register_planner
from packloader.balancers.sim.kernels import SCHEDULES
from packloader.balancers.sim.simulator import step_time
from packloader.contracts import CPPlacement, MicroBatch, PlanConfig, PlannerState, RankPlan, Segment, StepPlan

__all__ = ["NAME", "DynamicCPOptions", "DynamicCPPlanner", "Units", "units_of"]
SMALL_UNITS = 8  # units per pool GPU up to which size floors are tried too


class DynamicCPOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`PlanConfig.planner_options["dynamic-cp"]`."""

    exchange: Literal["allgather", "ring"] = "allgather"  # how CP traffic is priced (cost.cp_comm)
    # thresholds, as shares of a GPU's even step time, above which a document's CP size is doubled; 0: never
    # (each document at the smallest size its memory allows, as megatron-core sizes them)
    lifts: tuple[float, ...] = (0.0, 1.0, 0.5, 0.25)
    # on steps of few documents for the pool (up to SMALL_UNITS per GPU), also every unit at least 2, 4, ... GPUs
    floors: bool = True
    # with allow_slicing and a preset model (the memory check), also long pieces as chains of slices at smaller
    # CP sizes (doc_cp.chains), where their simulated peak fits the device; runtime.cp_chains runs them
    chains: bool = True
    # with chains, also each long piece's CP size chosen on its own, down to a chain of the fewest slices that fit,
    # short pieces beside its slices (doc_cp.mix)
    mixed: bool = True


def lifted_sizes(units: Units, cost: DynamicCPCost, lift: float, slots: int) -> np.ndarray:
    """Each unit's CP size under `lift` (module docstring)."""
    size = units.min_size.copy()
    if lift <= 0 or len(size) == 0:
        return size
    est = cost.estimate(units.q, units.p, size)
    share = float((est * size).sum()) / (cost.pool * slots)
    while True:
        grow = (size < cost.pool) & (est > lift * share)
        if not grow.any():
            return size
        est2 = cost.estimate(units.q, units.p, np.where(grow, size * 2, size))
        better = grow & (est2 < est)
        if not better.any():
            return size
        size = np.where(better, size * 2, size)
        est = np.where(better, est2, est)


@dataclass
class Candidate:
    units: Units
    slots: int
    lift: float
    floor: int
    placed: Placed
    times: SlotTimes
    step_time: float


class DynamicCPPlanner:
    """Per-document CP over the DP x CP pool (module docstring)."""

    name = NAME

    def __init__(self, config: PlanConfig, options: DynamicCPOptions | None = None, cost: DynamicCPCost | None = None) -> None:
        self.config = config
        self.options = options or DynamicCPOptions()
        self.cost = cost or DynamicCPCost.for_config(config, self.options.exchange)
        par = config.parallel  # chains' memory check: one pool GPU's tokens, static memory as the layout's
        self.memory = memory_model_for(config.model, msgspec.structs.replace(par, cp=1), config.schedule, config.device,
                                       config.memory_gib) if self.options.chains and config.allow_slicing else None
        self.kind = SCHEDULES[self.schedule()]

    def plan(self, window: Window, state: PlannerState, layout: StepLayout | int) -> tuple[StepPlan, PlannerState]:
        layout = StepLayout.of(layout)
        pieces = Pieces.of(window, state, layout.step)
        units = units_of(pieces, self.cost.cap, self.cost.pool, self.config.allow_slicing)
        best = self.best(units, layout.micro_batches or self.config.num_micro_batches)
        plan = self.step_plan(best.units, best, layout.step)
        return plan, PlannerState(queued=[], extra=dict(state.extra))

    def slot_counts(self, units: Units, pinned: int | None) -> list[int]:
        if pinned:
            return [pinned]
        chain = int(units.rest.max()) + 1 if len(units.rest) else 1
        base = max(1, -(-int(units.q.sum()) // (self.cost.pool * self.cost.cap)), chain)
        counts = {base, base + 1, 2 * base}
        if self.config.parallel.pp > 1:
            counts.add(4 * base)
        return sorted(counts)

    def best(self, units: Units, pinned: int | None) -> Candidate:
        best: Candidate | None = None
        G = self.cost.pool
        # few units for the pool: also every size floor (each unit at least 2, 4, ... G GPUs), where too few short
        # documents are left to fill the gaps that long ones leave
        small = self.options.floors and len(units.q) <= SMALL_UNITS * G
        floors = [1 << k for k in range(G.bit_length()) if 1 << k <= G] if small else [1]
        tries = [(lift, 1) for lift in self.options.lifts or (0.0,)] + [(0.0, f) for f in floors[1:]]
        for slots in self.slot_counts(units, pinned):
            for lift, floor in tries:
                cand = self.candidate(units, slots, lift, floor)
                if best is None or cand.step_time < best.step_time * (1 - 1e-9):
                    best = cand
        assert best is not None
        if self.memory is None:
            return best
        chained = self.best_chained(units, best)
        if not self.options.mixed:
            return chained
        return best_mixed(self.placed, units, best.placed.size, best.slots, chained, self.fits, self.cost.cap,
                          self.cost.estimate)

    def fits(self, cand: Candidate) -> bool:
        """Whether a chained candidate's simulated peak fits the device (`doc_cp.chains`)."""
        par = self.config.parallel
        peak = chain_peak(cand.units, cand.placed, cand.times, self.memory, par.pp, par.vpp, self.kind)
        return peak <= self.memory.limit_bytes()  # type: ignore[union-attr]

    def best_chained(self, units: Units, best: Candidate) -> Candidate:
        """`best`, or the same sizing with every piece on `split` or more GPUs run as a chain of `split` slices at
        1 / split of its CP size (split 2, 4, ... G), where faster and its simulated peak fits the device."""
        base = best
        for split in (1 << k for k in range(1, self.cost.pool.bit_length())):
            cand = self.candidate(units, base.slots, base.lift, base.floor, split)
            if cand is None:  # no piece on `split` GPUs, so none on more
                return best
            if cand.step_time < best.step_time * (1 - 1e-9) and self.fits(cand):
                best = cand
        return best

    def candidate(self, units: Units, slots: int, lift: float, floor: int = 1, split: int = 1) -> Candidate:
        """The placement at `slots` with every size at least `floor` (and pieces on `split` or more GPUs chained,
        `best_chained`; None when none is), grown by one slot until everything fits."""
        size = np.maximum(lifted_sizes(units, self.cost, lift, slots), floor)
        if split > 1:
            got = chained(units, size, split)
            if got is None:
                return None  # type: ignore[return-value]
            units, size = got
        return self.placed(units, size, slots, lift, floor)

    def placed(self, units: Units, size: np.ndarray, slots: int, lift: float = 0.0, floor: int = 1) -> Candidate:
        """`units` at CP sizes `size` placed in `slots` slots, grown by one slot until everything fits."""
        cost = self.cost.estimate(units.q, units.p, size)
        need = -(-units.q // size)
        sliced = (units.after >= 0) | (units.rest > 0)
        idx = np.arange(len(size))
        whole = idx[~sliced][np.lexsort((idx[~sliced], -cost[~sliced], -size[~sliced]))]
        order = np.concatenate([idx[sliced & (units.link == 0)], chain_order(units, cost), whole])
        while True:
            slot, first, ok = place_pieces(order, size, cost, need, units.after, units.rest, units.link, slots,
                                           self.cost.pool, self.cost.cap)
            if ok:
                break
            if slots > len(size) + 1:  # every unit on a slot of its own fits: no more slots can help
                raise ValueError(f"{NAME}: {len(size)} pieces fit no {slots} slots of {self.cost.pool} GPUs x "
                                 f"{self.cost.cap} tokens")
            slots += 1
        placed = Placed(units.q, units.p, slot, first, size)
        times = self.cost.slot_times(placed, slots)
        return Candidate(units, slots, lift, floor, placed, times, self.simulate(times))

    def schedule(self) -> str:
        """The pipeline schedule each pool GPU is simulated with (1F1B where the configured one is per-step)."""
        return dynamic_cp_schedule(self.config.schedule)  # refuses one it cannot price, naming it

    def simulate(self, times: SlotTimes) -> float:
        """The slowest pool GPU's simulated step time (each GPU's own pipeline, waits included)."""
        par = self.config.parallel
        used = (times.tokens > 0).any(axis=1)
        f, b = times.synced_fwd[used], times.synced_bwd[used]
        if par.pp == 1:
            return float((f + b).sum(axis=0).max()) if f.size else 0.0
        return max(step_time(f[:, g], b[:, g], par.pp, schedule=self.schedule(), vpp=par.vpp) for g in range(f.shape[1]))

    def step_plan(self, units: Units, cand: Candidate, step: int) -> StepPlan:
        """The winner as a StepPlan (module docstring); slots no GPU uses are dropped."""
        used = np.nonzero((cand.times.tokens > 0).any(axis=1))[0]
        renum = {int(m): j for j, m in enumerate(used)}
        G = self.cost.pool
        segs: list[list[list[tuple[Segment, CPPlacement]]]] = [[[] for _ in used] for _ in range(G)]
        pl = cand.placed
        for k in range(len(units.q)):
            seg = Segment(int(units.doc[k]), int(units.start[k]), int(units.end[k]), int(units.af[k]))
            at = CPPlacement(int(pl.size[k]), int(pl.first[k]))
            for g in range(at.first, at.first + at.size):
                segs[g][renum[int(pl.m[k])]].append((seg, at))
        ranks = []
        for g in range(G):
            mbs = []
            for j, m in enumerate(used):
                held = segs[g][j]
                mbs.append(MicroBatch(segments=[s for s, _ in held], cp=[c for _, c in held],
                                      fwd_cost=float(cand.times.synced_fwd[m, g]) if held else 0.0,
                                      bwd_cost=float(cand.times.synced_bwd[m, g]) if held else 0.0))
            ranks.append(RankPlan(micro_batches=mbs))
        return StepPlan(step=step, ranks=ranks, planner=NAME, cp_mode="dynamic")


def chain_order(units: Units, cost: np.ndarray) -> np.ndarray:
    """The chains' slices, costliest chain first, each chain's slices in order (its head before its later ones)."""
    heads = np.nonzero((units.link > 0) & (units.after < 0))[0]
    if not len(heads):
        return np.zeros(0, np.int64)
    total = np.array([cost[h:h + units.rest[h] + 1].sum() for h in heads])
    return np.concatenate([np.arange(h, h + units.rest[h] + 1) for h in heads[np.argsort(-total, kind="stable")]])


@register_planner(NAME, options=DynamicCPOptions, report_order=None, cp_pool=True,
                  summary="packloader per-document CP: each document on its own power-of-two GPU subgroup")
def _make(config: PlanConfig, options: DynamicCPOptions, model) -> DynamicCPPlanner:
    if config.cp_mode == "fixed":  # its plans need a runtime that runs per-document subgroups: opted into
        raise ValueError(f"strategy {NAME!r} plans per-document context parallelism; expected PlanConfig.cp_mode="
                         "'dynamic' (a runtime that runs per-document CP subgroups) or 'auto'")
    return DynamicCPPlanner(config, options)
