"""PlanPipelineSchedule on a torch whose step() cannot take pre-split micro-batches (before 2.14; the GPU machines
have 2.11): step_plan runs what step() does around `_step_microbatches` itself, and a sliced plan over two gloo
stages still gives the loss and every gradient of the documents run whole in one process (float64)."""

from __future__ import annotations

import pytest
import torch
from helpers.distributed import run_ranks
from helpers.pipeline_model import HAND, HAND_LENGTHS, Llama, documents, loss_fn, reference
from helpers.pipeline_run import assert_grads_close, grads_of, plan_inputs, sliced_stage

LAYERS = 4
RTOL = 1e-9


def _old_torch_rank(rank, world, schedule):
    import packloader.runtime.pipeline as pipeline
    from packloader.runtime.pipeline import PlanPipelineSchedule

    torch.set_num_threads(1)
    pipeline._STEP_TAKES_MICRO_BATCHES = False  # as on torch < 2.14

    def refuse(*args, **kwargs):
        raise AssertionError("step() called: on torch < 2.14 it would split arg_mbs as a whole batch")

    PlanPipelineSchedule.step = refuse
    model = Llama(LAYERS)
    stage = sliced_stage(model, LAYERS, rank, world)
    sched = PlanPipelineSchedule([stage], loss_fn, schedule=schedule)
    losses: list = []
    out = sched.step_plan(HAND, losses=losses, **plan_inputs(HAND.micro_batches, documents(HAND_LENGTHS)))
    return {"grads": grads_of(model), "loss": sum(float(x.detach()) for x in out) if stage.is_last else None,
            "kv_left": len(stage.cache)}


@pytest.mark.multiprocess
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_step_plan_without_pre_split_step_matches_whole_documents(schedule):
    results = run_ranks(_old_torch_rank, 2, schedule)
    torch.set_num_threads(1)
    ref_loss, ref_grads = reference(Llama(LAYERS), documents(HAND_LENGTHS))
    assert_grads_close({k: g for r in results for k, g in r["grads"].items()}, ref_grads, RTOL)
    assert results[1]["loss"] == pytest.approx(ref_loss, rel=RTOL)
    assert [r["kv_left"] for r in results] == [0, 0]
