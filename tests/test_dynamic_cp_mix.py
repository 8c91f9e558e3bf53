"""Per-document CP's wider chain candidates (issue 26, `dynamic_cp_mix`): each long piece's CP size chosen on its own,
down to a chain of the fewest slices that fit, short pieces beside it. Against the brute force and independent
price of tests/helpers/dynamic_cp_brute.py (every placement of every document, whole or as such a chain), a device
too small for the chain, and exactly-once coverage over a run of small steps."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.dynamic_cp_brute import brute_force, cfg, check_tokens_once_and_chains, price, segments_of

from packloader.balancers.cost.memory import GiB, memory_model_for
from packloader.balancers.offline import plan_run
from packloader.balancers.planners.doc_cp.planner import DynamicCPOptions, DynamicCPPlanner
from packloader.balancers.planners.registry import Window
from packloader.balancers.sim.metrics import score_plan
from packloader.balancers.sim.verify import verify_plan
from packloader.contracts import ParallelConfig, PlannerState

# G = 4 GPUs (DP 1 x CP 4) of 4096 tokens a slot; the 11138-token document needs all four whole, the others two
LENGTHS = [6132, 7759, 11138]


def planned(lengths, config, options=None):
    planner = DynamicCPPlanner(config, options)
    plan, _ = planner.plan(Window.from_lengths(np.array(lengths)), PlannerState(), 0)
    return planner, plan, score_plan(plan, planner.cost.model, config.parallel).step_time


def test_dynamic_cp_mix_chains_only_the_long_document_as_the_brute_force_finds():
    # Whole, the best plan takes two slots: the long document alone on CP 4, the others side by side on CP 2. The
    # old chain candidates cut every piece at the same split (all three halved: two CP 1 chains and a CP 2
    # chain). The best placement the brute force finds chains the long document alone, as two 5569-token slices
    # on CP 2 in both slots, the other two whole on CP 2 beside it: strictly faster than both, and the planner's
    # plan is that placement, priced independently (price) as the brute force prices it.
    config = cfg(dp=1, cp=4, max_tokens=16384, micro_batches=1)
    planner, plan, t = planned(LENGTHS, config)
    best, combo = brute_force(LENGTHS, planner, 2)
    whole, _ = brute_force(LENGTHS, planner, 2, chains=False)
    _, _, old = planned(LENGTHS, config, DynamicCPOptions(mixed=False))
    assert [len(o) for o in combo] == [1, 1, 2] and combo[2][0][2] == 2  # the long one chained on CP 2, alone
    assert best < old * 0.96 and old < whole
    assert t == pytest.approx(best, rel=1e-9)
    segs = segments_of(plan)
    assert [(d, a, s, af) for d, a, _, _, s, af in segs] == [(0, 0, 2, 0), (1, 0, 2, 0), (2, 0, 2, 0), (2, 5569, 2, 0)]
    chain = [(m, f) for d, _, m, f, _, _ in segs if d == 2]
    assert chain[1] == (chain[0][0] + 1, chain[0][1])  # consecutive slots, one subgroup
    assert price([(m, f, s, e - a, a - af) for (d, a, m, f, s, af), e in zip(segs, (6132, 7759, 5569, 11138))],
                 planner, 2) == pytest.approx(best, rel=1e-9)
    verify_plan([plan], Window.from_lengths(np.array(LENGTHS)))


def test_dynamic_cp_mix_chain_not_taken_where_memory_forbids_it():
    # The same step on a device that holds one slot's 4096 tokens per GPU but not the 5569 a chain keeps on each
    # of its GPUs until its backward (hand-worked bytes below): no chain is taken, old or new, and the plan is the
    # brute force's best whole placement.
    base = cfg(dp=1, cp=4, max_tokens=16384, micro_batches=1)
    mem = memory_model_for(base.model, ParallelConfig(dp=1, cp=1, tp=8), "1f1b", "h100")
    per = mem.activation_bytes_per_token() + mem.transient_bytes_per_token()
    limit = mem.static_bytes() + 4300 * per
    assert mem.static_bytes() + 4096 * per < limit < mem.static_bytes() + 5569 * mem.activation_bytes_per_token()
    gib = (limit + mem.reserve_gib * GiB) / (GiB * mem.usable_fraction)
    planner, plan, t = planned(LENGTHS, cfg(dp=1, cp=4, max_tokens=16384, micro_batches=1, memory_gib=gib))
    assert all(af == a for _, a, _, _, _, af in segments_of(plan))
    whole, _ = brute_force(LENGTHS, planner, 2, chains=False)
    assert t == pytest.approx(whole, rel=1e-9)
    _, roomy, _ = planned(LENGTHS, base)
    assert len(segments_of(roomy)) == 4  # the H100's memory: chained (test above)


@pytest.mark.parametrize("seed", [1, 2])
def test_dynamic_cp_mix_covers_every_token_once_over_small_steps(seed):
    # small steps (about 1.5 slots' worth) of a long tail on 8 GPUs of 4096 tokens a slot: the wider candidates change some steps' plans
    # (never slower, step by step), every chain stays on one subgroup in consecutive slots, every token is planned
    # once
    rng = np.random.default_rng(2600 + seed)
    lengths = np.concatenate([rng.integers(50, 3000, 80), rng.integers(9000, 40000, 12)])
    rng.shuffle(lengths)
    config = cfg(dp=2, cp=4, max_tokens=16384, context=65536, tps=50000)
    run = plan_run(lengths, config, steps=None)
    old = plan_run(lengths, config, steps=None, planner=DynamicCPPlanner(config, DynamicCPOptions(mixed=False)))
    verify_plan(run.plans, run.windows, final_state=run.final_state)
    model = DynamicCPPlanner(config).cost.model
    times = [score_plan(p, model, config.parallel).step_time for p in run.plans]
    before = [score_plan(p, model, config.parallel).step_time for p in old.plans]
    assert all(t <= b * (1 + 1e-9) for t, b in zip(times, before)) and sum(times) < sum(before) * (1 - 1e-6)
    check_tokens_once_and_chains(run.plans, lengths)
