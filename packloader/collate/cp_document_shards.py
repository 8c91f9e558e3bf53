"""Per-document context parallelism (``StepPlan.cp_mode == "dynamic"``): what one GPU of the DP x CP pool owns of
its micro-batch when every segment runs on its own aligned group of GPUs (``MicroBatch.cp``).

A segment placed on ``CPPlacement(size, first)`` appears in micro-batch m of each of the GPUs ``first .. first +
size - 1``. All segments of one placement in a micro-batch form that group's packed row, which is sharded over the
group as ``cp_sequence_shards``' "document" mode does it (each document in 2 x size chunks, rank i taking chunks i and
2 x size - 1 - i, remainders dealt round-robin, no padding); at size 1 the row stays whole on its GPU. The group's
row lists its segments sorted by (doc, start, end), so every member derives the same row whatever order its own
list holds them in. A GPU's local tokens are its groups' shards one after the other, larger groups first, then by
first GPU: the order every GPU runs their collectives in (a global order, so collectives over nested groups
cannot wait on each other in a cycle).

A slice (attend_from < start: a dynamic-cp chain's later slice, or a slice of a piece longer than the pool) is
sharded like a document of its own tokens; its positions continue the piece's, and each of its runs sees the
start - attend_from keys of its earlier slices first (`run_prefix`, counted in `cu_seqlens_k`). Those keys are not
in the micro-batch: the group's GPUs kept them from earlier micro-batches of the step, where the earlier slices ran
on the same group (`check_chains`; `runtime.cp_chains` runs it).

``localize`` turns the collated whole micro-batch (``collate``) into this GPU's batch: its tokens, labels (next
tokens of the document, -100 at a document's last token: exactly the whole row's labels at those tokens),
positions (the document offset), ``cu_seqlens`` of its query runs and ``cu_seqlens_k`` of the keys each run sees in
its group's all-gathered keys. Every token of the micro-batch is on exactly one GPU of the pool, so the GPUs'
``num_loss_tokens`` add up to the micro-batch's loss tokens, and ``loss_tokens_in_step`` (each segment counted
once, ``collate.loss_tokens_in_plan``) normalises the loss over the pool.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from packloader.collate.batch import PackedBatch
from packloader.collate.cp_layouts import TileEstimate
from packloader.collate.cp_sequence_shards import CPRankShard, plan_cp_shards
from packloader.contracts import CPPlacement, MicroBatch, Segment

__all__ = ["DynamicCPGroup", "DynamicCPShard", "check_chains", "check_placement", "plan_dynamic_cp", "localize", "group_order"]


@dataclass
class DynamicCPGroup:
    """One CP group of a GPU's micro-batch: the segments placed on `size` GPUs from `first`, and this GPU's shard."""

    size: int
    first: int
    rank: int  # this GPU's shard of the group: gpu - first
    segments: np.ndarray  # int64: indices into the micro-batch's segments, in the group row's order
    shard: CPRankShard  # this GPU's shard of the group row (cp_size = size)
    lo: int  # the group's rows in this GPU's local tensors: lo .. hi - 1
    hi: int
    offsets: np.ndarray = field(default_factory=lambda: np.zeros(1, np.int64))  # int64: each segment's first token
    #                                                                          in the group row, and the row's end

    @property
    def gpus(self) -> range:
        return range(self.first, self.first + self.size)


@dataclass
class DynamicCPShard:
    """What one pool GPU owns of one micro-batch of a dynamic-CP plan and what its attention needs."""

    gpu: int
    groups: list[DynamicCPGroup]  # in run order (group_order)
    token_index: np.ndarray  # int64 [n]: packed positions in the whole micro-batch row, group by group
    position_ids: np.ndarray  # int64 [n]: each local token's offset in its document
    cu_seqlens_q: np.ndarray  # int32 [R+1]: local query runs, all groups
    cu_seqlens_k: np.ndarray  # int32 [R+1]: keys each run sees in its group's gathered keys (causal)
    run_segment: np.ndarray  # int64 [R]: the micro-batch segment of each run
    run_prefix: np.ndarray  # int64 [R]: earlier keys of a slice's run (start - attend_from), first in its keys
    max_seqlen_q: int
    max_seqlen_k: int
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_tokens(self) -> int:
        return int(self.token_index.size)


def group_order(placement: CPPlacement) -> tuple[int, int]:
    """The run order of groups: larger first, then by first GPU (the same on every GPU)."""
    return (-int(placement.size), int(placement.first))


def check_placement(p: CPPlacement, where: str, pool: int | None = None) -> None:
    """An aligned power-of-two group: size 1, 2, 4 .., first a multiple of size (within the pool when known)."""
    size, first = int(p.size), int(p.first)
    if size < 1 or size & (size - 1):
        raise ValueError(f"{where}: CP size {size} is not a power of two (1, 2, 4, ...)")
    if first < 0 or first % size:
        raise ValueError(f"{where}: CP group starts at GPU {first}, not a multiple of its size {size} (groups are "
                         "aligned blocks of the DP x CP pool)")
    if pool is not None and first + size > pool:
        raise ValueError(f"{where}: CP group GPUs {first}..{first + size - 1} lie outside the pool of {pool} GPUs")


def _where(i: int, s: Segment) -> str:
    return f"segment {i} (document {s.doc}, tokens {s.start}..{s.end - 1})"


def _groups_of(segments: Sequence[Segment], placements: Sequence[CPPlacement], gpu: int, pool: int | None):
    if len(placements) != len(segments):
        raise ValueError(f"a dynamic-CP micro-batch needs one CPPlacement per segment: {len(placements)} placements "
                         f"for {len(segments)} segments")
    by: dict[tuple[int, int], list[int]] = {}
    for i, (s, p) in enumerate(zip(segments, placements)):
        check_placement(p, _where(i, s), pool)
        if not p.first <= gpu < p.first + p.size:
            raise ValueError(f"{_where(i, s)} is placed on GPUs {p.first}..{p.first + p.size - 1}, which do not "
                             f"include pool GPU {gpu}: this micro-batch is not GPU {gpu}'s")
        by.setdefault((int(p.size), int(p.first)), []).append(i)
    keys = sorted(by, key=lambda k: group_order(CPPlacement(*k)))
    return [(k, sorted(by[k], key=lambda i: (segments[i].doc, segments[i].start, segments[i].end))) for k in keys]


def check_chains(micro_batches: Sequence[MicroBatch], *, gpu: int, step: int | None = None) -> None:
    """Every slice of a GPU's step (a dynamic-cp chain's later slice, or a slice of a piece longer than the pool)
    must find its earlier keys (attend_from .. start - 1) in earlier micro-batches of the step on the same CP group:
    the group's GPUs kept them when they ran those slices (`runtime.cp_chains`)."""
    held: dict[tuple[int, int, int], list[tuple[int, int]]] = {}  # (doc, size, first) -> token ranges run so far
    for m, mb in enumerate(micro_batches):
        for i, (s, p) in enumerate(zip(mb.segments, mb.cp or ())):
            if s.attend_from >= s.start:
                continue
            ranges = sorted(held.get((s.doc, int(p.size), int(p.first)), []))
            pos = s.attend_from
            for a, b in ranges:
                if a <= pos < b:
                    pos = b
            if pos < s.start:
                at = f"step {step}, " if step is not None else ""
                raise ValueError(f"{at}micro-batch {m} of pool GPU {gpu}: {_where(i, s)} is a slice on GPUs "
                                 f"{p.first}..{p.first + p.size - 1}, but token {pos} of its document, which it attends "
                                 "to, ran in no earlier micro-batch on that CP group; expected a chain's slices on "
                                 "one subgroup (the same CPPlacement) in consecutive micro-batches")
        for s, p in zip(mb.segments, mb.cp or ()):
            held.setdefault((s.doc, int(p.size), int(p.first)), []).append((s.start, s.end))


def plan_dynamic_cp(segments: Sequence[Segment] | MicroBatch, placements: Sequence[CPPlacement] | None = None, *,
                    gpu: int, pool: int | None = None) -> DynamicCPShard:
    """Pool GPU `gpu`'s part of a micro-batch whose segment i runs on `placements[i]` (a MicroBatch: its `cp`)."""
    if isinstance(segments, MicroBatch):
        placements = segments.cp if placements is None else placements
        segments = segments.segments
    if placements is None:
        raise ValueError("a dynamic-CP micro-batch needs its placements (MicroBatch.cp)")
    segments = list(segments)
    lengths = np.array([s.end - s.start for s in segments], dtype=np.int64)
    prefix = np.array([s.start - s.attend_from for s in segments], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64) if lengths.size else lengths
    groups, idx, pos, cu_q, cu_k, run_seg = [], [], [], [np.zeros(1, np.int64)], [np.zeros(1, np.int64)], []
    at = q_at = k_at = 0
    for (size, first), members in _groups_of(segments, placements, gpu, pool):
        members = np.asarray(members, dtype=np.int64)
        shard = plan_cp_shards(lengths[members], size, "document", cost=TileEstimate(),
                               position_offsets=prefix[members])[gpu - first]
        gstart = np.concatenate([[0], np.cumsum(lengths[members])[:-1]]).astype(np.int64)
        member_of = np.searchsorted(gstart, shard.token_index, side="right") - 1
        idx.append(starts[members][member_of] + shard.token_index - gstart[member_of])
        pos.append(shard.position_ids)
        _, keys, _ = shard.key_layout(causal=True)
        run_pre = prefix[members[shard.run_segment]]
        keys = keys.astype(np.int64)
        keys[1:] += np.cumsum(run_pre)  # a slice's run sees its earlier slices' keys first
        cu_q.append(q_at + shard.cu_seqlens_q[1:].astype(np.int64))
        cu_k.append(k_at + keys[1:])
        q_at, k_at = q_at + int(shard.cu_seqlens_q[-1]), k_at + int(keys[-1])
        run_seg.append(members[shard.run_segment])
        groups.append(DynamicCPGroup(size=size, first=first, rank=gpu - first, segments=members, shard=shard,
                                     lo=at, hi=at + shard.num_tokens,
                                     offsets=np.append(gstart, gstart[-1] + lengths[members[-1]])))
        at += shard.num_tokens
    cat = (lambda xs: np.concatenate(xs).astype(np.int64)) if groups else (lambda xs: np.zeros(0, np.int64))
    q, k = np.concatenate(cu_q), np.concatenate(cu_k)
    return DynamicCPShard(
        gpu=int(gpu), groups=groups, token_index=cat(idx), position_ids=cat(pos), cu_seqlens_q=q.astype(np.int32),
        cu_seqlens_k=k.astype(np.int32), run_segment=cat(run_seg), run_prefix=prefix[cat(run_seg)],
        max_seqlen_q=int(np.diff(q).max()) if q.size > 1 else 0,
        max_seqlen_k=int(np.diff(k).max()) if k.size > 1 else 0)


def localize(batch: PackedBatch, mb: MicroBatch, *, gpu: int, pool: int | None = None) -> PackedBatch:
    """This pool GPU's batch of the collated whole micro-batch `batch` (collate of `mb.segments`, unpadded): its
    tokens, labels and positions, its query runs as `cu_seqlens` and their keys as `cu_seqlens_k`, its loss tokens;
    the shard in `batch.cp` (`dynamic_cp_attention` in packloader.runtime.cp_document_attention runs it)."""
    if batch.cu_seqlens_padded is not None:
        raise ValueError("per-document CP shards the unpadded micro-batch: collate it without pad_to_multiple / "
                         "pad_to_tokens")
    if list(batch.segments) != list(mb.segments):
        raise ValueError(f"step {batch.step}, micro-batch {batch.index_in_step}: the batch holds other segments than "
                         "the plan's micro-batch")
    shard = plan_dynamic_cp(mb, gpu=gpu, pool=pool)
    shape = (1, -1) if batch.layout == "hf" else (-1,)
    # numpy gathers: torch's indexing kernels cost milliseconds here on a loaded CPU (thread start-up per call)
    ids, labels = (t.reshape(-1).numpy()[shard.token_index] for t in (batch.input_ids, batch.labels))
    return dataclasses.replace(
        batch, input_ids=torch.from_numpy(ids).reshape(shape), labels=torch.from_numpy(labels).reshape(shape),
        position_ids=torch.from_numpy(shard.position_ids).reshape(shape),
        cu_seqlens=torch.from_numpy(shard.cu_seqlens_q), cu_seqlens_k=torch.from_numpy(shard.cu_seqlens_k),
        max_seqlen=shard.max_seqlen_q, max_seqlen_k=shard.max_seqlen_k,
        doc_ids=torch.from_numpy(batch.doc_ids.numpy()[shard.run_segment]),
        num_loss_tokens=int(np.count_nonzero(labels != -100)), cp=shard, extra=dict(batch.extra))
