"""megatron-core's hybrid context parallelism, run on CPU on one step's document lengths, as a packloader plan.

The peer that per-document CP is compared with (issue 26): megatron-core 0.16's `BalancedCPScheduler`
(`pipeline_parallel/hybrid_cp_schedule.py`) as `HybridCPDataLoaderWrapper` (`datasets/data_schedule.py`) builds
and calls it. Megatron's own code does all the scheduling (its workload function, its CP size per sample, its
groups of DP x CP ranks); nothing here re-implements it. The one stand-in is the DP x CP process group, of which
the scheduler reads only `size()`; the set of CP groups megatron can form comes from its own
`parallel_state.create_hybrid_dp_cp_groups` with the group constructor replaced by one that returns the ranks.

Megatron's output, per group (a phase that ends in a barrier over the DP x CP ranks): the sample ids each GPU runs,
in order, each one a forward/backward of its own. A sample's CP group is the GPUs that hold it in that group (its
`local_cp_size` is their count, as megatron's schedule computes it). The plan has one micro-batch per sub-sample
(or, with layout="group", per group) on every pool GPU; `megatron_slots` gives each group's slots and
`barrier_step_time` prices the barriers, which a plan cannot express (docs/megatron-hybrid-cp.md).
"""

from __future__ import annotations

import operator
import warnings
from collections.abc import Sequence
from typing import Literal
from unittest import mock

from packloader.balancers.planners.registry import Window
from packloader.contracts import CPPlacement, MicroBatch, RankPlan, Segment, StepPlan

with warnings.catch_warnings():  # megatron-core warns on import that Transformer Engine and Apex are absent
    warnings.simplefilter("ignore")
    from megatron.core import parallel_state
    from megatron.core.datasets.data_schedule import HybridCPDataLoaderWrapper
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.pipeline_parallel.hybrid_cp_schedule import BalancedCPScheduler
    from megatron.core.process_groups_config import ProcessGroupCollection

# StepPlan.extra keys this module fills (per step):
#   megatron_groups         megatron's groups (phases, each ended by a barrier over the DP x CP GPUs) in the step
#   megatron_idle_share     share of GPU time idle at the groups' barriers, by megatron's own workload estimate
#   pad_tokens_required     tokens megatron-core's hybrid CP requires padded: every sample to a multiple of
#                           2 x DP x CP (x TP with sequence parallelism), as its dataset config states
#   pad_tokens_min          padding its CP split cannot do without: each sample at CP size s > 1 to a multiple of 2s
#   placements_outside_megatron_groups  segments whose GPUs are not one of the CP groups megatron creates
#   megatron_slots_group_<j>  the slots (micro-batches per GPU) group j takes: see megatron_slots
SLOTS_KEY = "megatron_slots_group_"


class MegatronSchedulerError(RuntimeError):
    """megatron-core's own scheduler failed on input this module accepted (its error chained)."""


class _PoolGroup:
    """Stands in for a process group: the scheduler and the wrapper's constructor read only its size."""

    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size


def megatron_wrapper(*, dp: int, cp: int, max_tokens_per_gpu: int) -> HybridCPDataLoaderWrapper:
    """Megatron's hybrid-CP data-loader wrapper over a real `ModelParallelConfig`: it builds the scheduler from
    the config (`max_seqlen_per_dp_cp_rank`) and the DP x CP group's size, as in training. It reads no data here."""
    config = ModelParallelConfig(context_parallel_size=cp, hybrid_context_parallel=True,
                                 max_seqlen_per_dp_cp_rank=max_tokens_per_gpu)
    groups = ProcessGroupCollection(dp_cp=_PoolGroup(dp * cp), dp=_PoolGroup(dp), tp=_PoolGroup(1))
    return HybridCPDataLoaderWrapper(None, config, pg_collection=groups)


def megatron_cp_groups(pool: int) -> set[tuple[int, int]]:
    """(size, first GPU) of every CP group megatron creates over a DP x CP pool: its `create_hybrid_dp_cp_groups`
    (power-of-two sizes from 2 up to half the largest power of two within the pool, aligned), the whole pool, and
    single GPUs (no group)."""
    ranks = list(range(pool))
    found = {(1, r) for r in ranks} | {(pool, 0)}
    with mock.patch.object(parallel_state, "create_group", lambda group_ranks, **_: tuple(group_ranks)):
        for rank in ranks:
            for members in parallel_state.create_hybrid_dp_cp_groups(rank, ranks, None).values():
                found.add((len(members), members[0]))
    return found


def megatron_hybrid_cp_schedule(lengths: Sequence[int], *, dp: int, cp: int,
                                 max_tokens_per_gpu: int) -> list[list[list[int]]]:
    """Megatron's own output: per group, per pool GPU (dp_rank * cp + cp_rank), the sample ids (indices into
    `lengths`) it runs, in order. Refuses what megatron would silently drop or fail on, naming the sample."""
    lengths = [_count(n, f"lengths[{i}]") for i, n in enumerate(lengths)]
    return _run(lengths, dp=dp, cp=cp, max_tokens_per_gpu=max_tokens_per_gpu)[1]


def _run(lengths: Sequence[int], *, dp: int, cp: int,
         max_tokens_per_gpu: int) -> tuple[BalancedCPScheduler, list[list[list[int]]]]:
    _check_layout(dp=dp, cp=cp, max_tokens_per_gpu=max_tokens_per_gpu)
    wrapper = megatron_wrapper(dp=dp, cp=cp, max_tokens_per_gpu=max_tokens_per_gpu)
    scheduler = wrapper.cp_balancing_scheduler
    _check_lengths(lengths, scheduler, pool=dp * cp, max_tokens_per_gpu=max_tokens_per_gpu)
    try:  # sample ids as the wrapper numbers them: positions in the step's list of sub-sample lengths
        _, sample_id_groups = scheduler.get_groups_and_subsamples(list(enumerate(lengths)), wrapper.config)
    except (AssertionError, IndexError) as err:  # seen on pools that are not a power of two (docs/megatron-hybrid-cp.md)
        raise MegatronSchedulerError(f"megatron-core's BalancedCPScheduler failed at dp x cp = {dp * cp} on "
                                     f"{len(lengths)} samples: {type(err).__name__}: {err}") from err
    return scheduler, sample_id_groups


def _check_layout(*, dp: int, cp: int, max_tokens_per_gpu: int) -> None:
    for name, value in (("dp", dp), ("cp", cp), ("max_tokens_per_gpu", max_tokens_per_gpu)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: expected a positive integer, got {value!r}")
    pool = dp * cp
    if pool % 2:
        raise ValueError(f"dp x cp = {pool}: megatron-core's hybrid context parallelism needs an even number of "
                         "DP x CP ranks (parallel_state asserts it)")


def _count(value: object, name: str) -> int:
    """An integer of any kind (numpy's included) as an int; anything else refused, naming it."""
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{name} = {value!r}: expected an integer token count") from None


def _check_lengths(lengths: Sequence[int], scheduler: BalancedCPScheduler, *, pool: int,
                   max_tokens_per_gpu: int) -> None:
    for i, length in enumerate(lengths):
        if length < 1:
            raise ValueError(f"lengths[{i}] = {length!r}: expected a positive token count (megatron's wrapper "
                             "drops empty sub-samples without a word)")
        if scheduler.gpus_needed(length) > pool:  # megatron would fail an assertion once no group could take it
            raise ValueError(f"lengths[{i}] = {length} tokens: megatron's CP size for it (max_tokens_per_gpu = "
                             f"{max_tokens_per_gpu}, rounded up to a power of two) is "
                             f"{scheduler.gpus_needed(length)}, over its dp x cp = {pool} GPUs")


def group_placements(group: list[list[int]]) -> dict[int, CPPlacement]:
    """Each sample's GPUs in one megatron group, read as megatron's schedule reads them (its `local_cp_size` is
    the number of GPUs whose list holds it). Contiguous GPUs become a CPPlacement; anything else is refused,
    since no CPPlacement can name it."""
    holders: dict[int, list[int]] = {}
    for gpu, sample_ids in enumerate(group):
        for sample_id in dict.fromkeys(sample_ids):
            holders.setdefault(sample_id, []).append(gpu)
    out = {}
    for sample_id, gpus in holders.items():
        if gpus != list(range(gpus[0], gpus[0] + len(gpus))):
            raise ValueError(f"sample {sample_id}: megatron placed it on GPUs {gpus}, not a contiguous range")
        out[sample_id] = CPPlacement(size=len(gpus), first=gpus[0])
    return out


def megatron_hybrid_cp_plan(lengths: Sequence[int], *, dp: int, cp: int, max_tokens_per_gpu: int, step: int = 0,
                            segments: Sequence[Segment] | None = None, sequence_parallel_tp: int = 1,
                            layout: Literal["sample", "group"] = "sample") -> StepPlan:
    """megatron-core's hybrid-CP schedule of one step's samples as a StepPlan with cp_mode "dynamic".

    `lengths[i]` is sample i's token count; `segments[i]`, if given, names it (its doc and token range: a piece of a
    document), else sample i is `Segment(i, 0, lengths[i], 0)`. `sequence_parallel_tp`: the TP size when sequence
    parallelism is on (megatron's padding rule multiplies by it). `layout`: "sample" (one micro-batch per
    sub-sample, as megatron runs them: each GPU's k-th sample of group j in slot `megatron_slots(plan)[j].start +
    k`, empty micro-batches where a GPU has fewer) or "group" (one micro-batch per group per GPU, its samples
    together). Megatron's figures go in `extra` (keys above).
    """
    lengths = [_count(n, f"lengths[{i}]") for i, n in enumerate(lengths)]
    if segments is not None:
        if len(segments) != len(lengths):
            raise ValueError(f"segments: {len(segments)} given for {len(lengths)} lengths")
        for i, (seg, length) in enumerate(zip(segments, lengths)):
            if seg.end - seg.start != length:
                raise ValueError(f"segments[{i}] holds {seg.end - seg.start} tokens, lengths[{i}] = {length}")
    if layout not in ("sample", "group"):
        raise ValueError(f"layout: expected 'sample' or 'group', got {layout!r}")
    scheduler, groups = _run(lengths, dp=dp, cp=cp, max_tokens_per_gpu=max_tokens_per_gpu)
    per_group = [group_placements(group) for group in groups]
    named = list(segments) if segments is not None else [Segment(i, 0, n, 0) for i, n in enumerate(lengths)]
    ranks, widths = _micro_batches(groups, per_group, named, dp * cp, layout)
    sizes = {i: place.size for placements in per_group for i, place in placements.items()}
    formable = megatron_cp_groups(dp * cp)
    extra = {
        "megatron_groups": float(len(groups)),
        "megatron_idle_share": idle_share(scheduler, groups, per_group, lengths),
        "pad_tokens_required": float(padding(lengths, [2 * dp * cp * sequence_parallel_tp] * len(lengths))),
        "pad_tokens_min": float(padding(lengths, [2 * sizes[i] if sizes[i] > 1 else 1 for i in range(len(lengths))])),
        "placements_outside_megatron_groups": float(sum((p.size, p.first) not in formable
                                                        for placements in per_group for p in placements.values())),
    }
    extra |= {f"{SLOTS_KEY}{j}": float(w) for j, w in enumerate(widths)}
    return StepPlan(step=step, ranks=ranks, planner="megatron-hybrid-cp", cp_mode="dynamic", extra=extra)


def _micro_batches(groups: list[list[list[int]]], per_group: list[dict[int, CPPlacement]], named: list[Segment],
                   pool: int, layout: str) -> tuple[list[RankPlan], list[int]]:
    """Every pool GPU's micro-batches, and the slots each megatron group takes."""
    ranks = [RankPlan(micro_batches=[]) for _ in range(pool)]
    widths = []
    for group, placements in zip(groups, per_group):
        width = 1 if layout == "group" else max(len(ids) for ids in group)
        widths.append(width)
        for gpu, ids in enumerate(group):
            units = [ids] if layout == "group" else [[i] for i in ids] + [[]] * (width - len(ids))
            ranks[gpu].micro_batches += [MicroBatch(segments=[named[i] for i in unit], cp=[placements[i] for i in unit])
                                         for unit in units]
    return ranks, widths


def megatron_slots(plan: StepPlan) -> list[range]:
    """The slots of each megatron group in a plan from `megatron_hybrid_cp_plan`, in order."""
    out, start = [], 0
    for j in range(int(plan.extra["megatron_groups"])):
        width = int(plan.extra[f"{SLOTS_KEY}{j}"])
        out.append(range(start, start + width))
        start += width
    return out


def barrier_step_time(plan: StepPlan, slot_times: Sequence[Sequence[float]]) -> float:
    """Megatron's step time from each micro-batch's time (`slot_times[slot][gpu]`, waits for CP partners
    included): every group lasts as long as its busiest GPU, since a barrier over the DP x CP GPUs ends it."""
    return sum(max(sum(slot_times[m][g] for m in slots) for g in range(len(plan.ranks)))
               for slots in megatron_slots(plan))


def megatron_hybrid_cp_window_plan(window: Window, *, step: int, dp: int, cp: int, max_tokens_per_gpu: int,
                                   sequence_parallel_tp: int = 1) -> StepPlan:
    """The same for a step's drawn pieces (a planner's Window): each piece one megatron sub-sample."""
    segments = [Segment(int(d), int(o), int(o + n), int(o)) for d, o, n in zip(window.doc, window.offset,
                                                                               window.length)]
    return megatron_hybrid_cp_plan([int(n) for n in window.length], dp=dp, cp=cp, max_tokens_per_gpu=max_tokens_per_gpu,
                                   step=step, segments=segments, sequence_parallel_tp=sequence_parallel_tp)


def padding(lengths: Sequence[int], multiples: Sequence[int]) -> int:
    """Tokens added to bring each length up to its multiple."""
    return sum(-n % m for n, m in zip(lengths, multiples))


def idle_share(scheduler: BalancedCPScheduler, groups: list[list[list[int]]],
               placements_per_group: list[dict[int, CPPlacement]], lengths: Sequence[int]) -> float:
    """Share of GPU time spent waiting at the barrier that ends each megatron group, each sample priced by
    megatron's own workload estimate (`get_total_workload`) at the CP size it runs at."""
    busy_total = span_total = 0.0
    for group, placements in zip(groups, placements_per_group):
        busy = [sum(scheduler.get_total_workload(lengths[i], placements[i].size) for i in ids) for ids in group]
        busy_total += sum(busy)
        span_total += max(busy, default=0.0) * len(group)
    return 0.0 if span_total == 0 else 1.0 - busy_total / span_total
