"""The steps a loader would draw from a sequence of document lengths: documents in order until the step holds at
least `tokens_per_step` tokens (the document that crosses the target is included, as `loader.nodes.StepNode`
does), each document longer than `context` cut into independent pieces of `context` tokens (the last one
shorter, as `loader.nodes.cut_pieces` does; `cut_window` is `balancers.offline`'s). Pure numpy: the report
needs no loader, no torch. Unlike `balancers.offline.draw_windows` (for `packloader plan`), only complete
steps are drawn, so every strategy's steps are full-size and comparable."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from packloader.balancers.offline import cut_window
from packloader.balancers.planners.registry import Window


def step_bounds(lengths: np.ndarray, tokens_per_step: int, steps: int | None = None) -> np.ndarray:
    """Document index where each complete step ends (exclusive): step k holds documents bounds[k-1]..bounds[k]-1
    (bounds[-1] = 0). Only steps that reach `tokens_per_step` count; at most `steps` of them."""
    lengths = np.asarray(lengths, dtype=np.int64)
    out: list[int] = []
    csum = np.cumsum(lengths)
    base = 0
    start = 0
    while start < len(lengths) and (steps is None or len(out) < steps):
        k = int(np.searchsorted(csum, base + tokens_per_step, side="left"))
        if k >= len(lengths):
            break  # the rest does not reach a whole step
        out.append(k + 1)
        base = int(csum[k])
        start = k + 1
    return np.asarray(out, dtype=np.int64)


class StepCounter:
    """Counts complete steps while lengths arrive in batches (to stop tokenizing as soon as enough is known)."""

    def __init__(self, tokens_per_step: int, steps: int) -> None:
        self.target, self.steps = int(tokens_per_step), int(steps)
        self.fill = 0
        self.done = 0

    def __call__(self, lengths: np.ndarray) -> bool:
        for v in np.asarray(lengths, dtype=np.int64).tolist():
            if v <= 0:
                continue
            self.fill += v
            if self.fill >= self.target:
                self.done += 1
                self.fill = 0
        return self.done >= self.steps


@dataclass
class Draw:
    """What each step drew. Document ids are positions in the lengths sequence (0, 1, ...)."""

    windows: list[Window]
    lengths: np.ndarray  # every drawn document's length, in draw order (ids 0..n-1)
    doc_step: np.ndarray  # the step that drew each document
    tokens_per_step: int
    context: int
    leftover_documents: int  # documents after the last complete step (not drawn)

    @property
    def steps(self) -> int:
        return len(self.windows)

    @property
    def tokens(self) -> int:
        return int(self.lengths.sum())

    @property
    def docs_cut(self) -> int:
        return int((self.lengths > self.context).sum())

    def pieces(self) -> Window:
        """Every step's pieces, one after the other."""
        return Window(
            np.concatenate([w.doc for w in self.windows]),
            np.concatenate([w.offset for w in self.windows]),
            np.concatenate([w.length for w in self.windows]),
        )


def draw_steps(lengths: np.ndarray, tokens_per_step: int, context: int, steps: int) -> Draw:
    """The first `steps` complete steps of `lengths` (fewer when the lengths run out; none is an error)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if tokens_per_step < 1 or context < 1 or steps < 1:
        raise ValueError(f"tokens_per_step, context and steps must be >= 1, got {tokens_per_step}, {context}, {steps}")
    if (lengths <= 0).any():
        raise ValueError("draw_steps takes non-empty documents only (length >= 1)")
    bounds = step_bounds(lengths, tokens_per_step, steps)
    if len(bounds) == 0:
        raise ValueError(
            f"the documents hold {int(lengths.sum()):,} tokens, fewer than one step of --tokens-per-step "
            f"{tokens_per_step:,}; lower --tokens-per-step or give more data"
        )
    windows = []
    doc_step = np.empty(int(bounds[-1]), np.int64)
    a = 0
    for k, b in enumerate(bounds.tolist()):
        ids = np.arange(a, b, dtype=np.int64)
        windows.append(cut_window(ids, lengths[a:b], context))
        doc_step[a:b] = k
        a = b
    return Draw(windows, lengths[: int(bounds[-1])].copy(), doc_step, int(tokens_per_step), int(context),
                leftover_documents=len(lengths) - int(bounds[-1]))
