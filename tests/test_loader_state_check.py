"""A saved state is checked against the source and the plan it describes: every genuine state (start, mid-step,
step boundary, while flushing, end of epoch, after the loop, DataLoader workers) loads and continues the
uninterrupted stream; a state with any field changed is refused naming that field, and the loader is left as
it was."""

from __future__ import annotations

import copy

import pytest
from helpers.docs import token_docs, write_token_shards
from helpers.planners import DelayingPlanner

from packloader.balancers.planners.registry import Window
from packloader.contracts import PlanConfig, PlannerState
from packloader.loader.dataset import PackedDataset, _StepIterator
from packloader.loader.loader import PackedLoader
from packloader.sources.base import IterableSource

DOCS = token_docs(60, seed=1)
CFG = PlanConfig(strategy="fixed", max_tokens=256, context=256, tokens_per_step=1024)


class SlowFlushPlanner(DelayingPlanner):
    """Holds long pieces back, and at the epoch's end releases them one per step: the loader saves states
    while flushing (no planner of the registry keeps pieces past the flush, so no other run has them)."""

    def plan(self, window: Window, state: PlannerState, step: int):
        if not state.extra.get("flush") or len(state.queued) < 2:
            return super().plan(window, state, step)
        plan, _ = self.inner.plan(window, PlannerState(queued=list(state.queued[:1])), step)
        return plan, PlannerState(queued=list(state.queued[1:]))


def make(source=None, epochs=2) -> PackedLoader:
    return PackedLoader(IterableSource(DOCS) if source is None else source, config=CFG, tokenizer="bytes",
                        num_threads=0, epochs=epochs, planner=SlowFlushPlanner(CFG, threshold=100))


def key(b) -> tuple:
    return (b.step, b.index_in_step, b.epoch, tuple((s.doc, s.start, s.end) for s in b.segments),
            b.input_ids.numpy().tobytes())


def run_with_states(source=None):
    """The uninterrupted pass's batches, and the state before each batch and after the last (inside the loop),
    then the state after the loop."""
    a = make(source)
    batches, states = [], [a.state_dict()]
    for b in a:
        batches.append(key(b))
        states.append(a.state_dict())
    return batches, states, a.state_dict()


@pytest.fixture(scope="module")
def reference():
    return run_with_states()


def kind(state) -> str:
    st, skip = state["loader"]["step_state"], state["loader"]["skip"]
    if st is None:
        return "start"
    if st["flushing"]:
        return "flushing"
    if skip:
        return "mid-step"
    return "epoch end" if st["pos"] == 0 and st["epoch"] > 0 else "step boundary"


def test_every_genuine_state_loads_and_continues_the_stream(reference):
    batches, states, after = reference
    kinds = {kind(s) for s in states}
    assert kinds == {"start", "mid-step", "step boundary", "flushing", "epoch end"}, kinds
    for i, state in enumerate(states):
        b = make()
        b.load_state_dict(copy.deepcopy(state))
        assert [key(x) for x in b] == batches[i:], (i, kind(state))
    c = make()
    c.load_state_dict(after)  # after the loop: the next pass, two more epochs
    nxt = [key(x) for x in c]
    assert nxt and nxt[0][2] == 2


def test_genuine_states_of_a_pretokenized_source_load(tmp_path):
    """Queued lengths checked against a length column (the Parquet path) rather than read tokens."""
    paths = write_token_shards(tmp_path, DOCS, shards=2)
    batches, states, _ = run_with_states(paths)
    for i in range(0, len(states), 3):
        b = make(paths)
        b.load_state_dict(states[i])
        assert [key(x) for x in b] == batches[i:]


def _at(state, kind_wanted):
    return next(copy.deepcopy(s) for s in state if kind(s) == kind_wanted)


def _set(path, value):
    def change(state):
        node = state
        for p in path[:-1]:
            node = node[p]
        node[path[-1]] = value(node[path[-1]]) if callable(value) else value
    return change


ST = ("loader", "step_state")
TAMPERED = [
    # (kind of state, change, field named, part of what was expected)
    ("mid-step", _set((*ST, "pos"), -3), "loader.step_state.pos = -3", "expected 0..59, the documents in this source"),
    ("mid-step", _set((*ST, "pos"), 10**9), "loader.step_state.pos = 1000000000", "expected 0..59"),
    ("mid-step", _set((*ST, "pos"), lambda p: p + 1), "loader.step_state.stats.documents", "before pos"),
    ("step boundary", _set((*ST, "pos"), lambda p: p - 1), "loader.step_state.stats.documents", "before pos"),
    ("mid-step", _set(("loader", "skip"), 10000), "loader.skip = 10000", "micro-batches this rank has in step"),
    ("start", _set(("loader", "skip"), 1), "loader.skip = 1", "0 at the start"),
    ("mid-step", _set((*ST, "epoch"), 7), "loader.step_state.epoch = 7", "the epochs completed"),
    ("mid-step", _set(("next_epoch",), 7), "next_epoch = 7", "loader.step_state.epoch"),
    ("start", _set(("next_epoch",), 1), "next_epoch = 1", "at the start"),
    ("step boundary", _set((*ST, "k"), lambda k: k + 1), "loader.step_state.k", "the steps planned"),
    ("step boundary", _set((*ST, "flushing"), True), "loader.step_state.flushing = True", "still being drawn"),
    ("epoch end", _set((*ST, "flushing"), True), "loader.step_state.flushing = True", "nothing queued"),
    ("flushing", _set((*ST, "flushing"), False), "loader.step_state.flushing = False", "all drawn"),
    ("step boundary", _set((*ST, "stats", "documents"), lambda d: d - 1), "loader.step_state.stats.documents", ""),
    ("step boundary", _set((*ST, "stats", "epochs_completed"), 1), "loader.step_state.epoch", "epochs completed"),
    ("step boundary", _set((*ST, "stats", "tokens"), -5), "loader.step_state.stats.tokens = -5", "a count >= 0"),
    ("step boundary", _set(("stats", "steps"), -1), "stats.steps = -1", "a count >= 0"),
    ("step boundary", _set(("stats",), None), "stats = None", "the loader's counts"),
    ("start", _set(("stats", "tokens"), 9), "stats = ", "all counts 0 at the start"),
    ("step boundary", _set(("pass_left",), -1), "pass_left = -1", "a count >= 0"),
    ("flushing", _set((*ST, "planner", "queued", 0, 0), lambda d: d + 60), "loader.step_state.planner.queued[0].doc",
     "a document of epoch"),
    ("flushing", _set((*ST, "planner", "queued", 0, 2), lambda n: n + 1), "loader.step_state.planner.queued[0]",
     "a piece inside document"),
    ("flushing", _set((*ST, "planner", "queued", 0, 3), 99), "loader.step_state.planner.queued[0].drawn_step",
     "a step already planned"),
    ("flushing", _set((*ST, "queued_lengths", 0, 1), lambda n: n + 1), "loader.step_state.queued_lengths",
     "the length of document"),
    ("flushing", _set((*ST, "queued_lengths"), lambda q: q + [[0, 5]]), "loader.step_state.queued_lengths",
     "the queued documents"),
    ("flushing", _set((*ST, "planner", "queued"), lambda q: q + q[:1]), "loader.step_state.planner.queued",
     "do not overlap"),
    ("step boundary", _set((*ST, "planner", "extra"), {"flush": [1]}), "loader.step_state.planner.extra['flush']",
     "never 'flush'"),
]


@pytest.mark.parametrize("case", TAMPERED, ids=[f"{i}-{c[2].split(' ')[0]}" for i, c in enumerate(TAMPERED)])
def test_a_tampered_field_is_refused_naming_it(reference, case):
    state_kind, change, field, expected = case
    batches, states, _ = reference
    state = _at(states, state_kind)
    change(state)
    b = make()
    with pytest.raises(ValueError) as info:
        b.load_state_dict(state)
    msg = str(info.value)
    assert msg.startswith("state field " + field.split(" = ")[0]) and field in msg and expected in msg, msg


def test_a_refused_state_leaves_the_loader_where_it_was(reference):
    """Even when the refusal comes from planning the step (`skip`), the loader goes on from its own position."""
    batches, states, _ = reference
    b = make()
    b.load_state_dict(copy.deepcopy(states[4]))
    bad = _at(states, "mid-step")
    bad["loader"]["skip"] = 10000
    with pytest.raises(ValueError, match="loader.skip"):
        b.load_state_dict(bad)
    assert [key(x) for x in b] == batches[4:]


def test_skip_equal_to_the_step_micro_batches_is_refused(reference):
    """The first value past the range: that step's micro-batches were all yielded, which is saved as skip 0."""
    batches, states, _ = reference
    i = next(i for i, s in enumerate(states) if kind(s) == "mid-step")
    state = copy.deepcopy(states[i])
    step = batches[i][0]
    count = sum(1 for b in batches if b[0] == step)
    state["loader"]["skip"] = count
    with pytest.raises(ValueError, match=rf"loader.skip = {count}: expected 0..{count - 1}"):
        make().load_state_dict(state)
    state["loader"]["skip"] = count - 1
    b = make()
    b.load_state_dict(state)
    assert [key(x) for x in b][0] == [x for x in batches if x[0] == step][-1]


def worker_states(worker: int, workers: int):
    ds = PackedDataset(IterableSource(DOCS), config=CFG, tokenizer="bytes", planner=SlowFlushPlanner(CFG, 100),
                       epochs=2)
    it = _StepIterator(ds, worker, workers)
    steps, states = [], [it.state_dict()]
    for batches in it:
        steps.append([key(b) for b in batches])
        states.append(it.state_dict())
    it.close()
    return ds, steps, states


@pytest.mark.parametrize("worker", [0, 1])
def test_worker_states_load_and_tampered_ones_are_refused(worker):
    ds, steps, states = worker_states(worker, 2)
    lo, hi = _StepIterator(ds, worker, 2).span
    for i, state in enumerate(states):
        it = _StepIterator(ds, worker, 2)
        it.load_state_dict(copy.deepcopy(state))
        assert [[key(b) for b in s] for s in it] == steps[i:]
    mid = copy.deepcopy(states[2])
    for change, field in [
        (_set((*ST, "pos"), lo - 1), f"loader.step_state.pos = {lo - 1}: expected {lo}..{hi - 1}"),
        (_set((*ST, "pos"), hi), f"loader.step_state.pos = {hi}: expected {lo}..{hi - 1}"),
        (_set(("loader", "skip"), 1), "loader.skip = 1: expected 0"),
        (_set((*ST, "epoch"), 7), "loader.step_state.epoch = 7: expected at most 2"),
        (_set((*ST, "k"), lambda k: k + 1), "loader.step_state.k"),
        (_set(("next_epoch",), 0), "next_epoch = 0: expected None"),
    ]:
        state = copy.deepcopy(mid)
        change(state)
        with pytest.raises(ValueError, match="state field " + field.replace(".", r"\.").replace("(", r"\(")):
            _StepIterator(ds, worker, 2).load_state_dict(state)

