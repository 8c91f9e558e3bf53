"""Range and consistency checks of a saved loader state against the source and the plan it describes.

`check_state` (state.py) checks the state's shape and that it was saved by a loader configured like this one;
these checks catch a state whose numbers do not describe a point of this loader's stream (edited, or built by
hand): resuming one would drop or repeat tokens without a word (`pos = -3` repeats documents, `pos = 10^9` skips
the rest of the epoch, `skip = 10000` drops a step's micro-batches). Each check refuses with a ValueError naming
the field, its value and what was expected.

One function per field group (the pass, the cursor, the planner's queue, the counts), so a change of the state's
shape touches one of them. The rules they rely on, from how `StepNode` moves (nodes.py):
- a state is at the start (`step_state` None) or holds the StepNode state of a step boundary (`skip` 0) or of
  the start of a step of which `skip` micro-batches were yielded (checked by planning the step: `check_skip`);
- `k` and `stats.steps` both count the steps planned since the start; documents are drawn in order, so
  `stats.documents` is `epochs_completed` whole spans plus the documents before `pos` (all of the span while
  `flushing`, which only a non-empty queue needs);
- a PackedLoader starts at epoch 0 and every epoch of a non-empty source completes, so `epoch` equals
  `stats.epochs_completed` (a DataLoader worker starts at the pass's first epoch: `epoch` is at least that);
- queued pieces are of documents of the current epoch already drawn (id = epoch * N + position), each inside
  its document, whose length `queued_lengths` holds and the source confirms;
- `first_drawn` names only the document begun at `pos` and queued ones, each drawn first at a step before `k`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from packloader.contracts import LoaderStats

__all__ = ["StateContext", "check_skip", "check_state_values", "source_lengths"]


@dataclass(frozen=True)
class StateContext:
    """What the loading side knows that a saved state must agree with."""

    num_docs: int  # N: the documents of the source (an epoch's stream)
    span: tuple[int, int]  # positions [lo, hi) this loader (or DataLoader worker) plans in each epoch
    step_offset: int = 0  # step number = step_offset + k * step_stride
    step_stride: int = 1
    loader: bool = True  # PackedLoader (starts at epoch 0, keeps pass fields); False: a PackedDataset worker
    max_epochs: int | None = None  # a worker's end of pass (epochs planned up to, exclusive)
    doc_lengths: Callable[[np.ndarray], Sequence[int]] | None = None  # true lengths of document ids (EOS included)


def refuse(field: str, value: Any, expected: str) -> None:
    raise ValueError(
        f"state field {field} = {value!r}: expected {expected}; this is not a state this loader saved (edited or "
        "built by hand?), and resuming it would drop or repeat tokens, so it is refused"
    )


def check_state_values(state: dict, ctx: StateContext) -> None:
    """Every field of a state that passed `check_state`, against the source and the loader (see the module)."""
    st = state["loader"]["step_state"]
    if st is not None:  # the StepNode state first: the fields around it are checked against it
        check_cursor(st, ctx, "loader.step_state")
        check_counts(st, ctx, "loader.step_state")
        check_queue(st, ctx, "loader.step_state")
        check_first_drawn(st, ctx, "loader.step_state")
    check_pass(state, ctx)


def check_pass(state: dict, ctx: StateContext) -> None:
    """The fields around the StepNode state: the epoch the next batch belongs to, the pass, `skip`, the stats."""
    st, skip = state["loader"]["step_state"], state["loader"]["skip"]
    if not ctx.loader:  # a DataLoader worker saves step boundaries only, without pass fields
        for name, want in (("next_epoch", None), ("pass_left", None), ("pass_open", False), ("stats", None)):
            if state[name] != want:
                refuse(name, state[name], f"{want!r} (a DataLoader worker's state has no pass of its own)")
        if skip != 0:
            refuse("loader.skip", skip, "0 (a DataLoader worker resumes at step boundaries)")
        return
    if st is None and skip != 0:
        refuse("loader.skip", skip, "0 at the start (loader.step_state is None)")
    want_epoch = 0 if st is None else st["epoch"]
    if state["next_epoch"] != want_epoch:
        where = "at the start" if st is None else "loader.step_state.epoch"
        refuse("next_epoch", state["next_epoch"], f"{want_epoch} ({where})")
    if state["pass_left"] is not None and state["pass_left"] < 0:
        refuse("pass_left", state["pass_left"], "a count >= 0 of epochs left in the pass, or None (endless)")
    stats = state["stats"]
    if stats is None:
        refuse("stats", None, "the loader's counts (a dict of LoaderStats)")
    _non_negative(stats, "stats")
    if st is None and any(stats.values()):
        refuse("stats", stats, "all counts 0 at the start (loader.step_state is None)")


def check_cursor(st: dict, ctx: StateContext, at: str) -> None:
    """Where the StepNode stands: `epoch`, `pos`, `k`, `flushing`, against the source's span and the counts."""
    lo, hi = ctx.span
    stats = st["stats"]
    done = stats["epochs_completed"]
    if st["epoch"] < 0:
        refuse(f"{at}.epoch", st["epoch"], "an epoch >= 0")
    if ctx.loader and hi > lo and st["epoch"] != done:
        refuse(f"{at}.epoch", st["epoch"], f"{done}, the epochs completed ({at}.stats.epochs_completed)")
    if not ctx.loader and st["epoch"] < done:
        refuse(f"{at}.epoch", st["epoch"], f"at least {done}, the epochs completed ({at}.stats.epochs_completed)")
    if ctx.max_epochs is not None and st["epoch"] > ctx.max_epochs:
        refuse(f"{at}.epoch", st["epoch"], f"at most {ctx.max_epochs}, where this pass ends")
    what = "the documents in this source" if (lo, hi) == (0, ctx.num_docs) else "this worker's positions of an epoch"
    if hi > lo and not lo <= st["pos"] < hi:
        refuse(f"{at}.pos", st["pos"], f"{lo}..{hi - 1}, {what} ({ctx.num_docs} documents)")
    if hi == lo and st["pos"] != lo:
        refuse(f"{at}.pos", st["pos"], f"{lo} (this worker has no documents)")
    offset = st.get("offset", 0)
    if offset < 0 or (offset and (st["flushing"] or hi == lo)):
        refuse(f"{at}.offset", offset, "0, or the tokens already drawn of the document at pos (>= 0) while the epoch "
               "is being drawn")
    if st["k"] != stats["steps"]:
        refuse(f"{at}.k", st["k"], f"{stats['steps']}, the steps planned ({at}.stats.steps)")
    if st["flushing"] and not st["planner"]["queued"]:
        refuse(f"{at}.flushing", True, "False: there is nothing queued to flush (planner.queued is empty)")


def check_counts(st: dict, ctx: StateContext, at: str) -> None:
    """The cumulative counts: non-negative, and the documents drawn matching the cursor."""
    stats = st["stats"]
    _non_negative(stats, f"{at}.stats")
    lo, hi = ctx.span
    width = hi - lo
    inside = 1 if st.get("offset", 0) > 0 else 0  # a step that ended inside the document at `pos` counted it
    whole, part = (stats["epochs_completed"] + 1) * width, stats["epochs_completed"] * width + st["pos"] - lo + inside
    drawn, other = (whole, part) if st["flushing"] else (part, whole)
    if stats["documents"] != drawn and stats["documents"] == other:
        refuse(f"{at}.flushing", st["flushing"], f"{not st['flushing']}: {at}.stats.documents says the epoch is "
               + ("still being drawn" if st["flushing"] else "all drawn, its queue being flushed"))
    if stats["documents"] != drawn:
        how = ("every document of the epochs completed and of this one, which is being flushed" if st["flushing"]
               else f"{stats['epochs_completed']} epochs of {width} documents and {st['pos'] - lo + inside} before pos"
               + (" and the one at pos, begun" if inside else ""))
        refuse(f"{at}.stats.documents", stats["documents"], f"{drawn}: {how}")
    if stats["rank_tokens"] > stats["tokens"]:
        refuse(f"{at}.stats.rank_tokens", stats["rank_tokens"], f"at most {stats['tokens']}, the tokens drawn")


def check_queue(st: dict, ctx: StateContext, at: str) -> None:
    """The planner's queue: pieces of documents of this epoch already drawn, inside documents of the lengths
    `queued_lengths` gives, which the source confirms; and the planner's own counters non-negative."""
    n, (lo, hi) = ctx.num_docs, ctx.span
    epoch, pos = st["epoch"], st["pos"]
    end = hi if st["flushing"] else pos + (1 if st.get("offset", 0) > 0 else 0)  # the one at pos, if begun
    first, last = epoch * n + lo, epoch * n + end  # ids of the documents drawn in this epoch: [first, last)
    next_step = ctx.step_offset + st["k"] * ctx.step_stride
    lengths = {int(d): int(x) for d, x in st["queued_lengths"]}
    queued = st["planner"]["queued"]
    covered: dict[int, list[tuple[int, int]]] = {}
    for i, q in enumerate(queued):
        doc, offset, length, drawn_step = (int(v) for v in q)
        f = f"{at}.planner.queued[{i}]"
        if not first <= doc < last:
            refuse(f"{f}.doc", doc, f"a document of epoch {epoch} already drawn, ids {first}..{last - 1}")
        if doc not in lengths:
            refuse(f"{at}.queued_lengths", sorted(lengths), f"the length of every queued document, {doc} included")
        if offset < 0 or length < 1 or offset + length > lengths[doc]:
            refuse(f"{f}", [doc, offset, length, drawn_step],
                   f"a piece inside document {doc} of {lengths[doc]} tokens (offset >= 0, length >= 1)")
        if not 0 <= drawn_step < next_step:
            refuse(f"{f}.drawn_step", drawn_step, f"a step already planned, 0..{next_step - 1}")
        covered.setdefault(doc, []).append((offset, offset + length))
    for doc, spans in covered.items():
        spans.sort()
        if any(b[0] < a[1] for a, b in zip(spans, spans[1:])):
            refuse(f"{at}.planner.queued", spans, f"pieces of document {doc} that do not overlap")
    if set(lengths) != set(covered):
        refuse(f"{at}.queued_lengths", sorted(lengths), f"the queued documents, {sorted(covered)}")
    if lengths and ctx.doc_lengths is not None:
        ids = np.array(sorted(lengths), dtype=np.int64)
        for d, true in zip(ids.tolist(), ctx.doc_lengths(ids)):
            if int(true) != lengths[d]:
                refuse(f"{at}.queued_lengths[{d}]", lengths[d], f"{int(true)}, the length of document {d} in the source")
    for key, values in st["planner"]["extra"].items():
        if key == "flush" or any(v < 0 for v in values):
            refuse(f"{at}.planner.extra[{key!r}]", values, "a planner's own non-negative counters (never 'flush')")


def check_first_drawn(st: dict, ctx: StateContext, at: str) -> None:
    """The first draw steps of documents drawn over several steps: one per document, each of the document at
    `pos` (begun) or of a queued one, a step already planned and no later than any of its queued pieces' draws."""
    pos_doc = st["epoch"] * ctx.num_docs + st["pos"] if st.get("offset", 0) > 0 and not st["flushing"] else None
    next_step = ctx.step_offset + st["k"] * ctx.step_stride
    queued: dict[int, int] = {}
    for q in st["planner"]["queued"]:
        queued[int(q[0])] = min(queued.get(int(q[0]), int(q[3])), int(q[3]))
    seen: set = set()
    for i, (doc, step) in enumerate(st.get("first_drawn", [])):
        f = f"{at}.first_drawn[{i}]"
        if doc in seen or (doc != pos_doc and doc not in queued):
            begun = f"document {pos_doc}, begun at pos" if pos_doc is not None else "no document begun at pos"
            refuse(f"{f}", [doc, step], f"one pair per document, each of the document begun at pos or of a queued "
                   f"one ({begun}; queued: {sorted(queued) or 'none'})")
        seen.add(doc)
        latest = min(queued.get(doc, next_step - 1), next_step - 1)
        if not 0 <= step <= latest:
            refuse(f"{f}.step", step, f"0..{latest}: a step already planned, no later than the draw of any of "
                   f"document {doc}'s queued pieces")


def check_skip(skip: int, batches: int | None, step: int | None) -> None:
    """`skip` micro-batches of the step planned from the saved state were yielded: fewer than the step has for
    this rank (a step whose micro-batches were all yielded is saved as the next step's start, with skip 0)."""
    if batches is None:
        refuse("loader.skip", skip, "0: the stream has no step after loader.step_state")
    if skip >= batches:
        refuse("loader.skip", skip, f"0..{batches - 1}, the micro-batches this rank has in step {step} "
               "(the step planned from loader.step_state)")


def source_lengths(stream) -> Callable[[np.ndarray], Sequence[int]]:
    """The true lengths of document ids, as the loader plans them: the length column where the source has one,
    else the documents read (and tokenized); used for the few documents a state's queue holds."""

    def lengths(ids: np.ndarray) -> Sequence[int]:
        if stream.has_column_lengths:
            return stream.column_lengths(ids).tolist()
        return [len(t) for t in stream.read(ids)]

    return lengths


def _non_negative(stats: dict, at: str) -> None:
    for name in LoaderStats.__struct_fields__:  # a count added after the state was saved is absent: 0
        if stats.get(name, 0) < 0:
            refuse(f"{at}.{name}", stats[name], "a count >= 0")
