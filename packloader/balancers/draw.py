"""Drawing a step's pieces from the stream by token budget: the one rule that the loader, `packloader plan` and
`packloader report` share, so that all three see the same steps for the same lengths.

A document longer than `context` is cut into independent pieces of `context` tokens (the last one shorter),
counted from the document's first token. A step takes pieces in stream order until it holds at least
`tokens_per_step` tokens; the piece that crosses the mark belongs to the step, so a step holds fewer than
`tokens_per_step + context` tokens whatever the documents (only an epoch's last step holds fewer than
`tokens_per_step`). The rest of the document that crosses the mark goes to the next steps, in order: the draw
position is a cursor (document, token offset), the offset always a multiple of `context`. Empty documents add no
tokens: they never end a step, and `draw_windows` skips them.

A planner that holds pieces back (wlb's outlier delay) makes a step's tokens differ from its draw. Then the step
draws `draw_target` tokens (tokens_per_step less what is held back on entry: released pieces count against the
budget, `planners.step_budget` caps what runs), and while its plan runs fewer than tokens_per_step it draws that
many more and plans again (`refill`, up to twice tokens_per_step more), as WLB-LLM's loader fills each global batch
past its delayed documents. So every step but the epoch's last holds tokens_per_step within one piece, delay
included, unless the planner holds back more than a step's worth. `StepDrawer` does this
over a lengths array (`packloader plan`); the loader's StepNode does it over its stream.
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


def draw_target(tokens_per_step: int, queued_tokens: int) -> int:
    """Tokens a step draws from the stream: its budget less what the planner holds back on entry."""
    return max(0, int(tokens_per_step) - int(queued_tokens))


# of tokens_per_step: the most a step draws beyond tokens_per_step, over its refills. wlb holds outliers until a
# round of one per micro-batch (about tokens_per_step / (0.9 x cap) pieces, so about a step's worth) is full: a
# step may have to draw past a held round to run tokens_per_step
REFILL_MAX = 2.0


def refill(tokens_per_step: int, planned_tokens: int, drawn_tokens: int) -> int:
    """Tokens a step draws more after its plan ran `planned_tokens` of the `drawn_tokens` it drew (0: it is
    full, or it drew tokens_per_step x (1 + REFILL_MAX) already: a planner that holds most pieces back must not
    pull the whole epoch into one step)."""
    room = int((1.0 + REFILL_MAX) * tokens_per_step) - int(drawn_tokens)
    return max(0, min(int(tokens_per_step) - int(planned_tokens), room))


def join_windows(a: Window, b: Window) -> Window:
    """A step's window extended by a later draw (pieces in stream order; the draws meet at a piece boundary)."""
    return Window(np.concatenate([a.doc, b.doc]), np.concatenate([a.offset, b.offset]),
                  np.concatenate([a.length, b.length]))


class StepDrawer:
    """Draws pieces from a lengths array (document id = position; empty documents skipped), `target` tokens at a
    time, continuing where the last draw ended."""

    def __init__(self, lengths: np.ndarray, context: int) -> None:
        lengths = np.asarray(lengths, dtype=np.int64)
        self.ids = np.flatnonzero(lengths > 0)
        self.kept = lengths[self.ids]
        self.context = int(context)
        self.k, self.offset = 0, 0  # cursor: position in `kept`, tokens of it already drawn
        self.first_step = np.full(len(lengths), -1, np.int64)

    @property
    def exhausted(self) -> bool:
        return self.k >= len(self.kept)

    def draw(self, target: int, step: int) -> Window:
        """The next pieces until `target` tokens are drawn (the piece that reaches it included), or all that is
        left; none for a target of 0."""
        if target <= 0 or self.exhausted:
            z = np.zeros(0, np.int64)
            return Window(z, z.copy(), z.copy())
        i, o = self.k, self.offset
        end = step_ends(self.kept[i:], target, self.context, steps=1, offset=o)
        k, e = (int(end[0, 0]) + i, int(end[0, 1])) if len(end) else (len(self.kept), 0)
        j = k + (e > 0)
        starts = np.zeros(j - i, np.int64)
        stops = self.kept[i:j].copy()
        if len(starts):
            starts[0] = o
            if e > 0:
                stops[-1] = e
        fresh = self.ids[i + (o > 0):j]
        self.first_step[fresh[self.first_step[fresh] < 0]] = step
        self.k, self.offset = k, e
        return cut_pieces(self.ids[i:j], self.kept[i:j], self.context, starts, stops).window
