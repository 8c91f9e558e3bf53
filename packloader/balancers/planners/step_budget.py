"""A step's token budget counts what it runs from the queue: pieces held back in earlier steps (WLB's outlier
delay) and released now take the place of newly drawn ones instead of coming on top. In queue order (held-back
pieces oldest first, then the new ones in stream order) the piece that reaches tokens_per_step is the last to
run, as a drawn step's last piece is; the rest wait for the next step, oldest first. So every step holds fewer
than tokens_per_step + context tokens, delay included, as WLB-LLM keeps each global batch's size. A flush (the
epoch's end) plans everything. wlb applies it after choosing its outliers; `auto` gives its other candidates
the pieces within it (they plan the queue a wlb step left). A planner used on its own with no queue needs no
cut: the draw (`balancers.draw`) already gives it tokens_per_step less what is queued."""

from __future__ import annotations

import numpy as np

from packloader.balancers.planners.packing import Packing, Pieces, QueuedPieces


def over_budget(lengths: np.ndarray, held: np.ndarray, tokens_per_step: int) -> np.ndarray:
    """The pieces that would run (not `held`) beyond the step's budget, as a mask: those after the one whose
    running total reaches `tokens_per_step`."""
    run = np.nonzero(~held)[0]
    out = np.zeros(len(lengths), dtype=bool)
    if len(run):
        last = int(np.searchsorted(np.cumsum(lengths[run]), tokens_per_step, side="left"))
        out[run[last + 1:]] = True
    return out


def subset(pieces: Pieces, idx: np.ndarray) -> Pieces:
    return Pieces(pieces.doc[idx], pieces.offset[idx], pieces.length[idx], pieces.drawn[idx])


def solve_within_budget(planner, pieces: Pieces, layout, model, *, drain: bool = False) -> Packing:
    """`planner.solve` of the pieces within the step's budget; the rest join the packing's queue. A planner that
    keeps the budget itself (`keeps_budget`: it holds pieces back and applies `over_budget` after choosing
    which) and a flush get all the pieces. `drain`: plan all of the pieces within the budget (a flush of
    those), oldest first, as `auto` does when its delay bound rules every candidate out."""
    if layout.flush or (getattr(planner, "keeps_budget", False) and not drain) or not len(pieces):
        return planner.solve(pieces, layout, model)
    surplus = over_budget(pieces.length, np.zeros(len(pieces), dtype=bool), planner.config.tokens_per_step)
    if drain:
        layout = type(layout)(layout.step, True, layout.micro_batches)
    if not surplus.any():
        return planner.solve(pieces, layout, model)
    packing = planner.solve(subset(pieces, np.nonzero(~surplus)[0]), layout, model)
    carried = pieces.held(np.nonzero(surplus)[0])
    own = packing.queued
    if len(own):  # the planner held some back too: one queue, oldest first (a stable sort keeps stream order)
        docs = list(own.docs() if isinstance(own, QueuedPieces) else own) + carried.docs()
        packing.queued = sorted(docs, key=lambda d: d.drawn_step) if docs else []
    else:
        packing.queued = carried
    return packing


__all__ = ["over_budget", "solve_within_budget", "subset"]
