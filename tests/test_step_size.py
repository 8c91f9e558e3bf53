"""A step holds `tokens_per_step` within one piece, whatever the documents (issue 21, item 1): a document of
hundreds of steps' tokens goes to the steps after the one that drew it, in order, with its positions and labels
as if it were trained in one step; `num_micro_batches` is honoured on such data or refused with the reason; a
state saved inside such a document resumes exactly. Checked against the documents themselves and against an
uninterrupted run."""

from __future__ import annotations

import numpy as np
import pytest

from packloader import PackedLoader, ParallelConfig, PlanConfig
from packloader.sources.base import IterableSource

CONTEXT = 64
TPS = 256


def corpus(seed: int = 0) -> list[np.ndarray]:
    """Short documents around two giant ones (100 and 40 steps' tokens, not multiples of the context)."""
    rng = np.random.default_rng(seed)
    docs = [rng.integers(0, 256, size=int(k)).astype(np.int32) for k in rng.integers(1, 90, size=60)]
    docs.insert(7, rng.integers(0, 256, size=100 * TPS + 13).astype(np.int32))
    docs.insert(30, rng.integers(0, 256, size=40 * TPS + CONTEXT - 1).astype(np.int32))
    return docs


def config(strategy: str = "fixed", dp: int = 2, **kw) -> PlanConfig:
    kw.setdefault("max_tokens", CONTEXT)
    return PlanConfig(strategy=strategy, context=CONTEXT, tokens_per_step=TPS, parallel=ParallelConfig(dp=dp), **kw)


def run(docs, cfg, dp: int, **kw) -> list[list]:
    loaders = [PackedLoader(IterableSource(docs), config=cfg, tokenizer="bytes", dp_rank=r, shuffle=False,
                            num_threads=0, **kw) for r in range(dp)]
    out = [list(ld) for ld in loaders]
    for ld in loaders:
        ld.close()
    return out


def check_against_documents(docs, ranks) -> dict[int, list]:
    """Every token of every document trained once over the ranks, with the document's own tokens, labels (the
    next token, across pieces too; -100 after the last) and positions (from 0 at each piece's start)."""
    seen: dict[int, list] = {}
    for batches in ranks:
        for b in batches:
            ids, labels, pos = b.input_ids.numpy(), b.labels.numpy(), b.position_ids.numpy()
            cu = b.cu_seqlens.numpy()
            for i, s in enumerate(b.segments):
                d = docs[s.doc]
                a, z = int(cu[i]), int(cu[i + 1])
                assert np.array_equal(ids[a:z], d[s.start:s.end])
                want = np.append(d[s.start + 1:s.end + 1], [] if s.end < len(d) else [-100])
                assert np.array_equal(labels[a:z], want)
                assert np.array_equal(pos[a:z], np.arange(s.start, s.end) - s.attend_from)
                seen.setdefault(s.doc, []).append((s.start, s.end, b.step))
    for doc, spans in seen.items():
        spans.sort()
        assert [a for a, _, _ in spans] == [0] + [z for _, z, _ in spans[:-1]], doc  # no gap, no overlap
        assert spans[-1][1] == len(docs[doc])
    assert sorted(seen) == list(range(len(docs)))
    return seen


@pytest.mark.parametrize("strategy, kw", [("fixed", {}), ("wlb", {}),
                                          ("auto", {"max_tokens": CONTEXT // 2, "allow_slicing": True})])
def test_steps_stay_within_one_piece_of_tokens_per_step(strategy, kw):
    docs = corpus()
    cfg = config(strategy, **kw)
    ranks = run(docs, cfg, 2)
    seen = check_against_documents(docs, ranks)
    plans = {b.step: b.plan for batches in ranks for b in batches}
    steps = sorted(plans)
    assert steps == list(range(len(steps)))
    sizes = [sum(s.end - s.start for r in plans[k].ranks for mb in r.micro_batches for s in mb.segments
                 if not mb.dp_group or r is plans[k].ranks[mb.dp_group[0]]) for k in steps]
    total = sum(len(d) for d in docs)
    assert sum(sizes) == total
    if strategy == "fixed":  # no planner delay: each step trains what it drew
        assert all(TPS <= n < TPS + CONTEXT for n in sizes[:-1]) and 0 < sizes[-1] < TPS + CONTEXT
    else:
        assert max(sizes) < 2 * (TPS + CONTEXT)  # bounded whatever the planner holds back
    # the giant documents' pieces come in order over consecutive steps (~100 and ~40 of them)
    for doc, steps_min in ((7, 100), (30, 40)):
        spans = seen[doc]
        assert len({k for *_, k in spans}) >= steps_min
        assert [k for *_, k in spans] == sorted(k for *_, k in spans)
    stats = ranks[0][-1].stats
    assert stats.split_documents == sum(len(d) > CONTEXT for d in docs) and stats.tokens == total
    # the giant document's rest waits, counted per step held: about 396, 392, ... 4 pieces (4 pieces a step)
    assert stats.delayed_pieces >= 4 * sum(range(99))


@pytest.mark.parametrize("strategy", ["fixed", "wlb", "auto"])
def test_num_micro_batches_is_honoured_on_giant_documents(strategy):
    docs = corpus(1)
    cfg = config(strategy, num_micro_batches=3)  # 3 x dp 2 x 64 = 384 >= 256 + 63
    ranks = run(docs, cfg, 2)
    check_against_documents(docs, ranks)
    counts = {(b.step, b.micro_batches_in_step) for batches in ranks for b in batches}
    assert {m for _, m in counts} == {3}


def test_num_micro_batches_that_cannot_hold_a_step_is_refused_with_the_reason():
    cfg = config("fixed", num_micro_batches=2)  # 2 x 2 x 64 = 256 < 256 + 63
    with pytest.raises(ValueError, match=r"num_micro_batches=2 cannot be honoured.*more than num_micro_batches=2 x "
                                         r"dp=2 x max_tokens=64 = 256.*set num_micro_batches >= 3"):
        run(corpus(), cfg, 2)


def records(batches) -> list:
    return [(b.step, b.index_in_step, [(s.doc, s.start, s.end) for s in b.segments], b.input_ids.tolist(),
             b.labels.tolist(), b.position_ids.tolist()) for b in batches]


@pytest.mark.parametrize("strategy", ["fixed", "wlb"])
def test_a_state_saved_inside_a_giant_document_resumes_exactly(strategy):
    docs = corpus(2)
    cfg = config(strategy, dp=1)
    ref = records(run(docs, cfg, 1)[0])
    inside = [i for i, r in enumerate(ref) if any(d == 7 and 0 < a for d, a, _ in r[2])]
    assert len(inside) > 50
    for cut in inside[3::17] + [inside[-1]]:
        loader = PackedLoader(IterableSource(docs), config=cfg, tokenizer="bytes", shuffle=False, num_threads=0)
        it = iter(loader)
        got = records([next(it) for _ in range(cut + 1)])
        state = loader.state_dict()
        loader.close()
        assert state["loader"]["step_state"]["offset"] % CONTEXT == 0
        again = PackedLoader(IterableSource(docs), config=cfg, tokenizer="bytes", shuffle=False, num_threads=2)
        again.load_state_dict(state)
        got += records(list(again))
        again.close()
        assert got == ref, cut
