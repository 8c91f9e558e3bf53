"""Wider slice-chain candidates of the dynamic-cp planner (issue 26, small steps): each long piece's CP size chosen
on its own, down to a chain of the fewest slices whose shards fit a GPU's cap at that size, with short units
filling the rest of each chain slot's GPUs (SlimPack's packs: slices of long documents beside short ones).

From the best whole-piece candidate's sizes and slot count, first every piece above a target CP size t (1, 2, 4,
...) is run at t (`doc_cp.units.chained_at`), then, piece by piece (costliest first), each other size up to its
own is tried with the rest kept; a change is kept where the simulated step is faster and the chains' simulated
peak fits the device (`DynamicCPPlanner.fits`, `doc_cp.chains.chain_peak`). The piece-by-piece tries (at most
MAX_TRIES placements) run on steps of few units (PER_PIECE_UNITS), where a long piece is a large share of the step.
"""

from __future__ import annotations

from typing import Callable, Protocol, TypeVar

import numpy as np

from packloader.balancers.planners.doc_cp.units import Units, chained_at

MAX_TRIES = 48  # placements priced per step at most, so planning stays well under 0.1 s a step
PER_PIECE_UNITS = 128  # units per step up to which sizes are also tried piece by piece (each try places them all)


class Priced(Protocol):
    step_time: float


C = TypeVar("C", bound=Priced)


def best_mixed(place: Callable[[Units, np.ndarray, int], C], units: Units, size: np.ndarray, slots: int, best: C,
               fits: Callable[[C], bool], cap: int, estimate: Callable[..., np.ndarray]) -> C:
    """`best`, or a candidate with per-piece CP sizes up to the whole-piece sizes `size` of `units` (module
    docstring) placed in `slots` slots (`place`, grown where needed) that is faster and fits (`fits`); `cap`: a
    GPU's tokens per slot; `estimate`: the planner's per-unit cost (`DynamicCPCost.estimate`)."""
    long = (units.after < 0) & (units.rest == 0) & (size > 1)
    if not long.any():
        return best
    tries = 0
    cur = size.copy()

    def better(at: np.ndarray) -> bool:
        nonlocal best, tries
        tries += 1
        got = chained_at(units, size, at, cap)
        cand = None if got is None else place(got[0], got[1], slots)
        if cand is not None and cand.step_time < best.step_time * (1 - 1e-9) and fits(cand):
            best = cand
            return True
        return False

    for t in (1 << k for k in range(int(size[long].max()).bit_length() - 1)):  # every piece above t at t
        at = np.where(long, np.minimum(size, t), size)
        if better(at):
            cur = at
    if len(size) > PER_PIECE_UNITS:
        return best
    est = estimate(units.q, units.p, size)
    for k in np.nonzero(long)[0][np.argsort(-est[long], kind="stable")]:
        for t in (1 << j for j in range(int(size[k]).bit_length())):  # 1, 2, ... size[k]
            if t == cur[k] or tries >= MAX_TRIES:
                continue
            at = cur.copy()
            at[k] = t
            if better(at):
                cur = at
    return best
