"""Sliced plans at PP > 1: a Megatron GPTModel stage run through packloader's `PlanPipelineSchedule` in the
order the planner scored (`sliced_pipeline_forward_backward`)."""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
import torch.distributed as dist

from .._common import flat
from .._lazy import require
from .batch import SLICES_PP_ALTERNATIVE, _parallel_ranks
from .pipeline_chunks import check_chunk_placement, placement_stages
from .slices import install_slice_rope

# ------------------------------------------------------------------------------------------ PP > 1, slices


def check_sliced_pipeline_config(config: Any, *, num_model_chunks: int = 1) -> None:
    """Refuse, before any communication, the Megatron settings ``sliced_pipeline_forward_backward`` cannot honour
    (each named, with what to change). ``variable_seq_lengths`` is not needed on this path: packloader's stage
    sizes its receive buffers per micro-batch itself, without Megatron's p2p shape exchange. Virtual pipeline
    stages run: one model chunk per ``virtual_pipeline_model_parallel_size``."""
    vpp = getattr(config, "virtual_pipeline_model_parallel_size", None) or 1
    if num_model_chunks != vpp:
        raise ValueError(
            f"{num_model_chunks} model chunk(s) with virtual_pipeline_model_parallel_size="
            f"{getattr(config, 'virtual_pipeline_model_parallel_size', None)}: pass this rank's list of "
            "virtual_pipeline_model_parallel_size model chunks (one without virtual pipeline stages)")
    if getattr(config, "sequence_parallel", False):
        raise ValueError(
            "sequence_parallel=True: the activations between pipeline stages are then split along the sequence over "
            "the tensor-parallel ranks, and sliced_pipeline_forward_backward sizes them by each micro-batch's whole "
            f"token count; set sequence_parallel=False, or {SLICES_PP_ALTERNATIVE}")
    cp = getattr(config, "context_parallel_size", 1) or 1
    if cp > 1:
        raise ValueError(f"context_parallel_size={cp}: context parallelism cannot shard slices; "
                         f"{SLICES_PP_ALTERNATIVE} when CP > 1")
    if hasattr(config, "calculate_per_token_loss") and not config.calculate_per_token_loss:
        raise ValueError("set calculate_per_token_loss=True: packloader's micro-batches hold different numbers of "
                         "loss tokens, and averaging per micro-batch would weight tokens unequally")


class _MegatronStageModule(torch.nn.Module):
    """One Megatron model chunk as the stage module of a SlicedPipelineStage: micro-batch ``mb``'s forward is the
    user's ``forward_step_func`` on that batch, after ``set_input_tensor`` with the received activations (not on
    the first stage); the last stage keeps each micro-batch's loss function for the schedule's loss."""

    def __init__(self, model: torch.nn.Module, first: bool, last: bool) -> None:
        super().__init__()
        self.model = model
        self.first, self.last = first, last
        self.set_input_tensor = require("megatron.core.utils").get_attr_wrapped_model(model, "set_input_tensor")
        self.forward_step_func: Callable | None = None
        self.batches: list[dict] = []
        self.loss_funcs: dict[int, Any] = {}

    def forward(self, x: torch.Tensor, *, mb: int) -> torch.Tensor:
        if not self.first:
            self.set_input_tensor(x)
        out = self.forward_step_func(iter([self.batches[mb]]), self.model)
        output, loss_func = out if isinstance(out, tuple) else (out, None)
        if self.last:
            self.loss_funcs[mb] = loss_func
        return output


class _PipelineRunner:
    """What one rank's model chunks keep between steps: a stage per chunk (model stage `placement_stages`) and
    the schedule (buffers are re-sized per step). One runner per placement: interleaved or ZB-V's V."""

    def __init__(self, chunks: list[torch.nn.Module], config: Any, group: Any, v_shape: bool) -> None:
        from packloader.runtime.pipeline import PlanPipelineSchedule, SlicedPipelineStage

        pp, rank = dist.get_world_size(group), dist.get_rank(group)
        n = pp * len(chunks)
        stages = placement_stages("zb-v" if v_shape else "interleaved", pp, rank, len(chunks))
        param = next(chunks[0].parameters())
        dtype = getattr(config, "pipeline_dtype", None) or param.dtype
        hidden = torch.zeros(1, 1, config.hidden_size, dtype=dtype)  # Megatron's [s, b, h], b = 1 (THD)
        self.modules = [_MegatronStageModule(c, st == 0, st == n - 1) for c, st in zip(chunks, stages)]
        self.config, self.chunks = config, chunks
        self.stages = [SlicedPipelineStage(
            mod, st, n, param.device, group=group, token_dim=0,
            input_example=torch.zeros(1, dtype=torch.long) if st == 0 else hidden,
            output_example=torch.zeros(1, 1, dtype=torch.float32) if st == n - 1 else hidden)
            for mod, st in zip(self.modules, stages)]
        self.stage = self.stages[0]
        self.last = next((m for m in self.modules if m.last), None)
        self._loss_of: Callable | None = None
        default = ("zb-v" if v_shape else "interleaved") if len(chunks) > 1 else "1f1b"
        self.schedule = PlanPipelineSchedule(self.stages, self._loss, schedule=default)

    def _loss(self, output, j):
        return self._loss_of(output, j)


_RUNNERS: "dict[int, tuple[list, dict[bool, _PipelineRunner]]]" = {}  # first chunk -> (chunks, placement -> runner)
_LAST: "dict[int, _PipelineRunner]" = {}  # first chunk -> the runner of its last step


def _runner(chunks: list[torch.nn.Module], config: Any, group: Any, v_shape: bool) -> _PipelineRunner:
    held = _RUNNERS.get(id(chunks[0]))
    if held is None or len(held[0]) != len(chunks) or any(a is not b for a, b in zip(held[0], chunks)):
        held = _RUNNERS[id(chunks[0])] = (list(chunks), {})
    run = held[1].get(v_shape)
    if run is None or run.stage.group is not group:
        run = held[1][v_shape] = _PipelineRunner(chunks, config, group, v_shape)
    _LAST[id(chunks[0])] = run
    return run


def _rank_plan(batches: list[dict], dp_rank: int | None):
    """The packloader RankPlan the schedule runs: the batches' segments (an empty slot's placeholder row
    included) with the planner's backward order for this DP rank, checked against the step plan."""
    from packloader.contracts import MicroBatch, RankPlan

    mbs = [MicroBatch(segments=list(b["segments"])) for b in batches]
    plan = batches[0].get("step_plan")
    if plan is None:
        return RankPlan(micro_batches=mbs), None
    if dp_rank is None:
        dp_rank = _parallel_ranks()["dp_rank"]
    if not 0 <= dp_rank < len(plan.ranks):
        raise ValueError(f"step {plan.step}: dp_rank {dp_rank} but the plan has {len(plan.ranks)} DP ranks")
    rp = plan.ranks[dp_rank]
    if len(rp.micro_batches) != len(batches):
        raise ValueError(f"step {plan.step}: the plan gives DP rank {dp_rank} {len(rp.micro_batches)} micro-batches, "
                         f"the iterator gave {len(batches)}: pass dp_rank= the loader's dp_rank")
    for j, (pm, b) in enumerate(zip(rp.micro_batches, batches)):
        if pm.dp_group and len(pm.dp_group) > 1:
            raise ValueError(f"step {plan.step}, micro-batch {j} is a DP-Merge micro-batch (dp_group "
                             f"{list(pm.dp_group)}): the Megatron adapter runs no DP-Merge; plan with "
                             "SlimPackPlanner(dp_merge=False) or without DP > 1")
        if pm.segments and list(pm.segments) != list(b["segments"]):
            raise ValueError(f"step {plan.step}, micro-batch {j}: the batch's segments are not those the plan gives DP "
                             f"rank {dp_rank}: pass dp_rank= the loader's dp_rank")
    return RankPlan(micro_batches=mbs, backward_order=rp.backward_order), plan


def step_schedule(step_plan: Any, schedule: str | None, vpp: int = 1) -> str:
    """The schedule a step runs, as the planner's simulator scored it and ``packloader plan`` writes its action
    lists: the one the planner chose for the step (``StepPlan.schedule``, under "auto"), else the configured one
    (``schedule``: the loader's ``PlanConfig.schedule``, which ``MegatronDataIterator`` passes in each batch),
    else 1F1B (interleaved 1F1B with `vpp` > 1 model chunks per rank)."""
    chosen = getattr(step_plan, "schedule", "") if step_plan is not None else ""
    if chosen:
        return chosen
    if schedule in (None, "", "auto"):
        return "1f1b" if vpp == 1 else "interleaved"
    return schedule


def sliced_pipeline_forward_backward(*, forward_step_func, data_iterator, model, num_microbatches: int,
                                     seq_length: int | None = None, micro_batch_size: int | None = None,
                                     decoder_seq_length: int | None = None, forward_only: bool = False,
                                     collect_non_loss_data: bool = False, first_val_step: bool | None = None,
                                     pipeline_group: Any = None, dp_rank: int | None = None,
                                     schedule: str | None = None, actions: Any = None, **unused: Any):
    """Drop-in for Megatron's pipeline schedules at PP > 1 (``forward_backward_pipelining_without_interleaving``,
    and ``..._with_interleaving`` with virtual pipeline stages) that runs a step's micro-batches, slices included,
    through ``packloader.runtime.pipeline.PlanPipelineSchedule`` (see the module).

    ``model``: this rank's model chunk, or its list of ``virtual_pipeline_model_parallel_size`` chunks (their
    attention ``PackloaderCoreAttention``): as megatron-core builds them (``vp_stage=c``: stage c*pp + rank) for
    "interleaved" and "zb-h1", as ``v_shape_model_chunks`` builds them (stages rank and 2*pp-1-rank) for "zb-v";
    chunks of the other placement are refused (``check_chunk_placement``). ``data_iterator``: a
    ``MegatronDataIterator(..., slices=True)`` on every pipeline rank (of a list, the first: every chunk runs the
    same batches). ``pipeline_group`` defaults to Megatron's pipeline group, ``dp_rank`` (which of the step
    plan's ranks is this one's) to Megatron's data-parallel rank. ``forward_only`` (evaluation) runs Megatron's
    own schedule, which needs unsliced batches (interleaved placement). The pipeline schedule is the plan's
    (``step_schedule``): "1f1b", "gpipe", "zb-h1" (split input / weight backwards), "interleaved" or "zb-v",
    whatever ``packloader plan`` writes for the step; ``actions``: this DP rank's written action lists
    (``step_actions(...)[dp_rank]``), run exactly as written instead of the same lists derived from the schedule.
    Returns the forward data store (the loss reports, on the rank holding the last stage), as Megatron's."""
    sched = require("megatron.core.pipeline_parallel.schedules")
    utils = require("megatron.core.utils")
    chunks = list(model) if isinstance(model, list) else [model]
    config = utils.get_model_config(chunks[0])
    check_sliced_pipeline_config(config, num_model_chunks=len(chunks))
    if isinstance(data_iterator, list):
        data_iterator = data_iterator[0]
    if forward_only:
        if len(chunks) > 1:  # Megatron's interleaved schedule: chunks of the V would run out of model order
            group = require("megatron.core.parallel_state").get_pipeline_model_parallel_group()
            check_chunk_placement(chunks, config, "interleaved", dist.get_world_size(group), dist.get_rank(group))
        run_megatron = sched.forward_backward_pipelining_with_interleaving if len(chunks) > 1 else \
            sched.forward_backward_pipelining_without_interleaving
        return run_megatron(
            forward_step_func=forward_step_func, data_iterator=[data_iterator] * len(chunks) if len(chunks) > 1
            else data_iterator, model=chunks, num_microbatches=num_microbatches, seq_length=seq_length,
            micro_batch_size=micro_batch_size, decoder_seq_length=decoder_seq_length, forward_only=True,
            collect_non_loss_data=collect_non_loss_data, first_val_step=first_val_step, **unused)
    for chunk in chunks:
        install_slice_rope(chunk, config)  # RoPE: slices at their document positions, or refused by setting
    if pipeline_group is None:
        pipeline_group = require("megatron.core.parallel_state").get_pipeline_model_parallel_group()
    batches = [next(data_iterator) for _ in range(num_microbatches)]
    for i, b in enumerate(batches):
        if "segments" not in b:
            raise ValueError(f"micro-batch {i} has no 'segments': build the batches with megatron_batch / "
                             "MegatronDataIterator(slices=True)")
    rank_plan, step_plan = _rank_plan(batches, dp_rank)
    chosen = step_schedule(step_plan, schedule or batches[0].get("schedule"), len(chunks))
    check_chunk_placement(chunks, config, chosen, dist.get_world_size(pipeline_group),
                          dist.get_rank(pipeline_group))
    run = _runner(chunks, config, pipeline_group, chosen == "zb-v")
    stores, num_tokens = _run_step(run, sched, config, forward_step_func, batches, rank_plan, chosen, actions,
                                   collect_non_loss_data)
    total = sum(int(n) for n in num_tokens)
    if config.finalize_model_grads_func is not None:
        device = next(chunks[0].parameters()).device
        # the last stage holds the token count; finalize_model_grads broadcasts it over the pipeline group
        config.finalize_model_grads_func(chunks, torch.tensor(total, dtype=torch.int, device=device)
                                         if config.calculate_per_token_loss else None)
    return [r for s in stores for r in s]


def _run_step(run: _PipelineRunner, sched, config, forward_step_func, batches, rank_plan, chosen, actions,
              collect_non_loss_data):
    """One step's forwards and backwards of every chunk of this rank, in the written or simulated order; the
    per-micro-batch loss reports and token counts (on the rank holding the last stage)."""
    n = len(batches)
    for mod in run.modules:
        mod.forward_step_func, mod.batches = forward_step_func, batches
        mod.loss_funcs.clear()
    stores: list[list] = [[] for _ in batches]
    num_tokens = [torch.zeros((), dtype=torch.int) for _ in batches]

    def loss_of(output, j):
        store: list = []
        loss, k = sched.forward_step_calc_loss(run.last.model, output, run.last.loss_funcs.pop(j), config, None,
                                               collect_non_loss_data, n, store, cp_group_size=1,
                                               is_last_stage=True)
        stores[j], num_tokens[j] = store, k
        if config.grad_scale_func is not None:  # as Megatron's backward_step scales the last stage's loss
            loss = config.grad_scale_func(loss)
        return loss

    run._loss_of = loss_of
    run.schedule.schedule = chosen
    no_sync = config.no_sync_func
    syncs = no_sync if isinstance(no_sync, list) else [no_sync or contextlib.nullcontext]
    with contextlib.ExitStack() as stack:
        for f in syncs:  # Megatron gives one no_sync per model chunk with virtual pipeline stages
            stack.enter_context(f())
        run.schedule.step_plan(rank_plan, arg_mbs=[(flat(b["tokens"]),) for b in batches],
                               kwarg_mbs=[{"mb": j} for j in range(n)], target_mbs=list(range(n)), losses=[],
                               actions=actions)
    for mod in run.modules:
        mod.batches = []
    run._loss_of = None
    return stores, num_tokens


def pipeline_schedule_of(model: torch.nn.Module):
    """The ``PlanPipelineSchedule`` that ``sliced_pipeline_forward_backward`` ran last for this model (chunk or
    list of chunks: its executed ``order`` and ``executed`` lists, its stages' ``kv_trace``), or None before the
    first step."""
    got = _LAST.get(id(model[0] if isinstance(model, list) else model))
    return got.schedule if got is not None else None
