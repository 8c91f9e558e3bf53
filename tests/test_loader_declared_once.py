"""Loader options and saved state declared once, as Structs (`LoaderOptions`, `SavedState`, `StepState`): the
loaders' keyword arguments and docs come from the options Struct, and `state_dict()` is the state Struct's plain
form, equal to a state worked out by hand."""

from __future__ import annotations

import inspect

import msgspec
import pytest

from packloader import PackedLoader, PlanConfig
from packloader.loader.state import LoaderOptions, SavedState
from packloader.sources.base import IterableSource

# 30 pre-tokenized documents of 100 tokens (no EOS added to token rows), in file order: a step of tokens_per_step
# 1024 draws documents until it holds 1024 tokens, the document that crosses the mark included: 10 documents hold
# 1000, so a step takes 11 (1100 tokens: micro-batches of 10 and 1 documents under max_tokens 1024); the third
# and last step takes the 8 left (one micro-batch). 5 micro-batches in all.
DOCS = [[7] * 100 for _ in range(30)]
CONFIG = PlanConfig(strategy="fixed", max_tokens=1024, context=1024, tokens_per_step=1024)


ZERO = dict(steps=0, epochs_completed=0, documents=0, tokens=0, split_documents=0, split_pieces=0, empty_documents=0,
            delayed_pieces=0, rank_micro_batches=0, rank_tokens=0, dropped_no_loss=0, dropped_too_long=0,
            no_loss_documents=0)


def _loader(**kw) -> PackedLoader:
    return PackedLoader(IterableSource(DOCS), tokenizer="bytes", config=CONFIG, shuffle=False, num_threads=0, **kw)


def test_keyword_arguments_and_docs_come_from_loader_options():
    fields = {f.name: f.default for f in msgspec.inspect.type_info(LoaderOptions).fields}
    params = inspect.signature(PackedLoader).parameters
    assert {n: params[n].default for n in fields} == fields
    assert all(f"`{n}` (default" in PackedLoader.__doc__ for n in fields)
    with pytest.raises(msgspec.ValidationError, match="prefetchh"):
        _loader(prefetchh=3)
    assert _loader().options.seed == CONFIG.seed  # None: the config's seed
    assert _loader(seed=5).options.seed == 5


def test_state_dict_is_the_state_worked_by_hand():
    loader = _loader()
    start = loader.state_dict()
    assert start["loader"] == {"step_state": None, "skip": 0}
    assert (start["next_epoch"], start["pass_left"], start["pass_open"]) == (0, 0, False)
    assert "ranks" not in start  # only a merged state names every rank's position
    it = iter(loader)
    next(it)
    mid = loader.state_dict()  # inside step 0: resumed by planning step 0 again from the start, one yielded
    fresh = {"epoch": 0, "pos": 0, "offset": 0, "k": 0, "flushing": False, "remainder": None,
             "planner": {"queued": [], "extra": {}}, "queued_lengths": [], "stats": ZERO, "first_drawn": []}
    assert mid["loader"] == {"step_state": fresh, "skip": 1}
    assert (mid["next_epoch"], mid["pass_left"], mid["pass_open"]) == (0, 1, True)
    for _ in it:
        pass
    after = loader.state_dict()  # the pass ran to its end: the next epoch's start
    stats = dict(ZERO, steps=3, epochs_completed=1, documents=30, tokens=3000, rank_micro_batches=5, rank_tokens=3000)
    assert after["loader"] == {"step_state": dict(fresh, epoch=1, k=3, stats=stats), "skip": 0}
    assert (after["next_epoch"], after["pass_left"], after["pass_open"], after["stats"]) == (1, 0, False, stats)
    saved = msgspec.convert(after, SavedState)  # the declared shape holds the state, and gives it back unchanged
    assert msgspec.to_builtins(saved) == after


def test_a_state_missing_a_field_is_refused_naming_it():
    loader = _loader()
    for _ in loader:
        pass
    state = loader.state_dict()
    del state["loader"]["step_state"]["offset"]
    with pytest.raises(ValueError, match=r"incomplete or damaged.*offset"):
        _loader().load_state_dict(state)
