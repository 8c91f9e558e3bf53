"""Drawing steps by token budget and cutting over-long documents (`balancers.draw`) against a plain loop over the
documents written here, and the loader, `plan_run` and the report drawing the same steps for the same lengths."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from packloader.balancers.draw import cut_pieces, draw_windows, step_ends
from packloader.balancers.offline import plan_run
from packloader.balancers.planners.fixed import FixedPlanner
from packloader.balancers.planners.registry import StepLayout
from packloader.contracts import PlanConfig
from packloader.loader.loader import PackedLoader
from packloader.report.draw import draw_steps
from packloader.sources.base import IterableSource


def reference_steps(lengths, tokens_per_step, context, steps=None, incomplete=True, filled=0, offset=0):
    """Each step as a list of (doc, offset, length) pieces, by walking the pieces one at a time: a document
    longer than the context becomes pieces of `context` tokens (the last one shorter); a step takes pieces until
    it holds tokens_per_step tokens (the crossing one included), so a document's later pieces go to the next
    steps; empty documents are skipped. The first step already holds `filled` tokens and starts at token
    `offset` of the first document."""
    out, step, fill = [], [], filled
    for doc, n in enumerate(lengths):
        for off in range(offset if doc == 0 else 0, n, context):
            if steps is not None and len(out) == steps:
                return out
            step.append((doc, off, min(context, n - off)))
            fill += step[-1][2]
            if fill >= tokens_per_step:
                out.append(step)
                step, fill = [], 0
    if step and incomplete and (steps is None or len(out) < steps):
        out.append(step)
    return out


def cursor_after(step, lengths):
    """Where the draw stands after a step: after its last piece's document, or inside it."""
    d, off, n = step[-1]
    return [d + 1, 0] if off + n == lengths[d] else [d, off + n]


def pieces(window):
    return list(zip(window.doc.tolist(), window.offset.tolist(), window.length.tolist()))


lengths_st = st.lists(st.one_of(st.just(0), st.integers(1, 60), st.integers(61, 400)), max_size=80)


@settings(max_examples=200, deadline=None)
@given(lengths_st, st.integers(1, 300), st.integers(1, 100), st.one_of(st.none(), st.integers(0, 6)), st.booleans())
def test_draw_windows_matches_a_plain_loop(lengths, tokens_per_step, context, steps, incomplete):
    windows, ends, first = draw_windows(np.array(lengths, np.int64), tokens_per_step, context, steps,
                                        incomplete=incomplete)
    ref = reference_steps(lengths, tokens_per_step, context, steps, incomplete)
    assert [pieces(w) for w in windows] == ref
    sizes = [sum(n for *_, n in s) for s in ref]  # within one piece of tokens_per_step, an incomplete last one under
    assert all(tokens_per_step <= k < tokens_per_step + context for k in sizes[:-1])
    assert all(k < tokens_per_step + context for k in sizes[-1:])
    assert ends.tolist() == [cursor_after(s, lengths) for s in ref]
    seen = {}
    for k, s in enumerate(ref):
        for d, *_ in s:
            seen.setdefault(d, k)
    assert {d: k for d, k in enumerate(first.tolist()) if k >= 0} == seen


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 400), max_size=60), st.integers(1, 300), st.integers(1, 100), st.data())
def test_step_ends_with_a_step_begun_earlier(lengths, tokens_per_step, context, data):
    filled = data.draw(st.integers(0, tokens_per_step - 1))
    steps = data.draw(st.one_of(st.none(), st.integers(1, 4)))
    incomplete = data.draw(st.booleans())
    offset = data.draw(st.integers(0, max(0, (lengths[0] - 1) // context))) * context if lengths else 0
    ref = reference_steps(lengths, tokens_per_step, context, steps, False, filled, offset)
    ends = [cursor_after(s, lengths) for s in ref]
    # positions: after a whole document, the next one (empty documents after it belong to the next step)
    drawn = any(n for n in lengths[1:]) or (lengths and lengths[0] > offset)
    last = ends[-1] if ends else [0, offset]
    if incomplete and (steps is None or len(ends) < steps) and drawn and \
            sum(lengths[last[0]:]) - last[1] > 0:
        ends.append([len(lengths), 0])
    got = step_ends(np.array(lengths, np.int64), tokens_per_step, context, steps=steps, filled=filled,
                    offset=offset, incomplete=incomplete)
    assert got.tolist() == ends


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 500), max_size=50), st.integers(1, 200))
def test_cut_pieces_matches_a_plain_loop(lengths, context):
    ids = np.arange(1000, 1000 + len(lengths), dtype=np.int64)
    lens = np.array(lengths, np.int64)
    window, split_docs, split_pieces = cut_pieces(ids, lens, context)
    ref, docs, count = [], 0, 0
    for d, n in zip(ids.tolist(), lengths):
        offsets = list(range(0, n, context)) or [0]  # an empty document stays one empty piece
        ref += [(d, o, min(context, n - o)) for o in offsets]
        if len(offsets) > 1:
            docs, count = docs + 1, count + len(offsets)
    assert pieces(window) == ref
    assert (split_docs, split_pieces) == (docs, count)
    assert window.doc.dtype == window.offset.dtype == window.length.dtype == np.int64
    assert not np.shares_memory(window.doc, ids) and not np.shares_memory(window.length, lens)


def test_cut_pieces_of_part_of_a_document():
    """Tokens 8..21 of a 30-token document and 0..4 of another, context 4: pieces keep the document's grid; only
    a first piece counts its document as split."""
    window, split_docs, split_pieces = cut_pieces(np.array([7, 9]), np.array([30, 10]), 4, np.array([8, 0]),
                                                  np.array([22, 4]))
    assert pieces(window) == [(7, 8, 4), (7, 12, 4), (7, 16, 4), (7, 20, 2), (9, 0, 4)]
    assert (split_docs, split_pieces) == (1, 5)


def test_nothing_to_draw():
    for lengths in ([], [0, 0, 0]):
        windows, ends, _ = draw_windows(np.array(lengths, np.int64), 10, 4)
        assert windows == [] and ends.tolist() == []
    assert step_ends(np.zeros(0, np.int64), 10, 4, incomplete=True).tolist() == []
    assert step_ends(np.array([3, 4]), 10, 4, steps=0, incomplete=True).tolist() == []
    window = cut_pieces(np.zeros(0, np.int64), np.zeros(0, np.int64), 4).window
    assert len(window.doc) == len(window.offset) == len(window.length) == 0


def test_a_hand_worked_draw():
    lengths = np.array([5, 0, 3, 9, 1, 1, 1, 20, 2, 4])
    windows, ends, first = draw_windows(lengths, 8, 6)
    # pieces of at most 6: [5, 0, 3] -> 8; [6, 3] -> 9; [1, 1, 1, 6] -> 9, the 20-token document goes on in the
    # next steps: [6, 6] -> 12; [2] and [2, 4] -> 8
    assert ends.tolist() == [[3, 0], [4, 0], [7, 6], [7, 18], [10, 0]]
    assert [pieces(w) for w in windows] == [
        [(0, 0, 5), (2, 0, 3)],
        [(3, 0, 6), (3, 6, 3)],
        [(4, 0, 1), (5, 0, 1), (6, 0, 1), (7, 0, 6)],
        [(7, 6, 6), (7, 12, 6)],
        [(7, 18, 2), (8, 0, 2), (9, 0, 4)],
    ]
    assert first.tolist() == [0, -1, 0, 1, 2, 2, 2, 2, 4, 4]
    assert draw_windows(lengths[:-1], 8, 6, incomplete=False).ends.tolist() == [[3, 0], [4, 0], [7, 6], [7, 18]]


# --- the three users ------------------------------------------------------------------------------------------------


class Recorder:
    """The fixed planner, recording the pieces it is given and whether it was asked to flush."""

    def __init__(self, config: PlanConfig) -> None:
        self.config = config
        self.inner = FixedPlanner(config)
        self.seen: list[tuple[list, bool]] = []

    def plan(self, window, state, step):
        self.seen.append((pieces(window), StepLayout.of(step).flush))
        return self.inner.plan(window, state, step)


def documents(seed: int, n: int, context: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, context // 2, size=n)
    lengths[rng.random(n) < 0.1] = 0  # empty documents
    long = rng.random(n) < 0.1
    lengths[long] = rng.integers(context + 1, 4 * context, size=int(long.sum()))  # cut into pieces
    lengths[-1] = max(1, lengths[-1])  # see test_empty_documents_after_the_last_step_make_one_more_step
    return [rng.integers(0, 1000, size=int(k)).astype(np.int32) for k in lengths]


@pytest.mark.parametrize("seed, chunk_docs, tokens_per_step", [(0, 7, 1024), (1, 256, 1024), (2, 3, 2000)])
def test_loader_plan_run_and_report_draw_the_same_steps(seed, chunk_docs, tokens_per_step):
    cfg = PlanConfig(strategy="fixed", max_tokens=256, context=256, tokens_per_step=tokens_per_step)
    docs = documents(seed, 300, cfg.context)
    lengths = np.array([len(d) for d in docs], np.int64)
    ref = reference_steps(lengths.tolist(), cfg.tokens_per_step, cfg.context)
    assert len(ref) > 5 and any(len({p[0] for p in s}) < len(s) for s in ref)  # several steps, some documents cut

    # the loader: two epochs, in stream order, in chunks of `chunk_docs` documents; each epoch's last step flushes
    recorder = Recorder(cfg)
    loader = PackedLoader(IterableSource(docs), config=cfg, planner=recorder, shuffle=False, num_threads=0,
                          chunk_docs=chunk_docs)
    for _ in range(2):
        list(loader)
    loader.close()
    flushes = [False] * (len(ref) - 1) + [True]
    epoch1 = [[(d + len(docs), o, n) for d, o, n in s] for s in ref]  # epoch e's ids are positions + e * documents
    assert recorder.seen == list(zip(ref, flushes)) + list(zip(epoch1, flushes))

    # plan_run: the same steps, the last one flushed
    recorder = Recorder(cfg)
    run = plan_run(lengths, cfg, steps=10_000, planner=recorder)
    assert recorder.seen == list(zip(ref, flushes))
    assert [pieces(w) for w in run.windows] == ref

    # the report: the complete steps only, drawn from the non-empty documents (ids are positions among those)
    nonempty = np.flatnonzero(lengths > 0)
    draw = draw_steps(lengths[nonempty], cfg.tokens_per_step, cfg.context, steps=10_000)
    complete = reference_steps(lengths.tolist(), cfg.tokens_per_step, cfg.context, incomplete=False)
    assert [[(int(nonempty[d]), o, n) for d, o, n in pieces(w)] for w in draw.windows] == complete


def test_empty_documents_after_the_last_step_make_one_more_step():
    """The loader learns that an epoch ended only when nothing is left to draw: empty documents after the last
    document that ends a step become one more step of no pieces, and that step, not the one before, flushes.
    `plan_run` flushes the last step that has pieces. Every token is planned once either way."""
    cfg = PlanConfig(strategy="fixed", max_tokens=256, context=256, tokens_per_step=256)
    lengths = [100, 200, 256, 0, 0]
    docs = [np.arange(n, dtype=np.int32) for n in lengths]
    ref = reference_steps(lengths, cfg.tokens_per_step, cfg.context)
    assert ref == [[(0, 0, 100), (1, 0, 200)], [(2, 0, 256)]]
    recorder = Recorder(cfg)
    loader = PackedLoader(IterableSource(docs), config=cfg, planner=recorder, shuffle=False, num_threads=0)
    list(loader)
    loader.close()
    assert recorder.seen == [(ref[0], False), (ref[1], False), ([], True)]
    recorder = Recorder(cfg)
    plan_run(np.array(lengths), cfg, steps=100, planner=recorder)
    assert recorder.seen == [(ref[0], False), (ref[1], True)]
