"""The loader's side of SFT loss masks: every document of a step at hand on every rank, and the drop counts.

A masked source (`sources.sft.SftSource`, `loss_masked = True`) makes the step's loss normaliser depend on each
document's mask, not only its length, so every rank needs the masks of all the step's documents, its own and the
other ranks'. In "local" mode they are at hand already; in "gather" mode (and for pieces delayed across a resume)
the missing ones are read here, which costs what "local" mode costs. Plain sources skip all of this.
"""

from __future__ import annotations

import numpy as np

from packloader.contracts import LoaderStats, StepPlan
from packloader.sources.loss_mask import loss_mask_of
from packloader.sources.stream import DocumentStream


class StepMasks:
    """Reads the masked documents a step needs and counts the SFT outcomes of those drawn."""

    def __init__(self, stream: DocumentStream) -> None:
        self.stream = stream
        self.on = bool(getattr(stream.source, "loss_masked", False))

    def _fill(self, tokens: dict[int, np.ndarray], docs) -> None:
        missing = sorted({int(d) for d in docs} - tokens.keys())
        if missing:
            tokens.update(zip(missing, self.stream.read(missing)))

    def drawn(self, tokens: dict[int, np.ndarray], ids: np.ndarray, starts: np.ndarray, stats: LoaderStats) -> None:
        """Count, once per document (when its first token is drawn), the rows a policy emptied and the documents
        that train with no loss token."""
        if not self.on or not len(ids):
            return
        first = ids[starts == 0]
        self._fill(tokens, first)
        for d in first.tolist():
            t = tokens[d]
            reason = getattr(t, "dropped", None)
            if reason == "no_loss":
                stats.dropped_no_loss += 1
            elif reason == "too_long":
                stats.dropped_too_long += 1
            elif len(t) and (mask := loss_mask_of(t)) is not None and not mask[1:].any():
                stats.no_loss_documents += 1

    def plan_tokens(self, tokens: dict[int, np.ndarray], plan: StepPlan) -> dict[int, np.ndarray] | None:
        """The tokens of every document in the plan (all ranks) when the source is masked; None otherwise."""
        if not self.on:
            return None
        self._fill(tokens, {s.doc for r in plan.ranks for mb in r.micro_batches for s in mb.segments})
        return tokens
