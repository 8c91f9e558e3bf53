"""The complete steps a loader would draw from a sequence of document lengths (`balancers.draw`'s rule), for the
report. Pure numpy: the report needs no loader, no torch. Unlike `packloader plan`, only complete steps are drawn,
so every strategy's steps are full-size and comparable."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from packloader.balancers.draw import draw_windows, step_ends
from packloader.balancers.planners.registry import Window


class StepCounter:
    """Counts complete steps while lengths arrive in batches (to stop tokenizing as soon as enough is known)."""

    def __init__(self, tokens_per_step: int, steps: int, context: int) -> None:
        self.target, self.steps, self.context = int(tokens_per_step), int(steps), int(context)
        self.done = 0
        self.rest = np.zeros(0, np.int64)  # the documents after the last step's end (fewer tokens than a step)
        self.offset = 0  # tokens of rest[0] that the last step drew

    def __call__(self, lengths: np.ndarray) -> bool:
        lengths = np.asarray(lengths, dtype=np.int64)
        lengths = np.concatenate([self.rest, lengths[lengths > 0]])
        ends = step_ends(lengths, self.target, self.context, offset=self.offset)
        self.done += len(ends)
        if len(ends):
            k, self.offset = (int(x) for x in ends[-1])
            lengths = lengths[k:]
        self.rest = lengths
        return self.done >= self.steps


@dataclass
class Draw:
    """What each step drew. Document ids are positions in the lengths sequence (0, 1, ...)."""

    windows: list[Window]
    lengths: np.ndarray  # every drawn document's length, in draw order (ids 0..n-1)
    doc_step: np.ndarray  # the step that drew each document (its first piece)
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
    drawn = draw_windows(lengths, tokens_per_step, context, steps, incomplete=False)
    if len(drawn.ends) == 0:
        raise ValueError(
            f"the documents hold {int(lengths.sum()):,} tokens, fewer than one step of --tokens-per-step "
            f"{tokens_per_step:,}; lower --tokens-per-step or give more data"
        )
    pos, offset = (int(x) for x in drawn.ends[-1])
    end = pos + (offset > 0)  # a document the last step ended inside counts as drawn (its first piece was)
    return Draw(drawn.windows, lengths[:end].copy(), drawn.first_step[:end].copy(), int(tokens_per_step), int(context),
                leftover_documents=len(lengths) - end)
