"""The wlb, hydraulis, slimpack and auto planners honour the planner contract over whole runs (with a final
flush), checked by an interval check written here (not the planners' bookkeeping) and by `verify.verify_plan`;
plans are deterministic (in this process and in a fresh one) and a run resumed from a saved PlannerState plans
the same steps as an uninterrupted one."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import msgspec
import numpy as np
import pytest
from helpers.planner_runs import PLANNERS, cut, encoded_run, longtail, run_planner, steps_of
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from packloader.balancers.factory import make_planner
from packloader.balancers.planners.registry import StepLayout
from packloader.balancers.sim.verify import verify_plan
from packloader.contracts import ParallelConfig, PlanConfig, PlannerState, StepPlan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def check_run(plans: list[StepPlan], doc_lengths: list[int], cfg: PlanConfig) -> None:
    """Independent contract check: each token of each document exactly once over the run; per step equal
    micro-batch counts on every rank; the token cap; slices only when allowed, attending from their piece's
    start, the chain's earlier tokens in earlier micro-batches of the same rank and step; backward orders
    are permutations."""
    ctx = cfg.context
    seen = [np.zeros(l, np.int64) for l in doc_lengths]
    dp = cfg.parallel.dp
    for plan in plans:
        assert len(plan.ranks) == dp
        counts = {len(r.micro_batches) for r in plan.ranks}
        assert len(counts) == 1, f"step {plan.step}: unequal micro-batch counts {counts}"
        done = set()
        for r, rank in enumerate(plan.ranks):
            m = len(rank.micro_batches)
            if rank.backward_order is not None:
                assert sorted(rank.backward_order) == list(range(m))
            covered_until: dict[tuple[int, int], tuple[int, int]] = {}  # (doc, piece start) -> (end, position)
            for pos, mb in enumerate(rank.micro_batches):
                n = sum(s.end - s.start for s in mb.segments)
                assert n <= cfg.max_tokens, f"step {plan.step} rank {r} mb {pos}: {n} tokens > {cfg.max_tokens}"
                group = mb.dp_group
                if group:
                    assert r in group and len(set(group)) == len(group) and all(0 <= g < dp for g in group)
                key = (tuple(group), tuple(mb.segments)) if group and len(group) > 1 else None
                for s in mb.segments:
                    assert 0 <= s.start < s.end <= doc_lengths[s.doc]
                    piece_start = (s.start // ctx) * ctx
                    assert s.end <= piece_start + ctx, f"segment {s} crosses a context-piece boundary"
                    if s.attend_from < s.start:
                        assert cfg.allow_slicing, f"slice {s} without allow_slicing"
                        assert s.attend_from == piece_start, f"slice {s} must attend from its piece start {piece_start}"
                        prev = covered_until.get((s.doc, s.attend_from))
                        assert prev is not None and prev[0] == s.start and prev[1] < pos, f"slice {s}: prefix not in an earlier micro-batch"
                    else:
                        assert s.attend_from == s.start
                    covered_until[(s.doc, s.attend_from)] = (s.end, pos)
                if key is not None:
                    if key in done:
                        continue
                    done.add(key)
                for s in mb.segments:
                    seen[s.doc][s.start : s.end] += 1
    for d, arr in enumerate(seen):
        assert (arr == 1).all(), f"doc {d}: tokens seen {sorted(set(arr.tolist()))} times, expected exactly once"


config_strategy = st.fixed_dictionaries(
    {
        "dp": st.sampled_from([1, 2, 3, 4]),
        "pp": st.sampled_from([1, 2, 4]),
        "cap": st.sampled_from([64, 200, 512]),
        "ctx_mult": st.sampled_from([1, 3]),
        "slicing": st.booleans(),
        "nmb": st.one_of(st.none(), st.integers(1, 5)),
        "seed": st.integers(0, 3),
    }
)


def make_config(strategy: str, p: dict) -> PlanConfig:
    slicing = p["slicing"]
    # without slicing (or for planners that never slice) a piece must fit a micro-batch: context = cap
    ctx = p["cap"] * (p["ctx_mult"] if slicing and strategy in ("slimpack", "auto") else 1)
    return PlanConfig(
        strategy=strategy, parallel=ParallelConfig(dp=p["dp"], pp=p["pp"]), max_tokens=p["cap"], context=ctx,
        tokens_per_step=p["cap"] * p["dp"] * 2, num_micro_batches=p["nmb"], allow_slicing=slicing, seed=p["seed"],
    )


@pytest.mark.parametrize("strategy", PLANNERS)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(p=config_strategy, data=st.data())
def test_contract_over_a_run(strategy, p, data):
    cfg = make_config(strategy, p)
    hi = cfg.context * 2
    steps = data.draw(st.lists(st.lists(st.integers(1, hi), min_size=0, max_size=25), min_size=1, max_size=4))
    plans, windows, state = run_planner(cfg, steps)
    assert state.queued == [], "a flush must plan everything"
    check_run(plans, [l for s in steps for l in s], cfg)
    verify_plan(plans, windows, cfg.max_tokens, allow_slicing=cfg.allow_slicing, final_state=state, dp=cfg.parallel.dp)


@pytest.mark.parametrize("strategy", PLANNERS)
def test_long_tail_run_without_slicing_and_with(strategy):
    for slicing in (False, True):
        cfg = PlanConfig(strategy=strategy, parallel=ParallelConfig(dp=4, pp=2), max_tokens=2048,
                         context=2048 * (2 if slicing and strategy in ("slimpack", "auto") else 1),
                         tokens_per_step=4 * 2048 * 3, allow_slicing=slicing)
        lengths = longtail(300, 7, 2048)
        steps = steps_of(lengths, cfg.tokens_per_step)
        plans, windows, state = run_planner(cfg, steps)
        check_run(plans, lengths, cfg)
        verify_plan(plans, windows, cfg.max_tokens, allow_slicing=slicing, final_state=state, dp=4)
        if not slicing:
            assert all(s.attend_from == s.start for p in plans for r in p.ranks for mb in r.micro_batches for s in mb.segments)


def test_slimpack_slices_long_pieces_in_order_and_wlb_queues_outliers():
    """The behaviours the properties allow but do not force: slimpack really slices (and DP-merges) a piece
    longer than the cap; wlb really holds outliers back until a flush."""
    cfg = PlanConfig(strategy="slimpack", parallel=ParallelConfig(dp=2, pp=2), max_tokens=512, context=4096)
    plans, windows, state = run_planner(cfg, [[4096, 100, 90, 80, 300, 20]])
    sliced = [s for r in plans[0].ranks for mb in r.micro_batches for s in mb.segments if s.doc == 0]
    assert len({(s.start, s.end) for s in sliced}) >= 8  # 4096 tokens under a 512 cap: at least 8 slices
    check_run(plans, [4096, 100, 90, 80, 300, 20], cfg)

    cfg = PlanConfig(strategy="wlb", parallel=ParallelConfig(dp=2, pp=1), max_tokens=4096, context=4096, num_micro_batches=2)
    planner = make_planner(cfg)
    w = cut(0, [4000] + [50] * 40, 4096)
    plan, state = planner.plan(w, PlannerState(), 0)
    assert [q.doc for q in state.queued] == [0], "one outlier for 4 micro-batches waits"
    assert 0 in plan.delayed
    plan2, state2 = planner.plan(cut(41, [60] * 10, 4096), state, StepLayout(1, flush=True))
    assert state2.queued == []
    check_run([plan, plan2], [4000] + [50] * 40 + [60] * 10, cfg)


# ------------------------------------------------------------------------------------------------ determinism


@pytest.mark.multiprocess
def test_plans_identical_twice_and_in_a_fresh_process():
    here = {s: encoded_run(s) for s in PLANNERS}
    again = {s: encoded_run(s) for s in PLANNERS}
    assert here == again
    code = (
        "import sys, json, hashlib; sys.path.insert(0, sys.argv[1]); "
        "from helpers.planner_runs import encoded_run, PLANNERS; "
        "print(json.dumps({s: hashlib.sha256(encoded_run(s)).hexdigest() for s in PLANNERS}))"
    )
    env = dict(os.environ, PYTHONHASHSEED="123", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code, os.path.join(ROOT, "tests")], capture_output=True, text=True,
                         env=env, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    import hashlib

    theirs = json.loads(out.stdout.strip().splitlines()[-1])
    assert theirs == {s: hashlib.sha256(here[s]).hexdigest() for s in PLANNERS}


# ------------------------------------------------------------------------------------------------ resume


@pytest.mark.parametrize("strategy", ["wlb", "auto", "slimpack", "hydraulis"])
def test_resume_from_saved_state_plans_the_same_steps(strategy):
    """Steps 0..k, PlannerState through msgpack, a new planner continues: the same plans as one run. For wlb
    the saved state holds queued outliers (checked), so the resume carries real delayed work."""
    cfg = PlanConfig(strategy=strategy, parallel=ParallelConfig(dp=2, pp=2), max_tokens=4096, context=4096,
                     tokens_per_step=2 * 4096 * 2, num_micro_batches=2 if strategy == "wlb" else None)
    rng = np.random.default_rng(11)
    steps = [[int(x) for x in np.where(rng.random(30) < 0.1, 3500 + rng.integers(0, 500, 30), rng.integers(20, 300, 30))] for _ in range(6)]
    full, _, _ = run_planner(cfg, steps)

    k = 3
    planner = make_planner(cfg)
    state = PlannerState()
    first, plans = 0, []
    for s in range(k):
        plan, state = planner.plan(cut(first, steps[s], cfg.context), state, s)
        first += len(steps[s])
        plans.append(plan)
    if strategy == "wlb":
        assert state.queued, "the test needs queued outliers at the save point"
    saved = msgspec.msgpack.encode(state)
    state = msgspec.msgpack.decode(saved, type=PlannerState)
    planner = make_planner(cfg)  # a fresh planner: nothing but the saved state carries over
    for s in range(k, len(steps)):
        plan, state = planner.plan(cut(first, steps[s], cfg.context), state, StepLayout(s, flush=s == len(steps) - 1))
        first += len(steps[s])
        plans.append(plan)
    assert msgspec.json.encode(plans) == msgspec.json.encode(full)
