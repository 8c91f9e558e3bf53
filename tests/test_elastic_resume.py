"""Elastic resume (issue 21, item 3): a state saved at one layout resumes at another, at a step boundary and
mid-step, and every token of the epoch is trained exactly once over the union of ranks (queued pieces
included), the following steps planned for the new layout. Checked against the documents themselves: each
token's coverage count, and each micro-batch's input_ids against the source."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.distributed import run_ranks
from helpers.docs import tail_with_giant

from packloader import PackedLoader, ParallelConfig, PlanConfig, merge_states
from packloader.contracts import MicroBatch, RankPlan, Segment, StepPlan
from packloader.loader.elastic import remainder
from packloader.sources.base import IterableSource


def corpus(seed: int = 0) -> list[np.ndarray]:
    return tail_with_giant(150, 60, 3000, 11, 9000, seed=seed)


def config(dp: int, strategy: str, **kw) -> PlanConfig:
    """`wlb` queues outliers (delay); `auto` with a context twice max_tokens slices long pieces."""
    slicing = strategy == "auto"
    kw.setdefault("tokens_per_step", 512 * dp)
    kw.setdefault("context", 256)
    kw.setdefault("max_tokens", 128 if slicing else 256)
    return PlanConfig(strategy=strategy, allow_slicing=slicing, parallel=ParallelConfig(dp=dp), **kw)


def make(docs, cfg, rank, state=None, threads=0):
    ld = PackedLoader(IterableSource(docs), config=cfg, tokenizer="bytes", dp_rank=rank, shuffle=False,
                      num_threads=threads)
    if state is not None:
        ld.load_state_dict(state)
    return ld


def take(it, stop, docs, rank, dp, out) -> None:
    """Micro-batches up to `stop` (None: all; an int: that many; (step, i): up to micro-batch i of that step, -1
    its last), each checked against the source; segments go to `out` (a DP-Merge micro-batch once, under its
    group's first rank)."""
    n = 0
    while stop is None or (stop > n if isinstance(stop, int) else True):
        try:
            b = next(it)
        except StopIteration:
            return
        n += 1
        assert len(b.plan.ranks) == dp  # planned for this layout
        if not b.dp_group or rank == min(b.dp_group):
            ids, cu = b.input_ids.numpy(), b.cu_seqlens.numpy()
            for i, s in enumerate(b.segments):
                assert np.array_equal(ids[cu[i]:cu[i + 1]], docs[s.doc][s.start:s.end])
                out.append((s.doc, s.start, s.end))
        if isinstance(stop, tuple) and b.step == stop[0]:
            if b.index_in_step == (stop[1] if stop[1] >= 0 else b.micro_batches_in_step - 1):
                return


def lost_and_repeated(docs, segments) -> tuple[int, int]:
    cover = [np.zeros(len(d), np.int64) for d in docs]
    for d, a, b in segments:
        cover[d][a:b] += 1
    return sum(int((c == 0).sum()) for c in cover), sum(int(np.maximum(c - 1, 0).sum()) for c in cover)


def phase(docs, cfg, state, counts, out) -> list[dict]:
    """Ranks of one layout in one process: rank r yields counts[r] micro-batches; every rank's state after."""
    loaders = [make(docs, cfg, r, state) for r in range(cfg.parallel.dp)]
    for r, ld in enumerate(loaders):
        take(iter(ld), counts[r], docs, r, cfg.parallel.dp, out)
    states = [ld.state_dict() for ld in loaders]
    for ld in loaders:
        ld.close()
    return states


@pytest.mark.parametrize("counts", [([(3, 0), (3, 0)], [(9, 1), (9, 1), (9, 1), (9, 1)]),
                                    ([(0, 0), 0], [0, 0, 0, 0]),
                                    ([(2, 0), (2, -1)], [(6, 0), (6, -1), (6, 2), (6, 0)]),
                                    ([(5, -1), (5, 1)], [(12, -1), (12, -1), (12, -1), (12, 0)])])
def test_layout_changes_mid_step_train_every_token_once(counts):
    """dp 2 (wlb: delay) -> 4 (auto: slicing) -> 1 (wlb); ranks stop at different micro-batches of one step (a
    rank that finished the step stands after it; a stop past a rank's micro-batch count means its last; 0: a
    rank that has not yielded anything since the start or the resume)."""
    docs = corpus()
    seen: list = []
    states = phase(docs, config(2, "wlb"), None, counts[0], seen)
    states = phase(docs, config(4, "auto"), merge_states(states), counts[1], seen)
    phase(docs, config(1, "wlb"), merge_states(states), [None], seen)
    assert lost_and_repeated(docs, seen) == (0, 0)


def test_a_state_saved_at_a_step_boundary_resumes_alone_at_another_layout():
    """Rank 0's state at the end of a step, alone, resumes at dp 3 with another planner and tokens_per_step;
    with what both old ranks trained up to that step's end, every token is trained once."""
    docs = corpus(1)
    seen: list = []
    ld = make(docs, config(2, "wlb"), 0)
    it = iter(ld)
    while True:  # to the end of a step
        b = next(it)
        if b.index_in_step == b.micro_batches_in_step - 1 and b.step >= 3:
            break
    step = b.step
    state = ld.state_dict()
    ld.close()
    assert state["loader"]["skip"] == 0
    first = [make(docs, config(2, "wlb"), r) for r in range(2)]
    for r, ld in enumerate(first):  # what both old ranks trained up to that step's end
        take(iter(ld), (step, -1), docs, r, 2, seen)
        ld.close()
    phase(docs, config(3, "auto", tokens_per_step=700), state, [None, None, None], seen)
    assert lost_and_repeated(docs, seen) == (0, 0)


def test_what_cannot_be_honoured_is_refused_naming_it():
    docs = corpus(2)
    ld = make(docs, config(2, "wlb"), 0)
    it = iter(ld)
    next(it)
    mid = ld.state_dict()
    ld.close()
    assert mid["loader"]["skip"] == 1
    with pytest.raises(ValueError, match=r"merge_states\(\[state of rank 0, \.\.\., state of rank 1\]\)"):
        make(docs, config(4, "wlb"), 0, mid)
    with pytest.raises(ValueError, match=r"config.context: saved 256, now 128"):
        make(docs, config(2, "wlb", max_tokens=128, context=128), 0, merge_states([mid, dict(mid, fingerprint=dict(
            mid["fingerprint"], dp_rank=1))]))
    with pytest.raises(ValueError, match="one state of each of the 2 DP ranks"):
        merge_states([mid])
    other = make(docs, config(2, "wlb", seed=5), 1)
    with pytest.raises(ValueError, match="config.seed: saved 5, now 0"):
        merge_states([mid, other.state_dict()])
    other.close()


def test_remainder_of_a_hand_made_plan():
    """Rank 0 trained its first micro-batch, rank 1 none; document 5's piece is sliced over rank 0's two
    micro-batches (its first slice trained), document 6's over rank 1's (none trained); a DP-Merge micro-batch
    of both ranks at position 1 counts as rank 0's (trained only if rank 0 passed it)."""
    S = Segment
    merged = MicroBatch(segments=[S(9, 0, 50, 0)], dp_group=[0, 1])
    plan = StepPlan(step=4, ranks=[
        RankPlan(micro_batches=[MicroBatch(segments=[S(1, 0, 10, 0), S(5, 0, 40, 0)]), merged,
                                MicroBatch(segments=[S(5, 40, 100, 0), S(2, 256, 300, 256)])]),
        RankPlan(micro_batches=[MicroBatch(segments=[S(6, 0, 30, 0)]), merged,
                                MicroBatch(segments=[S(6, 30, 64, 0), S(3, 0, 8, 0)])]),
    ])
    got = sorted(remainder(plan, [1, 0]))
    assert got == sorted([(5, 40, 60), (2, 256, 44), (6, 0, 64), (3, 0, 8), (9, 0, 50)])
    assert sorted(remainder(plan, [2, 0])) == sorted([(5, 40, 60), (2, 256, 44), (6, 0, 64), (3, 0, 8)])


def first_draw_steps(docs, cfg) -> list[int]:
    """doc -> the step it was first drawn in, from an uninterrupted run's cumulative document counts (file order:
    document d is first drawn at the first step whose count passes d)."""
    upto: dict[int, int] = {}
    for r in range(cfg.parallel.dp):
        for b in make(docs, cfg, r):
            upto[b.step] = b.stats.documents
    counts = [upto[s] for s in sorted(upto)]
    return [next(k for k, n in enumerate(counts) if d < n) for d in range(len(docs))]


def test_the_remainder_step_counts_the_delay_of_a_continued_document():
    """Saved mid-step at dp 2 inside document 11 (9000 tokens over several steps), resumed at dp 1: the records of
    the remainder step and the steps after count each trained token's delay from its document's first draw."""
    docs = corpus()
    old = config(2, "wlb")
    drawn = first_draw_steps(docs, old)
    s = next(k for k in range(drawn[11] + 1, drawn[11] + 4) if drawn[12] > k)  # a step inside document 11's rest
    states = phase(docs, old, None, [(s, 0), (s, 0)], [])
    # the same tokens_per_step: the steps draw what the dp 2 run drew, so `drawn` holds after the resume too
    resumed = make(docs, config(1, "wlb", tokens_per_step=old.tokens_per_step), 0, merge_states(states))
    checked = continued = 0
    for b in resumed:
        delays = [(b.step - drawn[g.doc], g.end - g.start) for g in b.segments]
        if b.step == s:  # the remainder step: document 11's untrained pieces among them
            continued += sum(n for (d, n), g in zip(delays, b.segments) if d > 0 and g.doc == 11)
        m = b.step_metrics
        if b.index_in_step == 0:
            step_delays = []
        step_delays += delays
        if b.index_in_step == b.micro_batches_in_step - 1:
            tokens = sum(n for _, n in step_delays)
            assert m.tokens == tokens
            assert m.delayed_tokens == sum(n for d, n in step_delays if d > 0), b.step
            assert m.delay_max == max((d for d, n in step_delays if n), default=0), b.step
            assert m.delay_mean == pytest.approx(sum(d * n for d, n in step_delays) / tokens, abs=1e-12)
            checked += 1
    resumed.close()
    assert checked > 3 and continued > 0


# --- over gloo: one process per rank ----------------------------------------------------------------------------


def _gloo_phase(rank, world, docs, strategy, state, count):
    cfg = config(world, strategy)
    ld = PackedLoader(IterableSource(docs), config=cfg, tokenizer="bytes", shuffle=False, num_threads=2)
    if state is not None:
        ld.load_state_dict(state)
    out: list = []
    take(iter(ld), count, docs, rank, world, out)
    st = ld.state_dict()
    ld.close()
    return out, st


@pytest.mark.multiprocess
def test_dp_2_to_4_to_1_over_gloo_with_slicing_and_delay():
    """Each layout's ranks are processes of a gloo group (plans checked across ranks); every rank stops after
    the same number of micro-batches, mid-step; the token coverage over the three layouts is the epoch's."""
    docs = corpus(4)
    seen: list = []
    state = None
    for world, strategy, count in ((2, "wlb", 7), (4, "auto", 5), (1, "wlb", None)):
        results = run_ranks(_gloo_phase, world, docs, strategy, state, count, timeout=300)
        for out, _ in results:
            seen += out
        states = [st for _, st in results]
        if count is not None:
            assert any(st["loader"]["skip"] for st in states)  # saved mid-step
        state = merge_states(states)
    assert lost_and_repeated(docs, seen) == (0, 0)
    assert sum(b - a for _, a, b in seen) == sum(len(d) for d in docs)
