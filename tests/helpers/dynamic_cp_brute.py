"""The dynamic-cp tests' independent reference (tests/test_dynamic_cp_chains.py, tests/test_dynamic_cp_mix.py): a
config, an independent price of per-document CP segments, a brute force over every placement of a tiny step (each
document whole on an aligned subgroup, or as a chain of the fewest equal slices at a smaller CP size), and a plan's
unique segments."""

from __future__ import annotations

import itertools

import numpy as np

from packloader.balancers.planners.doc_cp.planner import DynamicCPPlanner
from packloader.contracts import ParallelConfig, PlanConfig, StepPlan


def cfg(dp=1, cp=2, max_tokens=16384, context=None, micro_batches=None, **kw) -> PlanConfig:
    return PlanConfig(strategy="auto", cp_mode="dynamic", parallel=ParallelConfig(dp=dp, cp=cp, tp=8),
                      max_tokens=max_tokens, context=context or 4 * max_tokens, tokens_per_step=kw.pop("tps", 1 << 20),
                      num_micro_batches=micro_batches, **kw)


def price(segs, planner: DynamicCPPlanner, slots: int) -> float:
    """Slowest GPU's step time of segments (slot, first, size, q, p): each GPU's attention share of q tokens after
    p keys, lin of its tokens, one K/V exchange per (slot, subgroup) over its query tokens; GPUs sharing a
    segment wait for the slowest of them (union-find, slot by slot)."""
    cost, G = planner.cost, planner.cost.pool
    model = cost.model
    cf, cb = model.profile.attn_fwd.c, model.profile.attn_bwd.c
    own, tok, groups = np.zeros((slots, G)), np.zeros((slots, G)), {}
    for m, f, s, q, p in segs:
        fa, ba = model.segment_times(np.array([q]), np.array([p]))
        own[m, f:f + s] += (fa[0] - cf) / s + cf + (ba[0] - cb) / s + cb
        tok[m, f:f + s] += q / s
        if s > 1:
            groups[(m, f, s)] = groups.get((m, f, s), 0) + q
    for (m, f, s), n in groups.items():
        own[m, f:f + s] += sum(cost.comm.times(n, s))
    total = np.zeros(G)
    for m in range(slots):
        parent = list(range(G))

        def root(x):
            while parent[x] != x:
                x = parent[x]
            return x

        for g in range(G):
            if tok[m, g] > 0:
                own[m, g] += model.lin_time(tok[m, g]) + model.lin_time(tok[m, g], bwd=True)
        for mm, f, s, _, _ in segs:
            if mm == m:
                for g in range(f + 1, f + s):
                    parent[root(g)] = root(f)
        for g in range(G):
            total[g] += max(own[m, h] for h in range(G) if root(h) == root(g))
    return float(total.max())


def options(n: int, G: int, cap: int, slots: int) -> list[list[tuple[int, int, int, int, int]]]:
    """Every placement of one n-token document: whole on an aligned subgroup of a slot, or as a chain of the
    fewest equal slices at a smaller size, on one subgroup in consecutive slots (slot, first, size, q, p each)."""
    out = []
    need = 1 << max(0, (-(-n // cap) - 1).bit_length())
    for s in (1, 2, 4, 8):
        if s > G:
            continue
        k = -(-n // (s * cap))
        cuts = [(n * j) // k for j in range(k + 1)]
        if k > 1 and s >= need:
            continue
        for f in range(0, G, s):
            for m in range(slots - k + 1):
                out.append([(m + j, f, s, cuts[j + 1] - cuts[j], cuts[j]) for j in range(k)])
    return out


def brute_force(lengths, planner: DynamicCPPlanner, slots: int, chains: bool = True) -> tuple[float, tuple]:
    G, cap = planner.cost.pool, planner.cost.cap
    opts = [[o for o in options(n, G, cap, slots) if chains or len(o) == 1] for n in lengths]
    best, arg = np.inf, ()
    for combo in itertools.product(*opts):
        tok = np.zeros((slots, G))
        for m, f, s, q, _ in itertools.chain(*combo):
            tok[m, f:f + s] += -(-q // s)
        if (tok > cap).any():
            continue
        t = price(list(itertools.chain(*combo)), planner, slots)
        if t < best:
            best, arg = t, combo
    return best, arg


def segments_of(plan: StepPlan) -> list[tuple[int, int, int, int, int, int]]:
    """(doc, start, slot, first, size, attend_from) of each unique segment, each listed by its subgroup's GPUs."""
    out = []
    for g, rank in enumerate(plan.ranks):
        for m, mb in enumerate(rank.micro_batches):
            for s, c in zip(mb.segments, mb.cp):
                assert c.first <= g < c.first + c.size
                if c.first == g:
                    out.append((s.doc, s.start, m, c.first, c.size, s.attend_from))
    return sorted(out)


def check_tokens_once_and_chains(plans, lengths) -> int:
    """Asserts that every token of every document is planned exactly once and that each slice's previous slice
    ends at its start one slot earlier on the same GPUs (a chain stays on its subgroup); returns the slices."""
    count = {d: np.zeros(n, np.int64) for d, n in enumerate(lengths)}
    slices = 0
    for plan in plans:
        segs = segments_of(plan)
        for d, a, m, f, s, af in segs:
            end = next(seg.end for seg in plan.ranks[f].micro_batches[m].segments if (seg.doc, seg.start) == (d, a))
            count[d][a:end] += 1
            if af < a:
                prev = max(x for x in segs if x[0] == d and x[5] == af and x[1] < a)
                assert prev[2:5] == (m - 1, f, s), (d, a, prev)
                slices += 1
    for d, c in count.items():
        assert (c == 1).all(), (d, np.unique(c))
    return slices
