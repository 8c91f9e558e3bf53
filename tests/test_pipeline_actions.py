"""PlanPipelineSchedule runs the action lists `packloader plan` writes (`step_actions`, through JSON as the CLI
writes them) over gloo at 2 and 4 stages, with slices, DP-Merge groups and an empty micro-batch: the gradients
equal a single-process run of the same documents whole (float64), the executed actions equal the written lists
(1F1B, GPipe and ZB-H1 lists, the last with split input/weight backwards, so a schedule that ignored them and
ran its own order would fail), and after every
action the carried key/value gradient accumulators hold no more bytes than the simulator's estimate for that
point of the same order. The list checks (no processes) come first."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch
from helpers.distributed import run_ranks
from helpers.pipeline_model import HAND, HAND_LENGTHS, HD, HKV, Llama, documents, loss_fn, reference, stage_layers
from helpers.pipeline_run import assert_grads_close, grads_of, plan_inputs, run_dp_merge_rank, sliced_stage

from packloader.balancers.cost.model import CostModel
from packloader.balancers.sim.actions import step_actions
from packloader.balancers.sim.simulator import simulate, slice_edges_of
from packloader.contracts import CostProfile, MicroBatch, ParallelConfig, Poly, RankPlan, Segment, StepPlan
from packloader.runtime.pipeline_actions import engine_actions, written_actions

LAYERS = 4
RTOL = 1e-9
LINEAR = CostModel(CostProfile(name="linear", tile=1, attn_fwd=Poly(), attn_bwd=Poly(), lin_fwd=Poly(0, 1.0, 0),
                               lin_bwd=Poly(0, 2.0, 0)))


def _mb(*segs, group=None):
    return MicroBatch(segments=[Segment(*s) for s in segs], dp_group=group)


def written(plan: StepPlan, pp: int, schedule: str = "1f1b") -> list:
    """The record's "actions" as `packloader plan` writes them: through JSON and back."""
    acts = step_actions(plan, LINEAR, ParallelConfig(dp=len(plan.ranks), pp=pp), schedule=schedule)
    return msgspec.json.decode(msgspec.json.encode(acts))


# an empty micro-batch (planners leave one now and then) in a plan with slices
WITH_EMPTY = RankPlan(micro_batches=HAND.micro_batches[:6] + [MicroBatch(segments=[]), HAND.micro_batches[7]])
WITH_EMPTY_LENGTHS = {d: n for d, n in HAND_LENGTHS.items() if d != 106}


def planner_plan(pp: int):
    from packloader.balancers.factory import make_planner
    from packloader.balancers.planners.registry import Window
    from packloader.contracts import PlanConfig, PlannerState

    lens = [70, 9, 14, 22, 5, 31, 12, 8, 17, 40, 6, 11]
    w = Window(np.arange(len(lens), dtype=np.int64), np.zeros(len(lens), np.int64), np.array(lens, np.int64))
    cfg = PlanConfig(strategy="slimpack", parallel=ParallelConfig(pp=pp), max_tokens=32, context=128,
                     tokens_per_step=sum(lens), num_micro_batches=8, model="llama3-8b")
    plan, _ = make_planner(cfg).plan(w, PlannerState(), 0)
    assert any(s.attend_from < s.start for mb in plan.ranks[0].micro_batches for s in mb.segments)
    return plan.ranks[0], dict(enumerate(lens))


# 2 DP ranks x 2 stages: sliced documents on both DP ranks and a shared DP-Merge micro-batch (context parallel
# over the two ranks of each stage)
MERGED = _mb((3, 0, 50, 0), (4, 0, 10, 0), group=[0, 1])
DP_LENGTHS = {0: 45, 1: 9, 2: 12, 3: 50, 4: 10, 5: 16, 6: 30, 7: 7}
DP_PLAN = StepPlan(step=0, ranks=[
    RankPlan(micro_batches=[_mb((0, 0, 20, 0), (1, 0, 9, 0)), _mb((0, 20, 45, 0)), _mb((2, 0, 12, 0)), MERGED]),
    RankPlan(micro_batches=[_mb((5, 0, 16, 0)), _mb((6, 0, 15, 0), (7, 0, 7, 0)), _mb((6, 15, 30, 0)), MERGED]),
])


# ------------------------------------------------------------------------------ list checks (no processes)


def test_written_lists_become_the_engines_actions():
    from packloader.runtime.pipeline import simulated_actions

    lists = written(StepPlan(step=0, ranks=[HAND]), 2)[0]
    got = engine_actions(lists, len(HAND.micro_batches), 2)
    assert written_actions(got) == lists
    assert got == simulated_actions(HAND.micro_batches, 2)  # the simulator's 1F1B order, the same actions


@pytest.mark.parametrize("edit,match", [
    (lambda ls: ls[:1], "1 pipeline ranks' lists for pp=2"),
    (lambda ls: [ls[0][:-1], ls[1]], r"pipeline rank 0 never runs \[\['B', 7, 0\]\]"),
    (lambda ls: [ls[0] + [ls[0][-1]], ls[1]], "runs twice"),
    (lambda ls: [[["F", 0, 1]] + ls[0][1:], ls[1]], r"stage must be one of \[0\]"),
    (lambda ls: [[["X", 0, 0]] + ls[0][1:], ls[1]], "op must be 'F', 'B' or 'W'"),
    (lambda ls: [[["F", 9, 0]] + ls[0][1:], ls[1]], r"micro-batch must be in 0\.\.7"),
    (lambda ls: [[["B", 0, 0], ["F", 0, 0]] + ls[0][1:], ls[1]], "backward before the micro-batch's forward"),
    # micro-batch 1 holds the slice after micro-batch 0's: its backward must come first
    (lambda ls: [[["F", 0, 0], ["F", 1, 0], ["B", 0, 0], ["B", 1, 0]] + [a for a in ls[0] if a[1] > 1], ls[1]],
     "backward of micro-batch 0 before that of micro-batch 1, which reads its keys"),
    (lambda ls: [[["F", 1, 0], ["F", 0, 0]] + [a for a in ls[0] if a[0] == "B" or a[1] > 1], ls[1]],
     "forward of micro-batch 1 before that of micro-batch 0"),
])
def test_bad_lists_are_refused_naming_the_action(edit, match):
    from packloader.runtime.pipeline import _readers

    lists = written(StepPlan(step=0, ranks=[HAND]), 2)[0]
    with pytest.raises(ValueError, match=match):
        engine_actions(edit(lists), len(HAND.micro_batches), 2, readers=_readers(HAND.micro_batches))


def test_split_backwards_become_input_and_weight_actions():
    from torch.distributed.pipelining.schedules import BACKWARD_INPUT, BACKWARD_WEIGHT, FULL_BACKWARD

    lists = [[["F", 0, 0], ["F", 1, 0], ["B", 0, 0], ["W", 0, 0], ["B", 1, 0]]]
    got = engine_actions(lists, 2, 1)[0]
    assert [a.computation_type for a in got[2:]] == [BACKWARD_INPUT, BACKWARD_WEIGHT, FULL_BACKWARD]
    assert written_actions({0: got}) == lists
    with pytest.raises(ValueError, match="weight gradient before the micro-batch's backward"):
        engine_actions([[["F", 0, 0], ["W", 0, 0], ["B", 0, 0]]], 1, 1)


# ------------------------------------------------------------------------------ runs over gloo


def _run_cases(rank, world, cases):
    """Each (plan, lengths, lists) run on this pipeline rank, with the schedule told "1f1b" whatever the lists."""
    import torch.distributed as dist

    from packloader.runtime.pipeline import PlanPipelineSchedule

    torch.set_num_threads(1)
    out = []
    for rank_plan, lengths, lists in cases:
        model = Llama(LAYERS)
        stage = sliced_stage(model, LAYERS, rank, world)
        sched = PlanPipelineSchedule([stage], loss_fn)
        losses: list = []
        sched.step_plan(rank_plan, actions=lists, losses=losses,
                        **plan_inputs(rank_plan.micro_batches, documents(lengths)))
        out.append(dict(grads=grads_of(model),
                        loss=sum(float(x.detach()) for x in losses) if stage.is_last else None,
                        executed=[list(a) for a in sched.executed], left=len(stage.cache),
                        grad_bytes=[s.grad_bytes for s in stage.kv_trace]))
        dist.barrier()
    return out


def _assert_grads(got, lengths, what):
    ref_loss, ref = reference(Llama(LAYERS), documents(lengths))
    assert_grads_close(got, ref, RTOL, what)
    return ref_loss


def _simulated_grad_bytes(rank_plan, pp, schedule, stage):
    """The simulator's key/value-gradient bytes on pipeline rank `stage` after each of its actions, for this
    tiny model (float64 dK and dV of every layer the stage holds, per prefix token)."""
    mbs = rank_plan.micro_batches
    edges, prefix = slice_edges_of(mbs)
    lo, hi = stage_layers(LAYERS, pp)[stage]
    per_token = 2 * HKV * HD * 8 * (hi - lo)
    m = len(mbs)
    sim = simulate(np.ones(m), np.ones(m), pp, schedule=schedule, backward_order=rank_plan.backward_order,
                   slice_edges=edges, kv_bytes=prefix * float(per_token))
    return sim.mem_bytes[stage, 1::2]


def _check_run(res, rank_plan, lengths, lists, pp, schedule, what):
    got: dict = {}
    for s in range(pp):
        r = res[s]
        assert r["executed"] == lists[s], f"{what}: pipeline rank {s} ran another order than the written one"
        assert r["left"] == 0
        sim = _simulated_grad_bytes(rank_plan, pp, schedule, s)
        assert len(r["grad_bytes"]) == len(sim)
        assert all(g <= e for g, e in zip(r["grad_bytes"], sim)), (what, s, r["grad_bytes"], sim.tolist())
        for k, g in r["grads"].items():
            assert k not in got
            got[k] = g
    ref_loss = _assert_grads(got, lengths, what)
    assert res[pp - 1]["loss"] == pytest.approx(ref_loss, rel=RTOL)


def _cases(pp):
    sp, sp_len = planner_plan(pp)
    plans = [(HAND, HAND_LENGTHS), (sp, sp_len)] + ([(WITH_EMPTY, WITH_EMPTY_LENGTHS)] if pp == 2 else [])
    return [(p, lens, sched, written(StepPlan(step=0, ranks=[p]), pp, sched)[0])
            for p, lens in plans for sched in ("1f1b", "gpipe", "zb-h1")]


def _two(rank, world, cases):
    return _run_cases(rank, world, [(p, lens, lists) for p, lens, _, lists in cases])


@pytest.mark.multiprocess
def test_two_stages_run_the_written_lists():
    cases = _cases(2)
    res = run_ranks(_two, 2, cases)
    for ci, (p, lens, sched, lists) in enumerate(cases):
        _check_run([res[s][ci] for s in range(2)], p, lens, lists, 2, sched, f"case {ci} ({sched})")
    # the accumulators held something on the sliced plans (so the bound above was not met by zeros alone)
    assert max(max(res[0][ci]["grad_bytes"]) for ci in range(len(cases))) > 0


def _four(rank, world, cases, plan, lengths, plan_actions):
    return _run_cases(rank, world, [(p, lens, lists) for p, lens, _, lists in cases]), \
        [run_dp_merge_rank(rank, world, plan, lengths, 2, LAYERS, acts) for acts in plan_actions]


@pytest.mark.multiprocess
def test_four_stages_and_dp_merge_run_the_written_lists():
    cases = _cases(4)
    scheds = ["1f1b", "zb-h1"]
    plan_actions = [written(DP_PLAN, 2, sched) for sched in scheds]
    both = run_ranks(_four, 4, cases, DP_PLAN, DP_LENGTHS, plan_actions)
    for ci, (p, lens, sched, lists) in enumerate(cases):
        _check_run([both[s][0][ci] for s in range(4)], p, lens, lists, 4, sched, f"case {ci} ({sched})")
    for k, sched in enumerate(scheds):
        _check_dp_merge([b[1][k] for b in both], plan_actions[k], sched)


def _check_dp_merge(dp_res, plan_actions, sched):
    """DP-Merge: 2 DP ranks x 2 stages; each process ran its DP rank's written list; gradients summed over DP."""
    got: dict = {}
    for rank, r in enumerate(dp_res):
        dp_rank, s = divmod(rank, 2)
        assert r["executed"] == plan_actions[dp_rank][s]
        assert r["left"] == 0
        sim = _simulated_grad_bytes(DP_PLAN.ranks[dp_rank], 2, sched, s)
        assert all(g <= e for g, e in zip(r["grad_bytes"], sim))
        for k, g in r["grads"].items():
            got[k] = got.get(k, 0) + g
    ref_loss = _assert_grads(got, DP_LENGTHS, f"DP-Merge plan ({sched})")
    assert dp_res[1]["loss"] + dp_res[3]["loss"] == pytest.approx(ref_loss, rel=RTOL)
