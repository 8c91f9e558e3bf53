"""Sliced plans inside pipeline stages: a `torch.distributed.pipelining` schedule that runs a packloader step
plan, slices (SlimPack) and DP-Merge micro-batches included.

Entry point (this process is pipeline rank `pp_rank` of DP rank `dp_rank`; one stage per model chunk it holds):

    stages = [SlicedPipelineStage(chunk_module, stage_index=c * pp + pp_rank, num_stages=pp * vpp, device=dev,
                                  input_example=..., output_example=..., group=pipeline_group)
              for c, chunk_module in enumerate(my_chunks)]
    sched = PlanPipelineSchedule(stages, loss_fn, schedule="1f1b")     # "interleaved" when vpp > 1
    # "zb-v" (vpp 2): the V placement, stage_index r and 2*pp-1-r on pipeline rank r instead of c*pp + r
    for step_plan in plans:                                            # every rank holds the whole StepPlan
        mbs = step_plan.ranks[dp_rank].micro_batches
        losses = sched.step_plan(step_plan.ranks[dp_rank],
                                 arg_mbs=[(token_ids(mb),) for mb in mbs],          # first stage's inputs
                                 kwarg_mbs=[{"position_ids": pos(mb)} for mb in mbs],  # given to every stage
                                 target_mbs=[(labels(mb), step_plan.loss_tokens) for mb in mbs], losses=[])
        # DP all-reduce of gradients (DDP/FSDP around chunk_module, or by hand), then optimizer.step()

Every attention layer of a stage module calls `current_slice_context().attention(q, k, v)` (the context of the
micro-batch the stage is running); activations between stages are token-major (`[tokens, ...]` as Megatron's
`[s, b, h]`, or the token dimension given by `token_dim`), so each micro-batch's own token count sets the
shapes. tests/helpers/pipeline_model.py is a complete small example (a Llama-like model split into stage modules).

What runs, and why it matches the simulator:

* The action lists are the simulator's (`balancers.sim.kernels.build_ops`, the order `SimResult.order(rank)`
  scores), turned into the engine's `_Action`s (virtual stage c*pp + s on rank s, the engine's loop mapping)
  and lowered with the engine's own `_add_send_recv`; or the lists `packloader plan` wrote for the step
  (`step_plan(..., actions=record["actions"][dp_rank])`), checked by `pipeline_actions.engine_actions` and run
  exactly as written (`executed` records what ran, in the same [op, micro_batch, stage] form). Forwards go in micro-batch order; backwards in the plan's
  `backward_order` or the simulator's default (a sliced document's micro-batches last slice first), so on every
  stage the backward of a later slice runs before that of the slice whose keys it read.
* Slices: each stage has a KV cache (`SliceKVCache`, keyed by layer, document and token range). A micro-batch
  whose segment a later micro-batch of this step reads stores that segment's keys/values at each layer as
  views of the tensors its own forward holds anyway (no copy: they live until its backward, as the activations
  do). A later slice reads them as autograd leaves; the gradient that reaches a leaf is added to the entry's
  accumulator (a post-accumulate hook), and when the earlier micro-batch's backward runs, an identity autograd
  node on its keys/values adds the accumulated gradient. The entries of a micro-batch, accumulators included,
  are freed when its backward ends; the last of them when the document's first slice (its last backward) ends.
  There is no recomputation (unlike `SliceExecutor`, which has no pipeline to keep activations in flight).
* DP-Merge micro-batches (no slices in them) run their attention through `groups.dp_merge_attention`: this rank
  feeds the rows of its CP shard (`groups.dp_merge_shard(mb, dp_rank=..., rank_map=...)`: `token_index` into the
  packed micro-batch, `position_ids`); the group's stage-s ranks must run the shared micro-batches in the same
  order, which `step_plan` checks on the whole StepPlan when it is given one.

What the engine could not express, and what was added at its seams (subclasses, no engine of our own):

* Variable shapes: `PipelineStage` allocates one receive buffer per micro-batch from one static shape. The
  stage here is built in static mode with one example per input/output (any token count) and, before each
  step, resizes every micro-batch's activation and gradient receive buffers to that micro-batch's tokens
  (`SlicedPipelineStage.size_buffers`). The number of micro-batches may change from step to step.
* The slice context: `forward_one_chunk` is wrapped so the micro-batch's `SliceContext` is active while the
  stage module runs, and `backward_one_chunk` so the cache entries are dropped after the micro-batch's backward
  (and the order checked: a micro-batch whose keys a later one read must not run backward first).
* The schedule: `_PipelineScheduleRuntime` with the simulator's compute actions loaded through
  `_prepare_schedule_with_comms` (the engine's custom-schedule path, as its CSV loader uses); the step takes
  pre-split micro-batches (`arg_mbs`, `kwarg_mbs`, `target_mbs`), since the engine's splitter cuts a batch into
  equal chunks. Gradients are not rescaled (`scale_grads=False`): the loss function scales, as packloader's
  losses are normalised by the step's loss tokens.

ZB-V (schedule "zb-v", two stages per rank placed as a V): the engine infers which rank holds which stage from
the action lists, and passes activations and gradients between a rank's own two stages (pp-1 and pp on the last
rank) without communication; the split backwards are ZB-H1's, below.

Split backwards (ZB-H1 and ZB-V, schedules "zb-h1" and "zb-v", or written lists with "W"): a "B" with a "W" of
the same micro-batch and stage runs as the engine's input-gradient action (I) and the "W" as its weight-gradient
action. The engine's
I differentiates the stage inputs only, so `SlicedPipelineStage` adds the keys and values a slice read from
earlier micro-batches to those inputs and hands their gradients to the cache before the earlier slice's I; on
the first stage the engine runs the whole backward at W, and the cache follows. The key/value gradient of a
sliced document crosses micro-batches on the same stage only, so no extra communication.
"""


from __future__ import annotations

import inspect
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch.distributed.pipelining.schedules import (
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    FULL_BACKWARD,
    _Action,
    _PipelineScheduleRuntime,
)

from packloader.balancers.sim.kernels import SCHEDULES, ZB_H1, ZB_V, build_ops
from packloader.balancers.sim.simulator import check_backward_order, default_backward_order, slice_edges_of
from packloader.contracts import MicroBatch, RankPlan, StepPlan
from packloader.runtime.pipeline_actions import engine_actions, rank_stages, written_actions
from packloader.runtime.pipeline_stage import (
    CarriedKVCache,
    KVSample,
    PipelineSliceContext,
    SlicedPipelineStage,
    _StepInfo,
)
from packloader.runtime.slices import SlicesNotSupported, analyse_chain

RUNS = ("1f1b", "gpipe", "interleaved", "zb-h1", "zb-v")  # the simulator's schedules this runs

__all__ = [
    "simulated_actions",
    "engine_actions",
    "written_actions",
    "rank_backward_order",
    "SlicedPipelineStage",
    "PlanPipelineSchedule",
    "PipelineSliceContext",
    "CarriedKVCache",
    "KVSample",
]


# ----------------------------------------------------------------------------------------------- actions


def rank_backward_order(micro_batches: Sequence[MicroBatch], backward_order: Sequence[int] | None = None) -> np.ndarray:
    """The backward order of a rank's micro-batches: the plan's (checked against the slice edges) or the
    simulator's default (a sliced document's micro-batches last slice first)."""
    m = len(micro_batches)
    edges, _ = slice_edges_of(micro_batches)
    order = default_backward_order(m, edges) if backward_order is None else np.asarray(backward_order, dtype=np.int64)
    check_backward_order(order, m, edges)
    return order


def simulated_actions(micro_batches: Sequence[MicroBatch], pp: int, *, vpp: int = 1, schedule: str = "1f1b",
                      backward_order: Sequence[int] | None = None) -> dict[int, list[_Action]]:
    """Per pipeline rank, the compute actions (forward / full backward per stage and micro-batch) in the order
    the simulator scores (`sim.kernels.build_ops`): stage c*pp + s of model chunk c runs on rank s (ZB-V:
    stages s and 2*pp-1-s)."""
    kind = SCHEDULES.get(schedule)
    if kind is None or schedule not in RUNS:
        raise ValueError(f"unknown schedule {schedule!r}; expected one of {sorted(RUNS)}")
    check_stages_per_rank(schedule, vpp)
    if schedule in ("interleaved", "zb-h1") and vpp > 1 and len(micro_batches) % pp:
        raise ValueError(f"interleaved 1F1B needs the micro-batch count to be a multiple of pp "
                         f"({len(micro_batches)} % {pp} != 0), as Megatron does")
    m = len(micro_batches)
    order = rank_backward_order(micro_batches, backward_order)
    ops = build_ops(pp, vpp, m, kind, order)
    out: dict[int, list[_Action]] = {}
    for s in range(pp):
        acts = []
        for t in ops[s]:
            vu, op = divmod(int(t), 3)
            vs, u = divmod(vu, m)
            split = kind in (ZB_H1, ZB_V)
            acts.append(_Action(vs, (FORWARD, BACKWARD_INPUT if split else FULL_BACKWARD, BACKWARD_WEIGHT)[op], u))
        out[s] = acts
    return out


def check_stages_per_rank(schedule: str, vpp: int) -> None:
    """Interleaved 1F1B and ZB-H1 (then interleaved zero bubble) run any number of model chunks per rank, ZB-V
    exactly two, the others one."""
    if schedule == "zb-v" and vpp != 2:
        raise ValueError(f"schedule 'zb-v' needs 2 stages per rank (rank r: stages r and 2*pp-1-r), got {vpp}")
    if vpp > 1 and schedule not in ("interleaved", "zb-h1", "zb-v"):
        raise ValueError(f"{vpp} stages per rank need schedule 'interleaved', 'zb-h1' or 'zb-v' (at 2)")


# ---------------------------------------------------------------------------------------------- schedule


def _tokens_and_shards(mbs: Sequence[MicroBatch], dp_rank: int | None, rank_map: Sequence[int] | None):
    from packloader.runtime.groups import dp_merge_shard

    tokens, shards = [], {}
    for j, mb in enumerate(mbs):
        if mb.dp_group and len(mb.dp_group) > 1:
            sliced = [s for s in mb.segments if s.attend_from < s.start]
            if sliced:
                raise SlicesNotSupported(
                    f"micro-batch {j} is a DP-Merge micro-batch (dp_group {list(mb.dp_group)}) holding a slice of "
                    f"document {sliced[0].doc}: context-parallel attention over a KV cache is not supported; plan "
                    f"with allow_slicing=False for DP-Merge")
            if dp_rank is None:
                raise ValueError(f"micro-batch {j} is a DP-Merge micro-batch (dp_group {list(mb.dp_group)}): "
                                 f"step_plan needs dp_rank (and the groups, prepared with prepare_dp_merge_groups)")
            shards[j] = dp_merge_shard(mb, dp_rank=dp_rank, rank_map=rank_map)
            tokens.append(shards[j].num_tokens)
        else:
            tokens.append(mb.num_tokens)
    return tokens, shards


def _readers(mbs: Sequence[MicroBatch]) -> dict[int, set[int]]:
    """Micro-batch -> the later micro-batches whose slices read its keys (the previous slice's micro-batch and
    every earlier one a prefix reaches back to)."""
    readers: dict[int, set[int]] = {}
    edges, _ = slice_edges_of(mbs)
    for a, b in edges:
        readers.setdefault(int(a), set()).add(int(b))
    for u, mb in enumerate(mbs):
        for s in mb.segments:
            if s.attend_from < s.start:
                for j in range(u):
                    if any(t.doc == s.doc and t.start < s.start and t.end > s.attend_from for t in mbs[j].segments):
                        readers.setdefault(j, set()).add(u)
    return readers


class PlanPipelineSchedule(_PipelineScheduleRuntime):
    """Runs one DP rank's micro-batches of a packloader plan through its pipeline, in the simulator's order.

    `stages`: this pipeline rank's SlicedPipelineStages (one per model chunk: stage c*pp + rank). `loss_fn
    (output, target)` runs on the last stage per micro-batch and should return the micro-batch's loss already
    scaled as the step wants it summed (e.g. token loss sum / the step's loss tokens); gradients accumulate into
    `.grad` unscaled. `schedule`: "1f1b", "gpipe", "zb-h1", "interleaved" (then vpp = stages per rank) or "zb-v"
    (two stages per rank placed as a V: pipeline rank r holds stages r and 2*pp-1-r).
    For DP-Merge micro-batches give `dp_rank`, `rank_map` (DP rank -> global rank of this pipeline stage; see
    groups.py) and `groups` (a ProcessGroupCache prepared on every rank).
    """

    def __init__(self, stages: Sequence[SlicedPipelineStage], loss_fn: Callable[..., torch.Tensor], *,
                 schedule: str = "1f1b", dp_rank: int | None = None, rank_map: Sequence[int] | None = None,
                 groups: Any = None) -> None:
        stages = list(stages)
        if not stages or not all(isinstance(s, SlicedPipelineStage) for s in stages):
            raise TypeError("PlanPipelineSchedule needs this rank's SlicedPipelineStage objects")
        if loss_fn is None:  # a forward-only pass would never free the carried KV (backwards free it)
            raise TypeError("PlanPipelineSchedule trains: it needs a loss_fn(output, target)")
        super().__init__(stages, 1, loss_fn=loss_fn, scale_grads=False)
        self.pp = self.pp_group_size
        self.vpp = len(stages)
        if self._num_stages != self.pp * self.vpp:
            raise ValueError(f"{self._num_stages} stages over {self.pp} pipeline ranks with {self.vpp} stage(s) on "
                             f"this rank: every rank must hold num_stages / pp stages")
        if schedule not in RUNS:
            raise ValueError(f"unknown schedule {schedule!r}; expected one of {sorted(RUNS)}")
        check_stages_per_rank(schedule, self.vpp)
        self.v_shape = schedule == "zb-v"
        held = sorted(st.stage_index for st in stages)
        if held != rank_stages(self.rank, self.pp, self.vpp, self.v_shape):
            raise ValueError(f"pipeline rank {self.rank} holds stages {held}; schedule {schedule!r} places stages "
                             f"{rank_stages(self.rank, self.pp, self.vpp, self.v_shape)} on it")
        self.schedule = schedule
        self.dp_rank, self.rank_map, self.groups = dp_rank, rank_map, groups
        self.order: list[tuple[str, int, int]] = []
        self.executed: list[list] = []  # this rank's actions of the last step as run: [op, micro_batch, stage]
        for st in stages:
            st.chunk = held.index(st.stage_index)
            st.order = self.order
            st.executed = self.executed
            st._dp_merge = self._dp_merge_attention
        self._actions: dict[int, list[_Action]] = {}

    def _dp_merge_attention(self, mb: MicroBatch, q, k, v, *, shard=None, **opts):
        from packloader.runtime.groups import dp_merge_attention

        return dp_merge_attention(q, k, v, mb, dp_rank=self.dp_rank, shard=shard, rank_map=self.rank_map,
                                  groups=self.groups, **opts)

    def _run_pre_split(self, arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs):
        """The engine's step() on micro-batches already split; on a torch without that, what its step() does
        around `_step_microbatches` (the GPU machines' torch 2.11)."""
        if _STEP_TAKES_MICRO_BATCHES:
            return self.step(arg_mbs=arg_mbs, kwarg_mbs=kwarg_mbs, target_mbs=target_mbs, losses=losses,
                             return_outputs=return_outputs)
        for st in self._stages:
            st.has_backward = self._has_backward
            st.clear_runtime_states()
        self._step_microbatches(arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs)
        last = [st for st in self._stages if st.is_last]
        return self._merge_outputs(last[0].output_chunks) if last and return_outputs else None

    def actions(self, rank: int | None = None) -> list[_Action]:
        """The compute actions of the last step on pipeline rank `rank` (default: this one)."""
        return list(self._actions[self.rank if rank is None else rank])

    def step_plan(self, rank_plan: RankPlan | Sequence[MicroBatch], *, arg_mbs: list | None = None,
                  kwarg_mbs: list | None = None, target_mbs: list | None = None, losses: list | None = None,
                  step_plan: StepPlan | None = None, actions: Sequence | None = None,
                  plan_actions: Sequence | None = None, return_outputs: bool = False) -> list | None:
        """Run one step of this DP rank's micro-batches (forward and backward of every stage this rank holds).

        `arg_mbs[j]`: the first stage's positional inputs of micro-batch j (e.g. `(token_ids,)`); `kwarg_mbs[j]`
        keyword inputs passed to every stage's module (e.g. position ids); `target_mbs[j]`: the last stage's
        loss target. Returns the per-micro-batch losses on the last stage (else None). `step_plan`, when given,
        is checked for DP-Merge order consistency across the groups' members. `actions`: this DP rank's action
        lists as `packloader plan` writes them (`step_actions(...)[dp_rank]`: per pipeline rank [[op,
        micro_batch, stage], ...]), run exactly as written after `engine_actions` checks them; default the
        simulator's order for `schedule`. `plan_actions`: the record's lists of every DP rank (this one's is
        `plan_actions[dp_rank]`; the DP-Merge check then uses them)."""
        if isinstance(rank_plan, RankPlan):
            mbs, bo = list(rank_plan.micro_batches), rank_plan.backward_order
        else:
            mbs, bo = list(rank_plan), None
        m = len(mbs)
        if m == 0:
            raise ValueError("a step needs at least one micro-batch on this rank")
        kept = analyse_chain(mbs, rank=self.dp_rank)
        readers = _readers(mbs)
        tokens, shards = _tokens_and_shards(mbs, self.dp_rank, self.rank_map)
        if plan_actions is not None and actions is None:
            if self.dp_rank is None:
                raise ValueError("plan_actions holds every DP rank's lists: step_plan needs dp_rank to pick this one")
            actions = plan_actions[self.dp_rank]
        if step_plan is not None:
            check_dp_merge_order(step_plan, self.pp, vpp=self.vpp, schedule=self.schedule, actions=plan_actions)
        if actions is None:
            actions = simulated_actions(mbs, self.pp, vpp=self.vpp, schedule=self.schedule, backward_order=bo)
        else:
            actions = engine_actions(actions, m, self.pp, self.vpp, readers, v_shape=self.v_shape)
        self._n_microbatches = m
        self._actions = {r: list(a) for r, a in actions.items()}
        self._prepare_schedule_with_comms({r: list(a) for r, a in actions.items()})
        info = _StepInfo(mbs, tokens, kept, readers, shards)
        if arg_mbs is None:
            arg_mbs = [()] * m
        if kwarg_mbs is None:
            kwarg_mbs = [{}] * m
        # the engine builds its buffers from the examples on the first step; then every step resizes them
        for st in self._stages:
            st.has_backward = self._has_backward
        self._initialize_stages(arg_mbs[0], kwarg_mbs[0], target_mbs[0] if target_mbs else None)
        for st in self._stages:
            st.begin_step(info)
            st.size_buffers(tokens)
        self.order.clear()
        self.executed.clear()
        out = self._run_pre_split(arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs)
        for st in self._stages:
            if len(st.cache):
                raise RuntimeError(f"stage {st.stage_index}: {len(st.cache)} KV cache entries left after the step")
        if any(st.is_last for st in self._stages) and losses is not None:
            return losses
        return out


# torch 2.14's step() takes pre-split micro-batches; before it, step() splits a whole batch into equal chunks
_STEP_TAKES_MICRO_BATCHES = "arg_mbs" in inspect.signature(_PipelineScheduleRuntime.step).parameters


def check_dp_merge_order(plan: StepPlan, pp: int, *, vpp: int = 1, schedule: str = "1f1b",
                         actions: Sequence | None = None) -> None:
    """Every DP-Merge group's members must run their shared micro-batches in the same order on each pipeline
    rank (the attention collectives pair up in that order); raise naming the group and the orders if not.
    `actions`: the written lists of every DP rank (default: the simulator's for `schedule`)."""
    shared: dict[tuple[int, ...], dict[int, list[int]]] = {}
    for r, rp in enumerate(plan.ranks):
        for j, mb in enumerate(rp.micro_batches):
            if mb.dp_group and len(mb.dp_group) > 1:
                shared.setdefault(tuple(sorted(mb.dp_group)), {}).setdefault(r, []).append(j)
    if not shared:
        return
    orders = {r: (engine_actions(actions[r], len(rp.micro_batches), pp, vpp, v_shape=schedule == "zb-v")
                  if actions is not None else
                  simulated_actions(rp.micro_batches, pp, vpp=vpp, schedule=schedule, backward_order=rp.backward_order))
              for r, rp in enumerate(plan.ranks) if any(r in g for g in shared)}
    for g, per_rank in shared.items():
        seqs = {}
        for r in g:
            mbs = plan.ranks[r].micro_batches
            mine = set(per_rank.get(r, []))  # identified by their segments: positions may differ
            for s in range(pp):
                seqs.setdefault(s, {})[r] = [
                    (a.computation_type.value, a.stage_index,
                     tuple((x.doc, x.start, x.end, x.attend_from) for x in mbs[a.microbatch_index].segments))
                    for a in orders[r][s] if a.microbatch_index in mine]
        for s, by_rank in seqs.items():
            first = by_rank[g[0]]
            for r in g[1:]:
                if by_rank[r] != first:
                    raise ValueError(
                        f"step {plan.step}: DP-Merge group {list(g)} runs its shared micro-batches in different orders "
                        f"on pipeline rank {s} (at positions {per_rank.get(g[0])} of DP rank {g[0]}'s list and "
                        f"{per_rank.get(r)} of DP rank {r}'s); their attention collectives would not pair up")
