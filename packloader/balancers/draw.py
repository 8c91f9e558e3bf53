"""Drawing a step's documents from the stream by token budget, and cutting documents longer than the context into
pieces: the one rule that the loader, `packloader plan` and `packloader report` share, so that all three see the
same steps for the same lengths.

A step takes documents in stream order until it holds at least `tokens_per_step` tokens; the document that crosses
the mark belongs to the step. A document longer than `context` becomes independent pieces of `context` tokens (the
last one shorter). Empty documents add no tokens: they never end a step, and `draw_windows` skips them.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from packloader.balancers.planners.registry import Window


def step_ends(lengths: np.ndarray, tokens_per_step: int, *, steps: int | None = None, filled: int = 0,
              incomplete: bool = False) -> np.ndarray:
    """Where each step drawn from `lengths` ends: step k holds documents ends[k-1]..ends[k]-1 (ends[-1] = 0).

    At most `steps` steps. The first step already holds `filled` tokens (a step that began in an earlier batch of
    lengths). Documents left over that do not reach `tokens_per_step` end one last, incomplete step at
    len(lengths) when `incomplete`, and are not drawn otherwise.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    csum = np.cumsum(lengths)
    n = len(csum)
    ends: list[int] = []
    start, base = 0, -int(filled)
    while start < n and (steps is None or len(ends) < steps):
        k = int(csum.searchsorted(base + tokens_per_step, side="left"))
        if k >= n:
            if incomplete:
                ends.append(n)
            break
        end = max(k, start) + 1  # a step takes at least one document
        ends.append(end)
        base = int(csum[end - 1])
        start = end
    return np.array(ends, dtype=np.int64)


class Cut(NamedTuple):
    window: Window
    split_documents: int  # documents longer than the context
    split_pieces: int  # the pieces those became


def cut_pieces(ids: np.ndarray, lengths: np.ndarray, context: int) -> Cut:
    """The pieces of documents drawn in order: whole documents, and each document longer than `context` cut into
    independent pieces of `context` tokens (the last one shorter). The arrays are new, never views of the input."""
    ids = np.asarray(ids, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    n_pieces = np.maximum(1, -(-lengths // context))
    long = n_pieces > 1
    if not long.any():
        return Cut(Window(ids.copy(), np.zeros(len(ids), np.int64), lengths.copy()), 0, 0)
    doc = np.repeat(ids, n_pieces)
    first = np.repeat(np.cumsum(n_pieces) - n_pieces, n_pieces)
    offset = (np.arange(len(doc), dtype=np.int64) - first) * context
    length = np.minimum(context, np.repeat(lengths, n_pieces) - offset)
    return Cut(Window(doc, offset, length), int(long.sum()), int(n_pieces[long].sum()))


def draw_windows(lengths: np.ndarray, tokens_per_step: int, context: int, steps: int | None = None, *,
                 incomplete: bool = True) -> tuple[list[Window], np.ndarray]:
    """Each step's pieces from a whole lengths array (document id = position in it; empty documents skipped), and
    the position in `lengths` after each step's last document. At most `steps` steps; a last step that does not
    reach `tokens_per_step` is drawn when `incomplete` (planning a whole run) and left out otherwise (comparing
    full-size steps)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    ids = np.flatnonzero(lengths > 0)
    lengths = lengths[ids]
    ends = step_ends(lengths, tokens_per_step, steps=steps, incomplete=incomplete)
    windows: list[Window] = []
    start = 0
    for end in ends.tolist():
        windows.append(cut_pieces(ids[start:end], lengths[start:end], context).window)
        start = end
    return windows, ids[ends - 1] + 1
