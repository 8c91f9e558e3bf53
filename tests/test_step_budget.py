"""Steps keep their size when documents are delayed (issue 38 part 2): what a planner held back counts against
the step's budget when it runs, and a step whose plan holds pieces back draws more, so every step but the
epoch's last holds tokens_per_step up to tokens_per_step + context - 1 tokens, in the loader and in
`packloader plan` alike, across a resume; every token of every document is trained once."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.docs import tail_with_giant

from packloader.balancers.offline import plan_run
from packloader.balancers.planners.step_budget import over_budget
from packloader.contracts import ParallelConfig, PlanConfig
from packloader.loader.loader import PackedLoader
from packloader.sources.base import IterableSource

TPS, CONTEXT = 8192, 2048


def test_over_budget_by_hand():
    """Queue order [2048, 2048, 100, (held 3000), 5000, 10] against 4000 tokens: 2048 + 2048 reaches it at the
    second piece, so the 100, the 5000 and the 10 wait; the held piece is not counted."""
    lengths = np.array([2048, 2048, 100, 3000, 5000, 10])
    held = np.array([False, False, False, True, False, False])
    assert over_budget(lengths, held, 4000).tolist() == [False, False, True, False, True, True]
    assert not over_budget(lengths, held, 20000).any()  # all of it fits
    assert over_budget(lengths, np.zeros(6, bool), 1).tolist() == [False] + [True] * 5  # the first piece runs


def corpus() -> list[np.ndarray]:
    """One document of 150 steps' tokens among 400 short ones, the issue's case (token ids < 256, the bytes
    tokenizer)."""
    return tail_with_giant(400, 40.0, 2000, 200, 150 * TPS, seed=3)


def config(strategy: str) -> PlanConfig:
    return PlanConfig(strategy=strategy, parallel=ParallelConfig(dp=2), max_tokens=CONTEXT, context=CONTEXT,
                      tokens_per_step=TPS)


def step_tokens(plan) -> int:
    return sum(mb.num_tokens for r in plan.ranks for mb in r.micro_batches)


def check_sizes(sizes: list[int]) -> None:
    body = np.array(sizes[:-1])
    assert (body >= TPS).all() and (body < TPS + CONTEXT).all(), (int(body.min()), int(body.max()))


def check_once(plans, lengths: np.ndarray) -> None:
    """Every token of every document planned exactly once (a count per token, built from the plans alone)."""
    seen = [np.zeros(int(n), np.int64) for n in lengths]
    for p in plans:
        for r in p.ranks:
            for mb in r.micro_batches:
                for s in mb.segments:
                    seen[s.doc][s.start:s.end] += 1
    assert all((x == 1).all() for x in seen)


@pytest.mark.parametrize("strategy", ["wlb", "auto"])
def test_plan_steps_keep_their_size_with_delay(strategy):
    lengths = np.array([len(d) for d in corpus()], np.int64)
    run = plan_run(lengths, config(strategy), None)
    assert any(p.delayed for p in run.plans), "the run must exercise the delay"
    check_sizes([step_tokens(p) for p in run.plans])
    check_once(run.plans, lengths)
    assert sum(step_tokens(p) for p in run.plans) == int(lengths.sum())


def loader(state=None) -> PackedLoader:
    ld = PackedLoader(IterableSource(corpus()), tokenizer="bytes", config=config("wlb"), dp_rank=0, num_threads=1, shuffle=False,
                      chunk_docs=64, epochs=1, seed=0)
    if state is not None:
        ld.load_state_dict(state)
    return ld


def steps_of(ld, stop_after: int | None = None):
    """{step: (tokens trained, delayed tokens)} from the batches' step metrics, and the state after `stop_after`
    steps' batches (None: run to the end)."""
    out, state = {}, None
    for b in ld:
        m = b.step_metrics
        out[b.step] = (m.tokens, m.delayed_tokens)
        if stop_after is not None and b.index_in_step == b.micro_batches_in_step - 1 and len(out) == stop_after:
            state = ld.state_dict()
            break
    return out, state


def test_loader_steps_keep_their_size_match_plan_and_survive_a_resume():
    whole, _ = steps_of(loader())
    sizes = [whole[s][0] for s in sorted(whole)]
    check_sizes(sizes)
    assert sum(d for _, d in whole.values()) > 0, "the loader's run must delay pieces"
    lengths = np.array([len(d) for d in corpus()], np.int64)
    planned = [step_tokens(p) for p in plan_run(lengths, config("wlb"), None).plans]
    assert sizes == planned  # `packloader plan` draws the loader's steps
    first, state = steps_of(loader(), stop_after=40)
    rest, _ = steps_of(loader(state))
    assert {**first, **rest} == whole
