"""What the gloo pipeline tests do alike around PlanPipelineSchedule: a SlicedPipelineStage of the test model
(pipeline_model's Llama cut into stages), a plan's micro-batches as the inputs step_plan takes, the gradients a rank
sends back, a DP-Merge rank's run, and the comparison of gradients with the whole-document reference (which each
test computes itself with pipeline_model.reference, independently of the pipeline)."""

from __future__ import annotations

import numpy as np
import torch

from helpers import pipeline_model as pm


def sliced_stage(model: pm.Llama, layers: int, si: int, num_stages: int, dtype: torch.dtype = torch.float64,
                 group=None):
    """Model stage `si` of `num_stages` (the layers split evenly, embedding first, norm + head last) on the CPU."""
    from packloader.runtime.pipeline import SlicedPipelineStage

    first, last = si == 0, si == num_stages - 1
    lo, hi = pm.stage_layers(layers, num_stages)[si]
    return SlicedPipelineStage(
        pm.StageModule(model, lo, hi, first, last), si, num_stages, "cpu", group=group,
        input_example=torch.zeros(1, dtype=torch.long) if first else torch.zeros(1, pm.H, dtype=dtype),
        output_example=torch.zeros(1, pm.VOCAB if last else pm.H, dtype=dtype))


def step_inputs(inputs: list, n_loss: int) -> dict:
    """step_plan's arg_mbs, kwarg_mbs and target_mbs from each micro-batch's (token ids, positions, labels)."""
    return dict(arg_mbs=[(i,) for i, _, _ in inputs], kwarg_mbs=[{"positions": p} for _, p, _ in inputs],
                target_mbs=[(lab, n_loss) for _, _, lab in inputs])


def plan_inputs(micro_batches, docs: dict[int, torch.Tensor]) -> dict:
    """`step_inputs` of these micro-batches of `docs`, the loss divided by all of the documents' loss tokens."""
    return step_inputs([pm.micro_batch_inputs(mb, docs) for mb in micro_batches], pm.loss_tokens(docs))


def grads_of(model: torch.nn.Module) -> dict[str, np.ndarray]:
    """The parameters' gradients in float64 numpy copies: a tensor would cross the process boundary as shared
    memory that the child frees."""
    return {k: p.grad.double().numpy().copy() for k, p in model.named_parameters() if p.grad is not None}


def assert_grads_close(got: dict, ref: dict[str, torch.Tensor], rtol: float, what: str = "") -> None:
    """Every gradient in `got` (numpy or torch) equals the reference's, to `rtol` of each tensor's largest entry."""
    assert set(got) == set(ref), what
    for k, r in ref.items():
        torch.testing.assert_close(torch.as_tensor(got[k]), r, rtol=rtol, atol=rtol * float(r.abs().max()),
                                   msg=lambda m, k=k: f"{what} {k}: {m}")



def dp_merge_inputs(micro_batches, docs: dict[int, torch.Tensor], dp_rank: int, rank_map: list[int]) -> list:
    """Each micro-batch's (token ids, positions, labels) on DP rank `dp_rank`: a DP-Merge micro-batch's cut to the
    rank's share (dp_merge_shard's token_index), whose positions must be the shard's position_ids."""
    from packloader.runtime.groups import dp_merge_shard

    out = []
    for mb in micro_batches:
        ids, pos, lab = pm.micro_batch_inputs(mb, docs)
        if mb.dp_group:
            sh = dp_merge_shard(mb, dp_rank=dp_rank, rank_map=rank_map)
            idx = torch.from_numpy(sh.token_index)
            assert torch.equal(pos[idx], torch.from_numpy(sh.position_ids))
            ids, pos, lab = ids[idx], pos[idx], lab[idx]
        out.append((ids, pos, lab))
    return out


def run_dp_merge_rank(rank: int, world: int, plan, lengths: dict[int, int], pp: int, layers: int,
                      plan_actions=None) -> dict:
    """One process of `world` = DP x `pp` running `plan` (a StepPlan with DP-Merge micro-batches) one step: rank r
    is pipeline stage r % pp of DP rank r // pp, each stage's DP ranks grouped for the merged micro-batches. Its
    gradients, loss (last stage), executed actions, carried KV left and key/value-gradient bytes per action."""
    import torch.distributed as dist

    from packloader.runtime.groups import ProcessGroupCache, prepare_dp_merge_groups
    from packloader.runtime.pipeline import PlanPipelineSchedule

    torch.set_num_threads(1)
    dp = world // pp
    dp_rank, s = divmod(rank, pp)
    pipes = [dist.new_group([d * pp + t for t in range(pp)]) for d in range(dp)]
    maps = [[d * pp + t for d in range(dp)] for t in range(pp)]
    groups = prepare_dp_merge_groups(dp, [plan], rank_maps=maps, groups=ProcessGroupCache())
    model = pm.Llama(layers)
    docs = pm.documents(lengths)
    stage = sliced_stage(model, layers, s, pp, group=pipes[dp_rank])
    sched = PlanPipelineSchedule([stage], pm.loss_fn, dp_rank=dp_rank, rank_map=maps[s], groups=groups)
    rp = plan.ranks[dp_rank]
    inputs = dp_merge_inputs(rp.micro_batches, docs, dp_rank, maps[s])
    losses: list = []
    sched.step_plan(rp, step_plan=plan, plan_actions=plan_actions, losses=losses,
                    **step_inputs(inputs, pm.loss_tokens(docs)))
    return dict(grads=grads_of(model), loss=sum(float(x.detach()) for x in losses) if stage.is_last else None,
                executed=[list(a) for a in sched.executed], left=len(stage.cache),
                grad_bytes=[x.grad_bytes for x in stage.kv_trace])
