"""Drawing a step's pieces from the stream by token budget: the one rule that the loader, `packloader plan` and
`packloader report` share, so that all three see the same steps for the same lengths.

A document longer than `context` is cut into independent pieces of `context` tokens (the last one shorter),
counted from the document's first token. A step takes pieces in stream order until it holds at least
`tokens_per_step` tokens; the piece that crosses the mark belongs to the step, so a step holds fewer than
`tokens_per_step + context` tokens whatever the documents (only an epoch's last step holds fewer than
`tokens_per_step`). The rest of the document that crosses the mark goes to the next steps, in order: the draw
position is a cursor (document, token offset), the offset always a multiple of `context`. Empty documents add no
tokens: they never end a step, and `draw_windows` skips them.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from packloader.balancers.planners.registry import Window


def step_ends(lengths: np.ndarray, tokens_per_step: int, context: int, *, steps: int | None = None,
              filled: int = 0, offset: int = 0, incomplete: bool = False) -> np.ndarray:
    """The cursor after each step drawn from `lengths`, as rows (document index, token offset): step k holds the
    tokens from cursor k-1 (the first: document 0 at `offset`) up to cursor k. A step that ends with a whole
    document ends at (its index + 1, 0).

    At most `steps` steps. The first step already holds `filled` tokens (a step that began in an earlier batch of
    lengths). Tokens left over that do not reach `tokens_per_step` end one last, incomplete step at
    (len(lengths), 0) when `incomplete`, and are not drawn otherwise.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    bounds = np.concatenate([[0], np.cumsum(lengths)])  # token coordinate of each document's first token
    n, total = len(lengths), int(bounds[-1])
    ends: list[tuple[int, int]] = []
    at = int(offset)  # token coordinate of the cursor
    base = at - int(filled)
    while at < total and (steps is None or len(ends) < steps):
        mark = max(base + int(tokens_per_step), at + 1) - 1  # the token that reaches tokens_per_step
        if mark >= total:
            if incomplete:
                ends.append((n, 0))
            break
        k = int(bounds.searchsorted(mark, side="right")) - 1  # the document holding it
        stop = min(int(lengths[k]), (mark - int(bounds[k])) // context * context + context)  # its piece's end
        ends.append((k + 1, 0) if stop == lengths[k] else (k, stop))
        at = base = int(bounds[k]) + stop
    return np.array(ends, dtype=np.int64).reshape(-1, 2)


class Cut(NamedTuple):
    window: Window
    split_documents: int  # documents longer than the context whose first piece is here
    split_pieces: int  # pieces here of documents longer than the context


def cut_pieces(ids: np.ndarray, lengths: np.ndarray, context: int, start: np.ndarray | None = None,
               stop: np.ndarray | None = None) -> Cut:
    """The pieces of documents drawn in order: tokens start..stop-1 of each document (default: all of it), cut at
    the multiples of `context` counted from the document's first token. `lengths` are whole documents' lengths;
    `start` is a multiple of `context`. The arrays are new, never views of the input."""
    ids = np.asarray(ids, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    start = np.zeros(len(ids), np.int64) if start is None else np.asarray(start, dtype=np.int64)
    stop = lengths if stop is None else np.asarray(stop, dtype=np.int64)
    n_pieces = np.maximum(1, -(-(stop - start) // context))
    long = lengths > context
    if not long.any():
        return Cut(Window(ids.copy(), start.copy(), stop - start), 0, 0)
    doc = np.repeat(ids, n_pieces)
    first = np.repeat(np.cumsum(n_pieces) - n_pieces, n_pieces)
    offset = np.repeat(start, n_pieces) + (np.arange(len(doc), dtype=np.int64) - first) * context
    length = np.minimum(context, np.repeat(stop, n_pieces) - offset)
    return Cut(Window(doc, offset, length), int((long & (start == 0)).sum()), int(n_pieces[long].sum()))


class Drawn(NamedTuple):
    windows: list[Window]
    ends: np.ndarray  # the cursor after each step as (position in `lengths`, token offset) rows: after a whole
    # document, the position after it (offset 0); inside one, its position and the tokens drawn of it
    first_step: np.ndarray  # the step that drew each document's first piece (-1: not drawn)


def draw_windows(lengths: np.ndarray, tokens_per_step: int, context: int, steps: int | None = None, *,
                 incomplete: bool = True) -> Drawn:
    """Each step's pieces from a whole lengths array (document id = position in it; empty documents skipped),
    the cursor after each step, and the step each document was drawn in (its first piece's). At most `steps`
    steps; a last step that does not reach `tokens_per_step` is drawn when `incomplete` (planning a whole run)
    and left out otherwise (comparing full-size steps)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    ids = np.flatnonzero(lengths > 0)
    kept = lengths[ids]
    ends = step_ends(kept, tokens_per_step, context, steps=steps, incomplete=incomplete)
    windows: list[Window] = []
    first_step = np.full(len(lengths), -1, np.int64)
    i, o = 0, 0
    for s, (k, e) in enumerate(ends.tolist()):
        j = k + (e > 0)  # documents i..j-1 have pieces in this step
        starts = np.zeros(j - i, np.int64)
        stops = kept[i:j].copy()
        if len(starts):
            starts[0] = o
            if e > 0:
                stops[-1] = e
        windows.append(cut_pieces(ids[i:j], kept[i:j], context, starts, stops).window)
        first_step[ids[i + (o > 0):j]] = s
        i, o = k, e
    k, e = ends[:, 0], ends[:, 1]
    cursor = np.stack([np.where(e > 0, ids[np.minimum(k, len(ids) - 1)], ids[np.maximum(k - 1, 0)] + 1), e], axis=1) \
        if len(ends) else np.zeros((0, 2), np.int64)
    return Drawn(windows, cursor, first_step)
