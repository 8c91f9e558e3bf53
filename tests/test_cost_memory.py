"""Memory model (MaxLen), heterogeneous rank costs and fitting a profile to a measured table."""

import numpy as np
import pytest

from packloader.balancers.cost.coeffs import lin_time
from packloader.balancers.cost.fit import Timings, fit_poly, profile_from_table
from packloader.balancers.cost.memory import (
    GiB,
    MemoryModel,
    activation_bytes_per_token_per_layer,
    in_flight_micro_batches,
    max_tokens_for_memory,
    static_bytes,
)
from packloader.balancers.cost.model import CostModel, annotate_costs
from packloader.balancers.cost.presets import get_shape
from packloader.balancers.cost.resolve import RankCosts, load_cost_model
from packloader.balancers.sim.simulator import simulate_rank
from packloader.contracts import MicroBatch, ParallelConfig, RankPlan, Segment, StepPlan


def test_activation_bytes_by_hand():
    tiny = get_shape("tiny")  # h=256, kv_dim=128, ffn=688
    full = 2 * 256 + 2 * 256 + 2 * (256 + 2 * 128) + 2 * 256 + 4 * 256 + 6 * 688
    assert activation_bytes_per_token_per_layer(tiny, recompute="none") == full == 7712
    assert activation_bytes_per_token_per_layer(tiny, recompute="selective") == full - 2 * 688
    assert activation_bytes_per_token_per_layer(tiny, recompute="full") == 512
    assert activation_bytes_per_token_per_layer(tiny, ParallelConfig(tp=2), "none") == full / 2
    # Llama-2-7B: about 32 h bytes per token per layer without recompute
    h = 4096
    assert activation_bytes_per_token_per_layer(get_shape("llama2-7b"), recompute="none") / h == pytest.approx(32.1, abs=0.1)
    with pytest.raises(ValueError):
        activation_bytes_per_token_per_layer(tiny, recompute="some")


def test_in_flight_micro_batches():
    p = ParallelConfig(pp=4)
    assert [in_flight_micro_batches(p, s) for s in range(4)] == [4, 3, 2, 1]
    assert in_flight_micro_batches(p, 0, num_micro_batches=2) == 2
    assert in_flight_micro_batches(p, 3, "gpipe", 8) == 8
    assert in_flight_micro_batches(ParallelConfig(pp=4, vpp=2), 0, "interleaved") == pytest.approx((3 * 2 + 4 + 1) / 2)


def test_static_bytes_and_distributed_optimizer():
    s = get_shape("llama3-8b")
    one = static_bytes(s, ParallelConfig(dp=1), distributed_optimizer=False)
    assert one == pytest.approx(s.total_params() * 18, rel=1e-6)
    sharded = static_bytes(s, ParallelConfig(dp=8))
    assert sharded == pytest.approx(s.total_params() * (6 + 12 / 8), rel=1e-6)
    # pipeline: the embedding on the first stage, the head on the last
    p = ParallelConfig(dp=8, pp=4)
    assert static_bytes(s, p, 0) > static_bytes(s, p, 1) < static_bytes(s, p, 3)


def test_max_tokens_is_the_largest_that_fits():
    for name, par in [("llama3-8b", ParallelConfig(dp=8, pp=4)), ("llama3-70b", ParallelConfig(dp=8, tp=8, pp=4)), ("llama2-7b", ParallelConfig(dp=8))]:
        mm = MemoryModel.for_preset(name, par)
        n = mm.tokens_that_fit()
        assert n > 0 and n % 128 == 0
        limit = mm.memory_gib * GiB * mm.usable_fraction - mm.reserve_gib * GiB
        assert all(mm.peak_bytes(n, s) <= limit for s in range(par.pp))
        assert any(mm.peak_bytes(n + 128, s) > limit for s in range(par.pp))
    base = max_tokens_for_memory("llama3-8b", ParallelConfig(dp=8, pp=4))
    assert max_tokens_for_memory("llama3-8b", ParallelConfig(dp=8, pp=4, tp=2)) > base
    assert max_tokens_for_memory("llama3-8b", ParallelConfig(dp=8, pp=4), recompute="full") > 3 * base
    assert max_tokens_for_memory("llama3-8b", ParallelConfig(dp=8, pp=4), memory_gib=141) > base
    assert max_tokens_for_memory("llama3-8b", ParallelConfig(dp=8, pp=4), user_cap=4096) == 4096
    # an 8B model with plain Adam does not fit one 80 GiB GPU at all
    assert max_tokens_for_memory("llama3-8b", ParallelConfig(dp=1)) == 0
    with pytest.raises(ValueError, match="does not fit"):
        load_cost_model("llama3-8b", ParallelConfig(dp=1), memory_cap=True)
    m = load_cost_model("llama3-8b", ParallelConfig(dp=8, pp=4), memory_cap=True)
    assert m.memory_cap() == base
    assert load_cost_model("llama3-8b").memory_cap() is None


def test_simulated_peak_matches_the_memory_model_for_equal_micro_batches():
    par = ParallelConfig(dp=8, pp=4)
    mm = MemoryModel.for_preset("llama3-8b", par)
    model = load_cost_model("llama3-8b", par)
    mbs = [MicroBatch(segments=[Segment(i, 0, 4096, 0)]) for i in range(8)]
    r = simulate_rank(RankPlan(micro_batches=mbs), model, par, memory=mm)
    for s in range(4):
        assert r.peak_bytes[s] == pytest.approx(mm.peak_bytes(4096, s, num_micro_batches=8))


def test_rank_costs_heterogeneous():
    rc = RankCosts.from_specs(["llama3-8b", "llama3-8b"], ParallelConfig(dp=2), caps=[8192, 4096], slowdowns=[1.0, 1.5])
    assert rc.dp == 2 and not rc.homogeneous
    assert rc.speeds() == pytest.approx([1.0, 1 / 1.5])
    plan = StepPlan(step=0, ranks=[RankPlan(micro_batches=[MicroBatch(segments=[Segment(r, 0, 1000, 0)])]) for r in range(2)])
    annotate_costs(plan, rc)
    a, b = plan.ranks[0].micro_batches[0], plan.ranks[1].micro_batches[0]
    assert b.fwd_cost == pytest.approx(1.5 * a.fwd_cost) and b.bwd_cost == pytest.approx(1.5 * a.bwd_cost)
    u = RankCosts.uniform(load_cost_model("tiny"), 4, 2048)
    assert u.homogeneous and u.caps == [2048] * 4 and len(u) == 4
    with pytest.raises(ValueError):
        RankCosts([load_cost_model("tiny")], [1, 2])
    with pytest.raises(ValueError, match="no memory cap"):
        RankCosts.from_specs(["tiny"])
    capped = RankCosts.from_specs([load_cost_model("llama3-8b", ParallelConfig(dp=8, pp=4), memory_cap=True)])
    assert capped.caps[0] > 0


def test_fit_poly_recovers_coefficients_and_profile_from_table():
    x = np.array([128, 512, 2048, 8192, 32768], dtype=float)
    y = 2e-11 * x * x + 3e-9 * x + 1e-5
    poly, err = fit_poly(x, y)
    assert poly.a == pytest.approx(2e-11, rel=1e-6) and poly.b == pytest.approx(3e-9, rel=1e-5) and err < 1e-9
    # a slightly concave table cannot give a negative quadratic term
    poly2, _ = fit_poly(x, 3e-9 * x + 1e-5 - 1e-15 * x * x)
    assert poly2.a >= 0 and poly2.b > 0
    truth = load_cost_model("llama2-7b", cost="analytic")  # polynomial, tile 128: what the fit recovers
    lens = np.array([100, 1000, 4000, 16000, 32768])
    fa, ba = truth.segment_times(lens, np.zeros_like(lens))
    toks = np.array([1024, 4096, 16384, 65536])
    lf = np.array([lin_time(truth.coeffs, n, False) for n in toks])
    lb = np.array([lin_time(truth.coeffs, n, True) for n in toks])
    timings = Timings(lens, fa, ba, toks, lf, lb)
    prof = profile_from_table("fitted", timings, lin_table=False)
    m = CostModel(prof)
    for n in (300, 5000, 20000):
        assert sum(m.microbatch_time_of([n])) == pytest.approx(sum(truth.microbatch_time_of([n])), rel=1e-3)
    assert max(prof.fit_error.values()) < 1e-3
    # as a measured table, the linear part interpolates between the counts (exact for a linear truth) and
    # keeps the first count's time below it (the floor)
    tab = CostModel(profile_from_table("table", timings))
    for n in (5000, 20000):
        assert sum(tab.microbatch_time_of([n])) == pytest.approx(sum(truth.microbatch_time_of([n])), rel=1e-3)
    assert tab.lin_time(300) == tab.lin_time(1) == pytest.approx(lf[0])
