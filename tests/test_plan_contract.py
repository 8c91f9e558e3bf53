"""The planner contract is checked on every step's plan before it reaches a batch or a file (issue 35, item 1):
a planner registered from outside whose plan drops a piece, lists one twice, overfills a micro-batch, puts a
slice before its prefix or gives ranks unequal counts is refused by the loader, by `plan_run` and by
`packloader plan --plugin` (exit 2, naming the planner and what broke). The broken planners are the shipped
`fixed` planner's plans edited (tests/plugins/broken_planners.py); the numbers expected are worked out here from
the lengths, not taken from the checker."""

from __future__ import annotations

import sys

import numpy as np
import pytest
from helpers.docs import token_docs

from packloader.balancers.factory import make_planner
from packloader.balancers.offline import plan_run
from packloader.balancers.planners.contract import PlanContractError, check_step_plan
from packloader.balancers.planners.registry import _REGISTRY, StepLayout, Window, load_plugins
from packloader.cli.main import main
from packloader.contracts import MicroBatch, ParallelConfig, PlanConfig, PlannerState, RankPlan, Segment, StepPlan
from packloader.loader.loader import PackedLoader
from packloader.sources.base import IterableSource

MODULE = "plugins.broken_planners"
LENGTHS = np.array([700, 300, 1500, 40, 900, 2000, 60, 1200], np.int64)
CAP = 2048


@pytest.fixture(scope="module", autouse=True)
def plugins():
    load_plugins([MODULE])
    yield
    for name in list(_REGISTRY):
        if name.startswith("broken_"):
            _REGISTRY.pop(name)
    sys.modules.pop(MODULE, None)


def cfg(strategy: str, **kw) -> PlanConfig:
    base = dict(strategy=strategy, parallel=ParallelConfig(dp=2), max_tokens=CAP, context=CAP,
                tokens_per_step=int(LENGTHS.sum()) + 1, model="tiny", cost="analytic")
    return PlanConfig(**{**base, **kw})


def first_segment(strategy: str) -> Segment:
    """The segment the broken planners edit: the first one of the `fixed` plan of the whole window."""
    plan, _ = make_planner(cfg("fixed")).plan(Window.from_lengths(LENGTHS), PlannerState(), StepLayout(0, flush=True))
    return next(mb for r in plan.ranks for mb in r.micro_batches if mb.segments).segments[0]


@pytest.mark.parametrize("name, fragment", [
    ("drop_piece", "tokens of the drawn pieces appear nowhere"),
    ("duplicate_piece", "tokens appear more than once"),
    ("one_micro_batch", f"holds {int(LENGTHS.sum())} tokens, more than max_tokens={CAP}"),
    ("unequal_counts", "ranks hold different numbers of micro-batches"),
    ("slice_out_of_order", "no earlier micro-batch of this rank in this step ends that document"),
])
def test_plan_run_refuses_each_broken_plan_naming_the_planner(name, fragment):
    with pytest.raises(PlanContractError) as e:
        plan_run(LENGTHS, cfg(f"broken_{name}"), steps=None)
    msg = str(e.value)
    assert e.value.planner == f"broken_{name}"
    assert msg.startswith(f"planner 'broken_{name}' (its plan names 'fixed') broke the planner contract at step 0")
    assert fragment in msg, msg
    if name in ("drop_piece", "duplicate_piece"):  # the first segment's tokens, by its own length
        s = first_segment(name)
        assert f"{s.end - s.start} tokens" in msg, msg


def test_the_shipped_planner_passes_the_same_check():
    run = plan_run(LENGTHS, cfg("fixed"), steps=None)
    assert sum(mb.num_tokens for p in run.plans for r in p.ranks for mb in r.micro_batches) == int(LENGTHS.sum())


def test_packloader_plan_refuses_the_plugin_plan_and_writes_nothing(tmp_path, capsys):
    np.save(tmp_path / "l.npy", LENGTHS)
    out = tmp_path / "plan.jsonl"
    args = ["plan", "--lengths", str(tmp_path / "l.npy"), "--plugin", MODULE, "--dp", "2", "--max-tokens", str(CAP),
            "--context", str(CAP), "--tokens-per-step", str(int(LENGTHS.sum()) + 1), "--model", "tiny",
            "--out", str(out)]
    assert main([*args, "--strategy", "broken_one_micro_batch"]) == 2
    err = capsys.readouterr().err
    assert "planner 'broken_one_micro_batch' (its plan names 'fixed') broke the planner contract at step 0" in err
    assert f"holds {int(LENGTHS.sum())} tokens, more than max_tokens={CAP}" in err
    assert not out.exists()
    assert main([*args, "--strategy", "fixed"]) == 0 and out.exists()


def test_the_loader_refuses_the_plan_before_any_batch():
    docs = token_docs(60, seed=3, max_len=300)
    loader = PackedLoader(IterableSource(docs), config=PlanConfig(strategy="broken_drop_piece", max_tokens=256,
                                                                  context=256, tokens_per_step=1024), num_threads=0)
    with pytest.raises(PlanContractError, match=r"planner 'broken_drop_piece' \(its plan names 'fixed'\) broke the planner contract at step 0"):
        next(iter(loader))


def S(doc, start, end, attend_from=None):
    return Segment(doc, start, end, start if attend_from is None else attend_from)


def test_queued_pieces_count_and_the_step_number_is_checked():
    """Hand-built: a piece queued from an earlier step must be planned or queued again; the step asked for."""
    from packloader.contracts import QueuedDoc

    config = PlanConfig(strategy="fixed", max_tokens=8, context=8, tokens_per_step=8)
    window = Window.from_lengths(np.array([5]), first_doc=1)
    queued = PlannerState(queued=[QueuedDoc(0, 0, 3, 0)])
    both = StepPlan(step=4, ranks=[RankPlan(micro_batches=[MicroBatch(segments=[S(0, 0, 3), S(1, 0, 5)])])])
    check_step_plan(both, window, queued, PlannerState(), config, 4)
    with pytest.raises(PlanContractError, match="3 tokens of the drawn pieces appear nowhere"):
        only_new = StepPlan(step=4, ranks=[RankPlan(micro_batches=[MicroBatch(segments=[S(1, 0, 5)])])])
        check_step_plan(only_new, window, queued, PlannerState(), config, 4)
    check_step_plan(StepPlan(step=4, ranks=[RankPlan(micro_batches=[MicroBatch(segments=[S(1, 0, 5)])])]),
                    window, queued, queued, config, 4)  # queued again: fine
    with pytest.raises(PlanContractError, match="numbered step 4, asked for step 5"):
        check_step_plan(both, window, queued, PlannerState(), config, 5)
    with pytest.raises(PlanContractError, match="holds 8 tokens, more than max_tokens=7"):
        check_step_plan(both, window, queued, PlannerState(),
                        PlanConfig(strategy="fixed", max_tokens=7, context=7, tokens_per_step=8), 4)
