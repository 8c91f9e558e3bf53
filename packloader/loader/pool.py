"""Which part of a step's plan is this loader's: its DP rank's RankPlan, or, under per-document context parallelism
(`StepPlan.cp_mode` "dynamic", one RankPlan per GPU of the DP x CP pool), pool GPU `dp_rank * cp + cp_rank`'s, each
micro-batch cut to that GPU's tokens (`collate.cp_document_shards.localize`). Every token of a dynamic micro-batch lands on
exactly one GPU of its group, so the pool trains each token once."""

from __future__ import annotations

from typing import Sequence

from packloader.collate.batch import PackedBatch
from packloader.collate.cp_document_shards import check_chains, localize
from packloader.contracts import MicroBatch, ParallelConfig, StepPlan


def ranks_expected(plan: StepPlan, parallel: ParallelConfig) -> int:
    """RankPlans a plan of this layout holds: one per DP rank, or one per pool GPU (dp x cp) when dynamic."""
    return parallel.dp * parallel.cp if plan.cp_mode == "dynamic" else parallel.dp


def own_rank(plan: StepPlan, parallel: ParallelConfig, dp_rank: int, cp_rank: int | None) -> int:
    """The index of this loader's RankPlan in `plan.ranks`."""
    if plan.cp_mode != "dynamic":
        return dp_rank
    if cp_rank is None:
        if parallel.cp > 1:
            raise ValueError(f"step {plan.step} is planned with per-document context parallelism (cp_mode "
                             f"'dynamic', cp={parallel.cp}): each CP rank trains its own part, so the loader needs "
                             "this GPU's CP rank: PackedLoader(..., cp_rank=...)")
        cp_rank = 0
    if not 0 <= cp_rank < parallel.cp:
        raise ValueError(f"cp_rank={cp_rank} is outside the context-parallel group: parallel.cp={parallel.cp}")
    return dp_rank * parallel.cp + cp_rank


def localize_step(batches: Sequence[PackedBatch], micro_batches: Sequence[MicroBatch], gpu: int,
                  pool: int) -> list[PackedBatch]:
    """The pool GPU's part of each of its collated micro-batches (a chain's slices checked to follow their earlier
    slices on the same CP group)."""
    check_chains(micro_batches, gpu=gpu, step=batches[0].step if batches else None)
    return [localize(b, mb, gpu=gpu, pool=pool) for b, mb in zip(batches, micro_batches)]
