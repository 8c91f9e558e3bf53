"""Positions and labels of documents longer than the context, end to end: planners cut them into pieces at
multiples of `context` (some sliced by slimpack), the collate fills each micro-batch. Reference: a document's
token t sits at position t % context (its piece restarts at 0, its slices continue the piece) and predicts the
document's token t + 1, and a step's loss tokens are its documents' tokens minus one each."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from packloader.balancers.offline import plan_run
from packloader.collate.batch import IGNORE_INDEX
from packloader.collate.collate import collate_step, loss_tokens_in_plan
from packloader.contracts import ParallelConfig, PlanConfig


@settings(max_examples=25, deadline=None)
@given(lengths=st.lists(st.integers(1, 400), min_size=1, max_size=12), context=st.integers(16, 96),
       strategy=st.sampled_from(["slimpack", "wlb", "fixed"]), dp=st.integers(1, 3), seed=st.integers(0, 99))
def test_positions_are_offsets_in_the_piece_and_labels_the_next_token(lengths, context, strategy, dp, seed):
    rng = np.random.default_rng(seed)
    docs = {d: rng.integers(0, 50_000, size=n).astype(np.int32) for d, n in enumerate(lengths)}
    max_tokens = context if strategy != "slimpack" else context // 2  # slimpack slices pieces over the cap
    cfg = PlanConfig(strategy=strategy, parallel=ParallelConfig(dp=dp, pp=2), max_tokens=max_tokens,
                     context=context, tokens_per_step=300, allow_slicing=strategy == "slimpack")
    run = plan_run(np.array(lengths, np.int64), cfg, steps=50)
    seen = {d: np.zeros(len(t), np.int64) for d, t in docs.items()}
    sliced = 0
    for plan in run.plans:
        step_loss = loss_tokens_in_plan(plan, {d: len(t) for d, t in docs.items()})
        counted = 0
        for r, rank in enumerate(plan.ranks):
            mbs = [mb.segments for mb in rank.micro_batches]
            out = collate_step(mbs, docs, step=plan.step, loss_tokens_in_step=step_loss)
            for segs, b in zip(mbs, out):
                pos, lab = b.position_ids.tolist(), b.labels.tolist()
                at = 0
                for s in segs:
                    sliced += s.attend_from < s.start
                    t = np.arange(s.start, s.end)
                    assert pos[at : at + len(t)] == (t % context).tolist(), (s, context)
                    want = [int(docs[s.doc][i + 1]) if i + 1 < len(docs[s.doc]) else IGNORE_INDEX for i in t]
                    assert lab[at : at + len(t)] == want
                    if not _merged_elsewhere(plan, r, s):
                        seen[s.doc][s.start : s.end] += 1
                        counted += sum(x != IGNORE_INDEX for x in want)
                    at += len(t)
                assert max(pos, default=0) <= context - 1
                assert b.loss_tokens_in_step == step_loss
        assert counted == step_loss  # the normaliser is what the labels hold, each DP-Merge segment once
    assert all((v == 1).all() for v in seen.values())  # every token once
    assert sum(step for step in (loss_tokens_in_plan(p, {d: len(t) for d, t in docs.items()})
                                 for p in run.plans)) == sum(n - 1 for n in lengths)
    if strategy == "slimpack" and min(max(lengths), context) > max_tokens:  # a piece over the cap: sliced
        assert sliced > 0


def _merged_elsewhere(plan, r, seg) -> bool:
    """A DP-Merge segment is listed on every rank of its group: count it on the first one only."""
    for rank in plan.ranks[:r]:
        for mb in rank.micro_batches:
            if seg in mb.segments:
                return True
    return False
