"""The loader under per-document CP: each GPU of a DP 2 x CP 4 pool gets its part of a dynamic plan (rank
dp_rank * cp + cp_rank), and over the pool every token of every document is trained once per epoch, with the
source's tokens, next-token labels and document positions; the pool's loss tokens add up to each step's normaliser;
an interrupted step leaves, for elastic resume, exactly the segments no CP group trained."""

from __future__ import annotations

from collections import Counter

import msgspec
import numpy as np
import pytest
from helpers.docs import token_docs

from packloader.balancers.planners.fixed import FixedPlanner
from packloader.contracts import CPPlacement, MicroBatch, ParallelConfig, PlanConfig, RankPlan, Segment, StepPlan
from packloader.loader.loader import PackedLoader
from packloader.sources.base import IterableSource

DP, CP = 2, 4
P = CPPlacement


class PoolPlanner:
    """The fixed planner's plan made per-document CP by hand: in DP rank r's micro-batch, pieces of 120 tokens or
    more run on all its CP GPUs, pieces of 40 or more on one of its two pairs, in turn, the others on one GPU each,
    in turn."""

    def __init__(self, config: PlanConfig) -> None:
        self.config, self.inner = config, FixedPlanner(config)

    def plan(self, window, state, layout):
        plan, new_state = self.inner.plan(window, state, layout)
        ranks = []
        for r, rp in enumerate(plan.ranks):
            pool: list[list[MicroBatch]] = [[] for _ in range(CP)]
            for mb in rp.micro_batches:
                parts: list[tuple[list, list]] = [([], []) for _ in range(CP)]
                turn = 0
                for s in mb.segments:
                    n = s.end - s.start
                    size = 4 if n >= 120 else 2 if n >= 40 else 1
                    first = r * CP + (turn * size) % CP
                    turn += 1
                    for g in range(first, first + size):
                        parts[g - r * CP][0].append(s)
                        parts[g - r * CP][1].append(CPPlacement(size, first))
                for c in range(CP):
                    pool[c].append(msgspec.structs.replace(mb, segments=parts[c][0], cp=parts[c][1]))
            ranks.extend(RankPlan(micro_batches=pool[c]) for c in range(CP))
        return msgspec.structs.replace(plan, ranks=ranks, cp_mode="dynamic"), new_state


def _config() -> PlanConfig:
    return PlanConfig(strategy="fixed", parallel=ParallelConfig(dp=DP, cp=CP), max_tokens=512, context=256,
                      tokens_per_step=1500, allow_slicing=False)


def test_dynamic_cp_loader_hands_each_pool_gpu_its_part_once_over_the_pool():
    docs = token_docs(90, seed=5)
    cfg = _config()
    seen: Counter = Counter()
    loss_by_step: Counter = Counter()
    normaliser: dict[int, set] = {}
    sizes: set = set()
    cache: dict = {}
    for gpu in range(DP * CP):
        loader = PackedLoader(IterableSource(docs), config=cfg, planner=PoolPlanner(cfg), dp_rank=gpu // CP,
                              cp_rank=gpu % CP, num_threads=0)
        for b in loader:
            assert b.cp is not None and b.cp.gpu == gpu
            sizes |= {g.size for g in b.cp.groups}
            # each local token's segment (a piece's positions restart at 0: its document offset is start + position)
            segs = [b.segments[i] for i in np.repeat(b.cp.run_segment, np.diff(b.cu_seqlens.numpy()))]
            assert [s.doc for s in segs] == np.repeat(b.doc_ids.numpy(), np.diff(b.cu_seqlens.numpy())).tolist()
            for s in segs:
                if s.doc not in cache:
                    cache[s.doc] = loader.stream.read([s.doc])[0]
            for s, p, t, lab in zip(segs, b.position_ids.tolist(), b.input_ids.tolist(), b.labels.tolist()):
                doc, at = cache[s.doc], s.start + p
                assert s.start <= at < s.end, (gpu, s, p)
                assert t == doc[at] and lab == (doc[at + 1] if at + 1 < len(doc) else -100), (gpu, s, p)
                seen[(s.doc, at)] += 1
            loss_by_step[b.step] += b.num_loss_tokens
            normaliser.setdefault(b.step, set()).add(b.loss_tokens_in_step)
        n_docs = loader.stream.num_docs
        loader.close()
    assert sizes == {1, 2, 4}
    want = {(d, p) for d in range(n_docs) for p in range(len(cache[d]))}
    assert set(seen) == want and set(seen.values()) == {1}  # every token once over the pool
    assert all(normaliser[s] == {loss_by_step[s]} for s in loss_by_step)


def test_dynamic_cp_loader_needs_the_cp_rank():
    cfg = _config()
    loader = PackedLoader(IterableSource(token_docs(30, seed=1)), config=cfg, planner=PoolPlanner(cfg), dp_rank=0,
                          num_threads=0)
    with pytest.raises(ValueError, match=r"cp_mode 'dynamic', cp=4.*cp_rank="):
        next(iter(loader))
    loader.close()


def _pool_plan() -> StepPlan:
    place = {1: (20, P(4, 0), 0), 2: (5, P(1, 0), 0), 3: (7, P(2, 2), 0),
             4: (9, P(2, 0), 1), 5: (4, P(2, 2), 1), 6: (3, P(1, 1), 1)}  # doc: (length, placement, slot)
    ranks = []
    for g in range(4):
        mbs = []
        for slot in (0, 1):
            docs = [d for d, (_, p, m) in place.items() if m == slot and p.first <= g < p.first + p.size]
            mbs.append(MicroBatch(segments=[Segment(d, 0, place[d][0], 0) for d in docs],
                                  cp=[place[d][1] for d in docs]))
        ranks.append(RankPlan(micro_batches=mbs))
    return StepPlan(step=3, ranks=ranks, cp_mode="dynamic")


@pytest.mark.parametrize("skips, untrained", [
    ([2, 1], [(5, 0, 4)]),  # DP rank 1 (GPUs 2, 3) stopped after slot 0: document 5 of its pair's slot 1
    ([1, 1], [(4, 0, 9), (5, 0, 4), (6, 0, 3)]),
    ([0, 0], [(d, 0, n) for d, n in ((1, 20), (2, 5), (3, 7), (4, 9), (5, 4), (6, 3))]),
])
def test_dynamic_cp_interrupted_step_leaves_what_no_group_trained(skips, untrained):
    from packloader.loader.elastic import remainder

    assert sorted(remainder(_pool_plan(), skips)) == untrained


def test_dynamic_cp_interrupted_step_refuses_a_group_split_by_the_save():
    from packloader.loader.elastic import remainder

    with pytest.raises(ValueError, match=r"micro-batch 0 of the CP group of GPUs 0..3 \(document 1\)"):
        remainder(_pool_plan(), [1, 0])
