"""PlanPipelineSchedule on a torch whose step() cannot take pre-split micro-batches (before 2.14; the GPU machines
have 2.11): step_plan runs what step() does around `_step_microbatches` itself, and a sliced plan over two gloo
stages still gives the loss and every gradient of the documents run whole in one process (float64)."""

from __future__ import annotations

import pytest
import torch
from helpers.distributed import run_ranks
from helpers.pipeline_model import (
    HAND,
    HAND_LENGTHS,
    VOCAB,
    H,
    Llama,
    StageModule,
    documents,
    loss_fn,
    loss_tokens,
    micro_batch_inputs,
    reference,
    stage_layers,
)

LAYERS = 4
RTOL = 1e-9


def _old_torch_rank(rank, world, schedule):
    import packloader.runtime.pipeline as pipeline
    from packloader.runtime.pipeline import PlanPipelineSchedule, SlicedPipelineStage

    torch.set_num_threads(1)
    pipeline._STEP_TAKES_MICRO_BATCHES = False  # as on torch < 2.14

    def refuse(*args, **kwargs):
        raise AssertionError("step() called: on torch < 2.14 it would split arg_mbs as a whole batch")

    PlanPipelineSchedule.step = refuse
    model = Llama(LAYERS)
    lo, hi = stage_layers(LAYERS, world)[rank]
    first, last = rank == 0, rank == world - 1
    stage = SlicedPipelineStage(
        StageModule(model, lo, hi, first, last), rank, world, "cpu",
        input_example=torch.zeros(1, dtype=torch.long) if first else torch.zeros(1, H, dtype=torch.float64),
        output_example=torch.zeros(1, VOCAB if last else H, dtype=torch.float64))
    sched = PlanPipelineSchedule([stage], loss_fn, schedule=schedule)
    docs = documents(HAND_LENGTHS)
    inputs = [micro_batch_inputs(mb, docs) for mb in HAND.micro_batches]
    losses: list = []
    out = sched.step_plan(HAND, arg_mbs=[(i,) for i, _, _ in inputs], kwarg_mbs=[{"positions": p} for _, p, _ in inputs],
                          target_mbs=[(lab, loss_tokens(docs)) for _, _, lab in inputs], losses=losses)
    return {"grads": {k: p.grad.numpy().copy() for k, p in model.named_parameters() if p.grad is not None},
            "loss": sum(float(x.detach()) for x in out) if last else None, "kv_left": len(stage.cache)}


@pytest.mark.multiprocess
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_step_plan_without_pre_split_step_matches_whole_documents(schedule):
    results = run_ranks(_old_torch_rank, 2, schedule)
    torch.set_num_threads(1)
    ref_loss, ref_grads = reference(Llama(LAYERS), documents(HAND_LENGTHS))
    got = {k: torch.from_numpy(g) for r in results for k, g in r["grads"].items()}
    assert set(got) == set(ref_grads)
    for k, g in ref_grads.items():
        torch.testing.assert_close(got[k], g, rtol=RTOL, atol=RTOL * float(g.abs().max()), msg=lambda m, k=k: f"{k}: {m}")
    assert results[1]["loss"] == pytest.approx(ref_loss, rel=RTOL)
    assert [r["kv_left"] for r in results] == [0, 0]
