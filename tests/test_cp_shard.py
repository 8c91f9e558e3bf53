"""CP shard metadata against a brute-force mask built from the plan: every query token attends to exactly the keys
of its own document up to itself; plus the per-mode layout promises (chunk pairs, no padding, whole short
documents), costs and the adaptive choice."""

from __future__ import annotations

import numpy as np
import pytest

from packloader.collate.cp_sequence_shards import MODES, plan_cp_shards, shard_micro_batch
from packloader.contracts import MicroBatch, Segment
from packloader.runtime.cp_cost import cp_cost

COST = cp_cost()  # the llama3-8b preset's estimate

PACKS = {
    "one_long": [61],
    "many_short": [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5],
    "not_divisible": [13, 7, 22, 9],
    "single_tokens": [1, 1, 1, 17, 1],
    "mixed": [40, 2, 1, 11, 0, 8],
}


def visible_keys(shard, causal=True, window=(-1, -1)):
    """For each local query (packed position), the set of packed key positions the plan lets it see."""
    rows, cu_k, _ = shard.key_layout(causal, window)
    inv = {int(r): t for t, r in enumerate(shard.gather_index)}  # buffer row -> packed position
    cu_q = shard.cu_seqlens_q
    out = {}
    for b in range(shard.num_runs):
        lq = int(cu_q[b + 1] - cu_q[b])
        keys = [inv[int(r)] for r in rows[cu_k[b]: cu_k[b + 1]]]
        lk = len(keys)
        for i in range(lq):
            g = int(shard.token_index[cu_q[b] + i])
            seen = set()
            for j, key in enumerate(keys):  # bottom-right aligned causal / window rule, as the kernel applies it
                d = j - (i + lk - lq)
                if causal and d > 0:
                    continue
                if window[0] >= 0 and d < -window[0]:
                    continue
                seen.add(key)
            out[g] = seen
    return out


def expected_keys(lengths, causal=True, window=(-1, -1)):
    out = {}
    start = 0
    for L in lengths:
        for o in range(L):
            hi = o if causal else L - 1
            lo = 0 if window[0] < 0 else max(0, o - window[0])
            out[start + o] = set(range(start + lo, start + hi + 1))
        start += L
    return out


@pytest.mark.parametrize("pack", sorted(PACKS))
@pytest.mark.parametrize("cp", [1, 2, 3, 4])
@pytest.mark.parametrize("mode", list(MODES) + ["adaptive"])
def test_each_query_sees_exactly_its_document_prefix(pack, cp, mode):
    lengths = PACKS[pack]
    plan = plan_cp_shards(lengths, cp, mode, cost=COST)
    T = sum(lengths)
    owned = np.concatenate([r.token_index for r in plan.ranks])
    assert sorted(owned.tolist()) == list(range(T))  # a partition of the packed tokens
    want = expected_keys(lengths)
    got = {}
    for r in plan.ranks:
        assert np.all(np.diff(r.token_index) > 0)
        got.update(visible_keys(r))
    assert got == want
    # windowed variant
    want_w = expected_keys(lengths, window=(3, -1))
    got_w = {}
    for r in plan.ranks:
        got_w.update(visible_keys(r, window=(3, -1)))
    assert got_w == want_w
    # non-causal: the whole document
    got_nc = {}
    for r in plan.ranks:
        got_nc.update(visible_keys(r, causal=False))
    assert got_nc == expected_keys(lengths, causal=False)


@pytest.mark.parametrize("mode", MODES)
def test_position_ids_and_runs(mode):
    lengths = [13, 7, 22, 9]
    offsets = [0, 100, 5, 0]
    plan = plan_cp_shards(lengths, 3, mode, position_offsets=offsets, cost=COST)
    starts = np.cumsum([0] + lengths[:-1])
    for r in plan.ranks:
        for t, pos in zip(r.token_index, r.position_ids):
            s = int(np.searchsorted(starts, t, side="right") - 1)
            assert pos == offsets[s] + t - starts[s]
        assert r.cu_seqlens_q.dtype == np.int32 and r.cu_seqlens_q[-1] == r.num_tokens
        assert r.max_seqlen_q == (int(np.diff(r.cu_seqlens_q).max()) if r.num_runs else 0)
        assert np.all(r.run_key_start == starts[r.run_segment])
        assert np.all(r.run_doc_len == np.asarray(lengths)[r.run_segment])
        first = r.token_index[r.cu_seqlens_q[:-1]]
        assert np.all(r.run_key_visible == first - starts[r.run_segment] + 1)
        # gather_index: rank-major rows, this rank's block holds its tokens in order
        assert np.all(r.gather_index[r.token_index] == r.rank * r.max_local + np.arange(r.num_tokens))


def test_sequence_mode_chunks_and_padding():
    T, cp = 23, 3  # 6 chunks of 4, the last one padded by 1
    plan = plan_cp_shards([10, 13], cp, "sequence", cost=COST)
    for r in plan.ranks:
        i = r.rank
        want = [t for t in range(T) if t // 4 in (i, 2 * cp - 1 - i)]
        assert r.token_index.tolist() == want
        assert r.num_tokens + r.num_padding == 8
    assert sum(r.num_padding for r in plan.ranks) == 24 - 23


def test_document_mode_pairs_and_no_padding():
    cp = 3
    lengths = [12, 24, 7, 1, 1, 5, 13]
    plan = plan_cp_shards(lengths, cp, "document", cost=COST)
    counts = [r.num_tokens for r in plan.ranks]
    assert max(counts) - min(counts) <= 1 and all(r.num_padding == 0 for r in plan.ranks)
    starts = np.cumsum([0] + lengths[:-1])
    for r in plan.ranks:
        i = r.rank
        for s, L in enumerate(lengths[:2]):  # divisible by 2CP: exactly chunks i and 2CP-1-i of D tokens
            d = L // (2 * cp)
            mine = sorted(t - starts[s] for t in r.token_index if starts[s] <= t < starts[s] + L)
            assert mine == [o for o in range(L) if o // d in (i, 2 * cp - 1 - i)]
        # at most two query runs per document per rank
        assert np.all(np.bincount(r.run_segment, minlength=len(lengths)) <= 2)
    # every document is spread: a rank holds about 2/(2CP) of each long document
    for s, L in enumerate(lengths):
        per = [sum(1 for t in r.token_index if starts[s] <= t < starts[s] + L) for r in plan.ranks]
        assert max(per) - min(per) <= 2


def test_hierarchical_keeps_short_documents_whole():
    lengths = [200, 3, 5, 4, 6, 2, 7, 3]
    plan = plan_cp_shards(lengths, 4, "hierarchical", cost=COST)
    starts = np.cumsum([0] + lengths[:-1])
    owner = np.empty(sum(lengths), dtype=int)
    for r in plan.ranks:
        owner[r.token_index] = r.rank
    assert 0 in plan.sharded_segments.tolist()
    for s, L in enumerate(lengths):
        if s not in plan.sharded_segments.tolist():
            assert len(set(owner[starts[s]: starts[s] + L].tolist())) == 1
    # a fixed threshold shards exactly the documents that long
    plan2 = plan_cp_shards(lengths, 4, "hierarchical", hierarchical_threshold=6, cost=COST)
    assert sorted(plan2.sharded_segments.tolist()) == [0, 4, 6]


def test_costs_match_the_cost_model_and_adaptive_picks_the_minimum():
    from packloader.balancers.cost.resolve import load_cost_model

    cm = load_cost_model("llama3-8b")
    rng = np.random.default_rng(0)
    for _ in range(5):
        lengths = rng.integers(1, 3000, size=rng.integers(1, 30)).tolist()
        plan = plan_cp_shards(lengths, 4, "adaptive", cost=cp_cost(cm))
        assert plan.estimates[plan.mode] == min(plan.estimates.values())
        assert set(plan.estimates) == set(MODES)
        for r in plan.ranks:
            q = np.diff(r.cu_seqlens_q).astype(np.int64)
            f, b = cm.segment_times(q, r.run_key_visible - 1)
            assert r.cost_fwd == pytest.approx(float(f.sum())) and r.cost_bwd == pytest.approx(float(b.sum()))


def test_adaptive_tile_padding_keeps_short_documents_unsharded():
    # Many documents much shorter than the tile: per-document sharding cuts them into 1-token runs, each costing a
    # full tile, so the estimate prefers the sequence or hierarchical layout.
    plan = plan_cp_shards([50] * 40, 4, "adaptive", remapped=True, cost=COST)
    assert plan.mode != "document"
    assert plan.estimates["document"] > plan.estimates[plan.mode]
    # One very long document with short ones: per-sequence sharding is badly imbalanced, per-document is not.
    plan = plan_cp_shards([16384, 8192, 300], 4, "adaptive", modes=("sequence", "document"), cost=COST)
    assert plan.estimates["sequence"] >= plan.estimates["document"]


def test_unit_estimate_without_cost_module():
    from packloader.collate.cp_sequence_shards import TileEstimate

    plan = plan_cp_shards([100, 3, 300], 2, "adaptive", cost=TileEstimate())
    assert plan.mode in MODES and plan.ranks[0].cost > 0


def test_shard_micro_batch_uses_segments_and_refuses_slices():
    mb = MicroBatch(segments=[Segment(0, 0, 9, 0), Segment(1, 64, 70, 64)])
    plan = shard_micro_batch(mb, 2, mode="document", cost=COST)
    assert plan.mode == "document"
    pos = np.concatenate([r.position_ids for r in plan.ranks])
    assert sorted(pos.tolist()) == sorted(list(range(9)) + list(range(6)))  # the piece at 64 restarts at 0
    with pytest.raises(NotImplementedError, match="slice"):
        shard_micro_batch(MicroBatch(segments=[Segment(0, 64, 70, 0)]), 2, cost=COST)


def test_bad_arguments():
    with pytest.raises(ValueError, match="cp_size"):
        plan_cp_shards([3], 0, cost=COST)
    with pytest.raises(ValueError, match="unknown CP sharding mode"):
        plan_cp_shards([3], 2, "ring", cost=COST)
    with pytest.raises(ValueError, match=">= 0"):
        plan_cp_shards([3, -1], 2, cost=COST)


def test_empty_micro_batch():
    plan = plan_cp_shards([], 3, "adaptive", cost=COST)
    assert all(r.num_tokens == 0 and r.num_runs == 0 for r in plan.ranks)


class _AttentionOnly:
    """A duck-typed estimate with attention times only (no linear part)."""

    def segment_times(self, q, p):
        f = np.asarray(q, dtype=np.float64) ** 2
        return f, 2 * f


class _Broken:
    def __init__(self, times):
        self.times = times

    def segment_times(self, q, p):
        return self.times(np.asarray(q)), self.times(np.asarray(q))

    def linear(self, n):
        return float(n)


def test_a_bad_cost_is_an_error_never_a_fallback():
    from packloader.balancers.cost.resolve import load_cost_model

    with pytest.raises(TypeError, match="cost"):
        plan_cp_shards([3, 5], 2, "adaptive")  # no cost given
    with pytest.raises(TypeError, match="has no linear.*cp_cost"):
        plan_cp_shards([3, 5], 2, "adaptive", cost=load_cost_model("llama3-8b"))  # a model, not its estimate
    with pytest.raises(TypeError, match="has no segment_times or linear"):
        plan_cp_shards([3, 5], 2, "adaptive", cost="llama3-8b")
    with pytest.raises(ValueError, match=r"shape \(1,\) for \d+ query runs"):
        plan_cp_shards([3, 5], 2, "document", cost=_Broken(lambda q: np.ones(1)))
    with pytest.raises(ValueError, match="negative or not finite"):
        plan_cp_shards([3, 5], 2, "sequence", cost=_Broken(lambda q: np.full(q.shape, np.nan)))
    with pytest.raises(KeyError):  # a model that does not load raises; no unit estimate stands in for it
        cp_cost("no-such-model")


def test_cp_cost_builds_the_estimate_from_what_the_model_is_given_as():
    from packloader.balancers.cost.coeffs import lin_time
    from packloader.balancers.cost.resolve import load_cost_model

    cm = load_cost_model("llama3-8b")
    q, p = np.array([5, 130, 700]), np.array([0, 64, 3])
    want_f, want_b = cm.segment_times(q, p)
    for spec in (None, "llama3-8b", cm):
        est = cp_cost(spec)
        f, b = est.segment_times(q, p)
        assert f.tolist() == want_f.tolist() and b.tolist() == want_b.tolist()
        assert est.linear(300) == lin_time(cm.coeffs, 300.0, False) + lin_time(cm.coeffs, 300.0, True)
    # attention only: every rank's linear cost is 0, as with remapped=True
    plan = plan_cp_shards([40, 9, 300], 2, "adaptive", cost=cp_cost(_AttentionOnly()))
    assert all(r.linear_cost == 0.0 for r in plan.ranks) and plan.ranks[0].cost > 0
