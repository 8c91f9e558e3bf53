"""DeepSpeed adapter: packloader micro-batches in a DeepSpeed engine loop, in the pipeline engine, and for
DeepSpeed-Ulysses sequence parallelism.

Engine loop (``DeepSpeedEngine``): one packloader step is one optimizer step. ``steps(loader)`` groups a loader's
micro-batches by step; ``train_step(engine, micro_batches, loss_sum_fn)`` runs them with the loss of each micro-batch
scaled to ``sum / loss_tokens_in_step * dp_world_size`` and ``engine.backward(loss, scale_wrt_gas=False)``, so that
after DeepSpeed averages gradients over data-parallel ranks the step's gradient is the per-token mean over the
global step. The engine's ``gradient_accumulation_steps`` must equal the micro-batches per step (checked). A
micro-batch slot a planner left empty (every DP rank runs the same count, so a rank with fewer pieces gets empty
slots) runs as a one-token padding row without a loss target (``placeholder_batch``), its loss multiplied by 0:
a real forward and backward, so DeepSpeed's micro-step count, its gradient reduction (ZeRO stages included) and
a pipeline's schedule stay in step on every rank. ``PipelineBatches`` and ``ulysses_batch`` give the same row.

Pipeline engine (``PipelineEngine.train_batch(data_iter)``): ``PipelineBatches(loader)`` yields
``(inputs, labels)`` tuples: inputs ``(input_ids [1, T] int64, position_ids [1, T] int64, cu_seqlens [S+1] int32)``
for the first stage, labels ``(labels [1, T] int64, loss_scale [1] float32)`` for the last, with ``loss_scale =
gradient_accumulation_steps * dp_world_size / loss_tokens_in_step`` (the engine divides each micro-batch loss by
the accumulation steps and averages over DP; ``pipeline_loss_fn`` undoes both and normalises per token). Token counts
vary per micro-batch: build the ``PipelineModule`` with ``dynamic_shape=True`` so stages exchange shapes for every
micro-batch (or use ``pad_to_tokens`` for one fixed size).

DeepSpeed-Ulysses: every SP rank holds an equal contiguous 1/SP of the packed row; Ulysses' all-to-all then gives
each rank the whole row for 1/SP of the heads, so attention runs per document on the global ``cu_seqlens``.
``ulysses_batch(batch, sp_size, sp_rank)`` pads the row to a multiple of SP (the padding is its own segment in
``cu_seqlens``, labels -100, positions restarting at 0, so it attends to nothing real) and returns this rank's shard
with positions reset per document and per piece. ``ulysses_hf_batch`` gives the whole padded row in the Hugging Face
convention that DeepSpeed's ``UlyssesSPDataLoaderAdapter`` shards itself (``input_ids``, ``position_ids``, unshifted
``labels``); that adapter derives its targets by shifting ``labels`` inside the row, so there the last token of a
piece of a document longer than the context has no target (its target, the next piece's first token, is not in
the row) and the loss covers one token per piece boundary less than ``loss_tokens_in_step`` counts. The documents were balanced by packloader across micro-batches and DP ranks; inside a micro-batch,
Ulysses splits work evenly by construction (all heads' attention over the same row).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator, Sequence

import torch

from packloader.collate.batch import IGNORE_INDEX, PackedBatch

from ._common import check_micro_batches, flat, placeholder_batch, refuse_dp_merge, refuse_slices, unshifted_labels
from ._lazy import require

__all__ = [
    "deepspeed_batch",
    "steps",
    "train_step",
    "PipelineBatches",
    "pipeline_loss_fn",
    "ulysses_batch",
    "ulysses_hf_batch",
]


def _dp_world(engine: Any = None) -> int:
    if engine is not None and hasattr(engine, "dp_world_size"):
        return int(engine.dp_world_size)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return 1


def deepspeed_batch(batch: PackedBatch, *, device: Any = None, pad_id: int = 0) -> dict[str, Any]:
    """The micro-batch as `[1, T]` tensors plus varlen metadata, for a model called inside an engine loop; an empty
    micro-batch as a one-token row of `pad_id` without a loss target (`placeholder_batch`)."""
    refuse_slices(batch, "a DeepSpeed engine")
    refuse_dp_merge(batch, "a DeepSpeed engine")
    if batch.num_tokens == 0:
        batch = placeholder_batch(batch, 1, pad_id)
    out = {
        "input_ids": flat(batch.input_ids).unsqueeze(0),
        "position_ids": flat(batch.position_ids).unsqueeze(0),
        "labels": flat(batch.labels).unsqueeze(0),
        "cu_seqlens": batch.cu_seqlens_padded if batch.cu_seqlens_padded is not None else batch.cu_seqlens,
        "max_seqlen": int(batch.max_seqlen),
        "loss_tokens_in_step": int(batch.loss_tokens_in_step),
    }
    if device is not None:
        out = {k: (v.to(device, non_blocking=True) if torch.is_tensor(v) else v) for k, v in out.items()}
    return out


def steps(loader: Iterable[PackedBatch]) -> Iterator[list[PackedBatch]]:
    """A loader's micro-batches grouped into whole steps (this rank's micro-batches of one step, in order)."""
    group: list[PackedBatch] = []
    for b in loader:
        if group and b.step != group[0].step:
            yield group
            group = []
        group.append(b)
        if len(group) == b.micro_batches_in_step:
            yield group
            group = []
    if group:
        yield group


def train_step(engine: Any, micro_batches: Sequence[PackedBatch],
               loss_sum_fn: Callable[[Any, dict[str, Any]], torch.Tensor]) -> float:
    """One optimizer step of a ``DeepSpeedEngine`` over one packloader step. ``loss_sum_fn(engine, batch_dict)``
    returns the summed token loss of a micro-batch. Returns this rank's summed loss / the step's loss tokens."""
    ga = int(engine.gradient_accumulation_steps())
    mb = micro_batches[0]
    check_micro_batches(mb.step, len(micro_batches), ga, "DeepSpeed(gradient_accumulation_steps)")
    scale = _dp_world(engine) / max(1, mb.loss_tokens_in_step)
    total = 0.0
    for b in micro_batches:
        loss_sum = loss_sum_fn(engine, deepspeed_batch(b, device=engine.device))
        if b.num_tokens == 0:  # the placeholder row: a real forward and backward, nothing learnt from it
            loss_sum = loss_sum * 0.0
        engine.backward(loss_sum * scale, scale_wrt_gas=False)
        engine.step()
        total += float(loss_sum.detach())
    return total / max(1, mb.loss_tokens_in_step)


class PipelineBatches:
    """``(inputs, labels)`` tuples for ``PipelineEngine.train_batch`` / ``eval_batch`` (see the module)."""

    def __init__(self, loader: Iterable[PackedBatch], *, gradient_accumulation_steps: int,
                 dp_world_size: int | None = None) -> None:
        self.loader = loader
        self.ga = int(gradient_accumulation_steps)
        self.dp = dp_world_size
        self._it: Iterator[PackedBatch] | None = None

    def __iter__(self) -> "PipelineBatches":
        return self

    def __next__(self) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, torch.Tensor]]:
        if self._it is None:
            self._it = iter(self.loader)
        b = next(self._it)
        check_micro_batches(b.step, b.micro_batches_in_step, self.ga, "PipelineEngine(gradient_accumulation_steps)")
        d = deepspeed_batch(b)
        dp = self.dp if self.dp is not None else _dp_world()
        scale = torch.tensor([self.ga * dp / max(1, b.loss_tokens_in_step)], dtype=torch.float32)
        return (d["input_ids"], d["position_ids"], d["cu_seqlens"].to(torch.int32)), (d["labels"], scale)

    def state_dict(self) -> dict:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state)
        self._it = None


def pipeline_loss_fn(logits: torch.Tensor, labels: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """``PipelineModule(loss_fn=...)``: summed next-token cross-entropy times the micro-batch's loss scale."""
    target, scale = labels
    if isinstance(logits, (tuple, list)):
        logits = logits[0]
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1),
                                           ignore_index=IGNORE_INDEX, reduction="sum")
    return ce * scale.reshape(()).to(ce.dtype)


def _pad_row(batch: PackedBatch, multiple: int, pad_id: int):
    """The row's tensors padded to a multiple of `multiple`, the padding as its own segment."""
    ids, lab, pos = flat(batch.input_ids), flat(batch.labels), flat(batch.position_ids)
    cu = batch.cu_seqlens_padded if batch.cu_seqlens_padded is not None else batch.cu_seqlens
    T = ids.numel()
    pad = (-T) % multiple
    if pad:
        ids = torch.cat([ids, torch.full((pad,), pad_id, dtype=ids.dtype)])
        lab = torch.cat([lab, torch.full((pad,), IGNORE_INDEX, dtype=lab.dtype)])
        pos = torch.cat([pos, torch.arange(pad, dtype=pos.dtype)])
        cu = torch.cat([cu, torch.tensor([T + pad], dtype=cu.dtype)])
    return ids, lab, pos, cu.to(torch.int32), pad


def ulysses_batch(batch: PackedBatch, sp_size: int, sp_rank: int, *, pad_id: int = 0) -> dict[str, Any]:
    """This SP rank's contiguous shard of the (padded) row, with the global `cu_seqlens` its attention needs after
    Ulysses' all-to-all. Labels are packloader's (shifted: the target of each local token)."""
    if not (0 <= sp_rank < sp_size):
        raise ValueError(f"sp_rank must be in [0, {sp_size}), got {sp_rank}")
    refuse_slices(batch, "DeepSpeed-Ulysses")
    refuse_dp_merge(batch, "DeepSpeed-Ulysses")
    if batch.num_tokens == 0:  # every SP rank still takes part in the all-to-all: one padding token each
        batch = placeholder_batch(batch, sp_size, pad_id)
    ids, lab, pos, cu, pad = _pad_row(batch, sp_size, pad_id)
    n = ids.numel() // sp_size
    sl = slice(sp_rank * n, (sp_rank + 1) * n)
    return {
        "input_ids": ids[sl].unsqueeze(0),
        "labels": lab[sl].unsqueeze(0),
        "position_ids": pos[sl].unsqueeze(0),
        "cu_seqlens": cu,
        "max_seqlen": int(torch.diff(cu).max()) if cu.numel() > 1 else 0,
        "padding": pad,
        "loss_tokens_in_step": int(batch.loss_tokens_in_step),
    }


def ulysses_hf_batch(batch: PackedBatch, sp_size: int, *, pad_id: int = 0) -> dict[str, torch.Tensor]:
    """The whole row padded to a multiple of `sp_size` in the HF convention DeepSpeed's
    ``UlyssesSPDataLoaderAdapter`` takes (it shards the row and derives ``shift_labels`` itself)."""
    refuse_slices(batch, "DeepSpeed-Ulysses")
    refuse_dp_merge(batch, "DeepSpeed-Ulysses")
    if batch.num_tokens == 0:
        batch = placeholder_batch(batch, sp_size, pad_id)
    ids, _, pos, _, pad = _pad_row(batch, sp_size, pad_id)
    labels = unshifted_labels(batch)
    if pad:
        labels = torch.cat([labels, torch.full((pad,), IGNORE_INDEX, dtype=labels.dtype)])
    return {"input_ids": ids.unsqueeze(0), "position_ids": pos.unsqueeze(0), "labels": labels.unsqueeze(0)}


def disable_shm_comm_op() -> None:
    """Make DeepSpeed's CPU backend use torch.distributed directly instead of JIT-building its shared-memory
    all-reduce C++ op (minutes of compilation on first use; CPU tests and examples only)."""
    ops = require("deepspeed.ops")
    ops.__compatible_ops__["deepspeed_shm_comm"] = False
