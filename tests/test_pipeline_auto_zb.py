"""A sliced plan for which `auto` chose ZB-H1 (PlanConfig.schedule "auto"), run by PlanPipelineSchedule over
gloo at 2 pipeline stages from the action lists `packloader plan` writes for it: the gradients equal a
single-process run of the same documents whole (float64), every pipeline rank ran exactly its written list
(split input and weight backwards included), and the loss is the reference's (issue 25)."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch
from helpers.distributed import run_ranks
from helpers.pipeline_model import Llama, documents, loss_fn, reference
from helpers.pipeline_run import assert_grads_close, grads_of, plan_inputs, sliced_stage

from packloader.balancers.cost.lookup import cost_model_for
from packloader.balancers.factory import make_planner
from packloader.balancers.planners.registry import Window
from packloader.balancers.sim.actions import step_actions
from packloader.contracts import ParallelConfig, PlanConfig, PlannerState

LAYERS = 4
PP = 2
RTOL = 1e-9
LENGTHS = [70, 9, 14, 22, 5, 31, 12, 8, 17, 40, 6, 11]


def auto_zb_plan():
    """`auto` with the schedule left to it, on documents longer than the 32-token cap (so slimpack slices
    them): the plan, the documents' lengths and the action lists as `packloader plan` writes them (JSON)."""
    cfg = PlanConfig(strategy="auto", schedule="auto", parallel=ParallelConfig(pp=PP), max_tokens=32, context=128,
                     tokens_per_step=sum(LENGTHS), num_micro_batches=8, model="llama3-8b")
    n = len(LENGTHS)
    window = Window(np.arange(n, dtype=np.int64), np.zeros(n, np.int64), np.array(LENGTHS, np.int64))
    plan, _ = make_planner(cfg).plan(window, PlannerState(), 0)
    lists = step_actions(plan, cost_model_for(cfg), cfg.parallel, schedule=cfg.schedule)
    return plan, dict(enumerate(LENGTHS)), msgspec.json.decode(msgspec.json.encode(lists))[0]


def _run(rank, world, rank_plan, lengths, lists):
    from packloader.runtime.pipeline import PlanPipelineSchedule

    torch.set_num_threads(1)
    model = Llama(LAYERS)
    stage = sliced_stage(model, LAYERS, rank, world)
    sched = PlanPipelineSchedule([stage], loss_fn)
    losses: list = []
    sched.step_plan(rank_plan, actions=lists, losses=losses, **plan_inputs(rank_plan.micro_batches, documents(lengths)))
    return dict(grads=grads_of(model), loss=sum(float(x.detach()) for x in losses) if stage.is_last else None,
                executed=[list(a) for a in sched.executed], left=len(stage.cache))


def test_auto_chooses_zb_h1_for_a_sliced_plan():
    """The premise of the gloo test, checked without processes: auto chose ZB-H1, the plan has slices, and the
    written lists split backwards into B and W."""
    plan, _, lists = auto_zb_plan()
    assert plan.schedule == "zb-h1"
    assert any(s.attend_from < s.start for mb in plan.ranks[0].micro_batches for s in mb.segments)
    assert all(any(op == "W" for op, _, _ in acts) for acts in lists)


@pytest.mark.multiprocess
def test_auto_zb_h1_sliced_plan_gradients_equal_the_whole_document_reference():
    plan, lengths, lists = auto_zb_plan()
    rank_plan = plan.ranks[0]
    res = run_ranks(_run, PP, rank_plan, lengths, lists)
    got: dict = {}
    for s, r in enumerate(res):
        assert r["executed"] == lists[s], f"pipeline rank {s} ran another order than the written one"
        assert r["left"] == 0
        for k, g in r["grads"].items():
            assert k not in got
            got[k] = g
    ref_loss, ref = reference(Llama(LAYERS), documents(lengths))
    assert_grads_close(got, ref, RTOL)
    assert res[-1]["loss"] == pytest.approx(ref_loss, rel=RTOL)
