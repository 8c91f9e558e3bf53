"""Framework-free pieces the adapters share: slice and DP-Merge refusal, micro-batch count checks, HF-convention labels, the
placeholder row of an empty micro-batch."""

from __future__ import annotations

import dataclasses

import torch

from packloader.collate.batch import IGNORE_INDEX, PackedBatch
from packloader.contracts import Segment


def pipeline_alternative() -> str:
    """The packloader schedule that runs sliced plans across pipeline stages, where this install has it."""
    import importlib.util

    if importlib.util.find_spec("packloader.runtime.pipeline") is None:
        return ""
    return ("; across pipeline stages: packloader.runtime.pipeline.PlanPipelineSchedule (torch.distributed.pipelining "
            "with a per-stage KV cache of the earlier slices; for Megatron-core: "
            "packloader_integrations.megatron.sliced_pipeline_forward_backward)")


def refuse_slices(batch: PackedBatch, consumer: str) -> None:
    """Trainers that run each micro-batch on its own cannot run SlimPack slices (they need an earlier micro-batch's
    keys and values). Raises ``SlicesNotSupported`` (a ValueError) naming the setting and the alternatives."""
    from packloader.runtime.slices import SlicesNotSupported

    for s in batch.segments:
        if s.attend_from != s.start:
            raise SlicesNotSupported(
                f"{consumer} cannot run sliced documents: step {batch.step}, micro-batch {batch.index_in_step} holds "
                f"a slice of document {s.doc} (tokens {s.start}..{s.end}, attending from {s.attend_from}), whose "
                "attention needs the keys and values of earlier micro-batches. Plan with "
                "PlanConfig(allow_slicing=False); trainers that run slices (without pipeline stages): "
                "packloader_integrations.hf.PackedTrainer and packloader_integrations.megatron.sliced_forward_backward"
                + pipeline_alternative()
            )


def refuse_dp_merge(batch: PackedBatch, consumer: str) -> None:
    """A DP-Merge micro-batch (SlimPack: one micro-batch run by a group of DP ranks as context parallelism) reaches
    every rank of its group whole, labels included: trained as an ordinary micro-batch on each, its loss tokens
    would count once per rank. Trainers that cannot run the group refuse it, as the Megatron adapter does."""
    group = batch.dp_group
    if group is not None and len(group) > 1:
        raise ValueError(
            f"{consumer} cannot run DP-Merge micro-batches: step {batch.step}, micro-batch {batch.index_in_step} is "
            f"shared by DP ranks {list(group)} (MicroBatch.dp_group), each of which gets it whole; trained as an "
            f"ordinary micro-batch on each, its {int(batch.num_tokens)} tokens would train {len(group)} times. Plan "
            "without DP-Merge: PlanConfig(planner_options={'slimpack': {'dp_merge': False}}) (auto's slimpack "
            "candidate included), or another strategy")


def check_micro_batches(step: int, count: int, expected: int | None, consumer: str, fix: str | None = None) -> None:
    """A trainer with a fixed number of micro-batches per step (gradient accumulation steps) must get exactly that
    many from every packloader step, or its optimizer steps and packloader's steps drift apart. `fix`: what to set,
    where the caller knows the loader's config (default: num_micro_batches = the trainer's count)."""
    if expected is not None and count != expected:
        raise ValueError(
            f"{consumer} runs {expected} micro-batches per optimizer step, but packloader step {step} gives "
            f"this rank {count}: " + (fix or f"set PlanConfig(num_micro_batches={expected}) and a planner that honours it")
        )


def placeholder_batch(batch: PackedBatch, tokens: int = 1, pad_id: int = 0) -> PackedBatch:
    """What an adapter runs for an empty micro-batch: one segment of `tokens` padding tokens (document id -1),
    positions from 0, no loss target.

    Planners give every DP rank the same number of micro-batches (Megatron's num_microbatches, DeepSpeed's and
    the Trainer's gradient_accumulation_steps are one number for all ranks), so a rank with fewer pieces than
    the fullest one gets empty slots. Skipping one would leave that rank a forward/backward short: under DDP the
    gradient all-reduce fires in the last micro-batch's backward, and in a pipeline every stage expects each
    micro-batch, so the other ranks would wait forever. Running this row instead keeps every rank in step and
    adds zero to the loss, to its normaliser and to the gradient."""
    n = int(tokens)
    cu = torch.tensor([0, n], dtype=torch.int32)
    return dataclasses.replace(
        batch,
        input_ids=torch.full((n,), int(pad_id), dtype=torch.int64),
        labels=torch.full((n,), IGNORE_INDEX, dtype=torch.int64),
        position_ids=torch.arange(n, dtype=torch.int64),
        cu_seqlens=cu, cu_seqlens_k=cu.clone(), max_seqlen=n, max_seqlen_k=n,
        doc_ids=torch.tensor([-1], dtype=torch.int64), segments=[Segment(-1, 0, n, 0)], num_loss_tokens=0,
        cu_seqlens_padded=None if batch.cu_seqlens_padded is None else cu.clone(),
        extra={**batch.extra, "placeholder": True},
    )


def flat(t: torch.Tensor) -> torch.Tensor:
    """[T] view of a `[T]` or `[1, T]` token tensor (the loader's two layouts)."""
    return t.reshape(-1)


def unshifted_labels(batch: PackedBatch) -> torch.Tensor:
    """Labels in the Hugging Face convention ([T]): `labels[t]` is token t itself, -100 where token t must not be
    predicted (the first token of every segment, and padding). A model shifts them by one inside its loss, which
    then equals packloader's (shifted) labels everywhere except at a piece's last token, whose target lies in the
    next piece (not in this row): use `shift_labels` (packloader's labels) to keep that target."""
    ids = flat(batch.input_ids)
    lab = flat(batch.labels)
    out = torch.full_like(ids, IGNORE_INDEX)
    cu = batch.cu_seqlens.tolist()
    offsets = batch.cu_seqlens_padded.tolist() if batch.cu_seqlens_padded is not None else cu
    for i in range(len(cu) - 1):
        o, q = offsets[i], cu[i + 1] - cu[i]
        if q > 1:  # tokens o+1 .. o+q-1 are predicted by their predecessors in the same segment
            out[o + 1 : o + q] = ids[o + 1 : o + q]
            # a predecessor whose packloader label is -100 (none inside a segment) would not predict: keep in step
            out[o + 1 : o + q][lab[o : o + q - 1] == IGNORE_INDEX] = IGNORE_INDEX
    return out
