"""Packloader micro-batches as Megatron batches (THD format): the batch dict, the data iterator, the datasets
provider, the forward step and loss, and the config checks (see the package docstring)."""

from __future__ import annotations

import logging
from functools import partial
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import torch

from packloader.collate.batch import IGNORE_INDEX, PackedBatch
from packloader.loader.step_metrics import format_step_metrics

from .._common import check_micro_batches, flat, pipeline_alternative, placeholder_batch, refuse_dp_merge, refuse_slices
from .._lazy import require
from ..entry_loss import token_entries
from .shard_mode import shard_mode_of

SLICES_PP_ALTERNATIVE = "plan with PlanConfig(allow_slicing=False)"

CP_LAYOUTS = ("packloader", "te")

log = logging.getLogger("packloader.megatron")


def _packed_seq_params_cls():
    return require("megatron.core.packed_seq_params").PackedSeqParams


def te_partition_index(cu_seqlens_padded: np.ndarray | torch.Tensor, cp_size: int, cp_rank: int) -> np.ndarray:
    """Token indices of CP rank `cp_rank` in TransformerEngine's THD layout (``tex.thd_get_partitioned_indices``):
    every padded segment in 2 x CP equal chunks, the rank taking chunks ``r`` and ``2CP-1-r``."""
    cu = np.asarray(cu_seqlens_padded.tolist() if torch.is_tensor(cu_seqlens_padded) else cu_seqlens_padded,
                    dtype=np.int64)
    n = 2 * cp_size
    parts = []
    for i in range(cu.size - 1):
        length = int(cu[i + 1] - cu[i])
        if length % n:
            raise ValueError(
                f"segment {i} spans {length} padded tokens, not a multiple of 2 x CP = {n}: TransformerEngine's THD "
                f"context parallelism needs collate padding pad_to_multiple={n} (PackedLoader(pad_to_multiple={n})), "
                "or use cp_layout='packloader', which needs no padding"
            )
        c = length // n
        for chunk in (cp_rank, n - 1 - cp_rank):
            parts.append(np.arange(cu[i] + chunk * c, cu[i] + (chunk + 1) * c, dtype=np.int64))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def _thd_rows(batch: PackedBatch, cp_size: int, cp_rank: int, sliced: bool, ids, lab, pos):
    """Megatron's own THD layout: the whole micro-batch at CP 1, TransformerEngine's two-chunk partition of the
    padded documents above it."""
    PackedSeqParams = _packed_seq_params_cls()
    if cp_size > 1:
        if batch.cu_seqlens_padded is None:
            raise ValueError(
                f"cp_layout='te' with CP={cp_size} needs the padded collate variant "
                f"(PackedLoader(pad_to_multiple={2 * cp_size}))")
        index = torch.from_numpy(te_partition_index(batch.cu_seqlens_padded, cp_size, cp_rank))
        ids, lab, pos = ids[index], lab[index], pos[index]
    padded = batch.cu_seqlens_padded if batch.cu_seqlens_padded is not None else batch.cu_seqlens
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=batch.cu_seqlens,
        cu_seqlens_kv=batch.cu_seqlens if sliced else batch.cu_seqlens_k,
        cu_seqlens_q_padded=padded,
        cu_seqlens_kv_padded=padded,
        max_seqlen_q=int(batch.max_seqlen),
        max_seqlen_kv=int(batch.max_seqlen if sliced else batch.max_seqlen_k),
    )
    return ids, lab, pos, params


def _packloader_cp_rows(batch: PackedBatch, cp_size: int, cp_rank: int, shard_mode: str, cost_model: Any, ids, lab):
    """packloader's balanced CP shard of the unpadded micro-batch; the shard travels on the params down to
    `PackloaderCoreAttention`."""
    from packloader.collate.cp_sequence_shards import plan_cp_shards
    from packloader.runtime.cp_cost import cp_cost

    PackedSeqParams = _packed_seq_params_cls()
    if batch.cu_seqlens_padded is not None:
        raise ValueError("cp_layout='packloader' shards the unpadded micro-batch: build the loader without "
                         "pad_to_multiple / pad_to_tokens")
    lengths = [s.end - s.start for s in batch.segments]
    offsets = [s.start - s.attend_from for s in batch.segments]  # the collate's positions (0: no slices)
    shard = plan_cp_shards(lengths, cp_size, shard_mode, position_offsets=offsets, cost=cp_cost(cost_model))[cp_rank]
    index = torch.from_numpy(shard.token_index)
    ids, lab = ids[index], lab[index]
    pos = torch.from_numpy(shard.position_ids)
    _, cu_k, max_k = shard.key_layout(causal=True)
    cu_q = torch.from_numpy(shard.cu_seqlens_q.astype(np.int32))
    cu_k = torch.from_numpy(np.asarray(cu_k, dtype=np.int32))
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu_q,
        cu_seqlens_kv=cu_k,
        cu_seqlens_q_padded=cu_q,
        cu_seqlens_kv_padded=cu_k,
        max_seqlen_q=int(shard.max_seqlen_q),
        max_seqlen_kv=int(max_k),
    )
    params.packloader_shard = shard
    return ids, lab, pos, params, shard


def megatron_batch(
    batch: PackedBatch,
    *,
    cp_size: int = 1,
    cp_rank: int = 0,
    cp_layout: str = "packloader",
    cp_shard_mode: str = "document",
    cost_model: Any = None,
    label_pad: int = 0,
    device: Any = None,
    slices: bool = False,
    cp_mode: str | None = None,
) -> dict[str, Any]:
    """One PackedBatch -> the dict Megatron's GPT ``get_batch`` returns, for this CP rank (see the module). With
    ``slices=True`` a sliced batch (CP 1 only) is passed on for ``sliced_forward_backward``: its
    ``PackedSeqParams`` count this batch's own rows (``cu_seqlens_kv == cu_seqlens_q``; the earlier slices' keys come
    from the executor's cache) and ``batch["segments"]`` holds the segments."""
    cp_shard_mode = shard_mode_of(cp_shard_mode, cp_mode, "megatron_batch")
    if cp_layout not in CP_LAYOUTS:
        raise ValueError(f"cp_layout must be one of {CP_LAYOUTS}, got {cp_layout!r}")
    if not (0 <= cp_rank < cp_size):
        raise ValueError(f"cp_rank must be in [0, {cp_size}), got {cp_rank}")
    sliced = slices and any(s.attend_from < s.start for s in batch.segments)
    if sliced and cp_size > 1:
        raise ValueError(f"step {batch.step}, micro-batch {batch.index_in_step} holds slices and CP={cp_size}: context "
                         f"parallelism cannot shard slices; {SLICES_PP_ALTERNATIVE} when CP > 1")
    if not sliced:
        refuse_slices(batch, "Megatron-core's THD attention")
    refuse_dp_merge(batch, "the Megatron adapter")
    entries = token_entries(batch)  # a mixture's entry of each token, for packloader/loss/<entry>
    if batch.num_tokens == 0:  # an empty slot: 2 x CP padding tokens (each CP rank two), no loss target
        batch = placeholder_batch(batch, 2 * cp_size)
    ids, lab, pos = flat(batch.input_ids), flat(batch.labels), flat(batch.position_ids)
    shard = None
    if cp_size == 1 or cp_layout == "te":
        ids, lab, pos, params = _thd_rows(batch, cp_size, cp_rank, sliced, ids, lab, pos)
    else:
        ids, lab, pos, params, shard = _packloader_cp_rows(batch, cp_size, cp_rank, cp_shard_mode, cost_model, ids, lab)
    out = gpt_sample(ids, lab, pos, params, label_pad, device)
    out["cp_shard"] = shard
    out["num_loss_tokens_in_step"] = int(batch.loss_tokens_in_step)
    out["segments"] = list(batch.segments)
    out["step_plan"] = batch.plan  # the StepPlan (backward order) for sliced_pipeline_forward_backward
    out["step_metrics"] = batch.step_metrics  # what the loader knows about the step (packloader.StepMetrics)
    if entries is not None and cp_size > 1:  # this CP rank's rows, as the tokens
        entries = entries[torch.from_numpy(shard.token_index if shard is not None else
                                           te_partition_index(batch.cu_seqlens_padded, cp_size, cp_rank))]
    out["token_entries"] = None if entries is None else entries.unsqueeze(0)
    out["entry_names"] = batch.entry_names
    return out


def gpt_sample(ids, lab, pos, params, label_pad: int, device: Any) -> dict[str, Any]:
    """Megatron's GPT batch of one THD row: labels padded where ignored (Megatron reads every label), the loss mask
    from them, on `device` with `params`' cu_seqlens. Shared by the per-rank and the dynamic-CP adapters."""
    out = {
        "tokens": ids.unsqueeze(0),
        "labels": torch.where(lab == IGNORE_INDEX, torch.full_like(lab, label_pad), lab).unsqueeze(0),
        "loss_mask": (lab != IGNORE_INDEX).to(torch.float32).unsqueeze(0),
        "attention_mask": None,
        "position_ids": pos.unsqueeze(0),
        "packed_seq_params": params,
    }
    if device is not None:
        for k in ("tokens", "labels", "loss_mask", "position_ids"):
            out[k] = out[k].to(device, non_blocking=True)
        for name in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
            setattr(params, name, getattr(params, name).to(device, non_blocking=True))
    return out


class MegatronDataIterator:
    """This rank's packloader micro-batches as Megatron batch dicts; an iterator, as Megatron's
    ``--dataloader-type external`` expects. ``num_microbatches``: Megatron's micro-batches per step (checked against
    every packloader step). ``state_dict``/``load_state_dict`` pass through to the loader (exact resume).
    ``log_metrics``: log each step's StepMetrics line (default: on global rank 0 only, so 2 ranks log it once)."""

    def __init__(self, loader: Iterable[PackedBatch], *, num_microbatches: int | None = None, cp_size: int = 1,
                 cp_rank: int = 0, cp_layout: str = "packloader", cp_shard_mode: str = "document",
                 cost_model: Any = None, label_pad: int = 0, device: Any = None, slices: bool = False,
                 pipeline_parallel_size: int | None = None, log_metrics: bool | None = None,
                 cp_mode: str | None = None) -> None:
        self.loader = loader
        self.log_metrics = _global_rank() == 0 if log_metrics is None else bool(log_metrics)
        self.num_microbatches = num_microbatches
        self.pipeline_parallel_size = _pp_size() if pipeline_parallel_size is None else int(pipeline_parallel_size)
        self.slices = slices
        self._kw = dict(cp_size=cp_size, cp_rank=cp_rank, cp_layout=cp_layout,
                        cp_shard_mode=shard_mode_of(cp_shard_mode, cp_mode, "MegatronDataIterator"),
                        cost_model=cost_model, label_pad=label_pad, device=device, slices=slices)
        self._it: Iterator[PackedBatch] | None = None

    def __iter__(self) -> "MegatronDataIterator":
        return self

    def __next__(self) -> dict[str, Any]:
        if self._it is None:
            self._it = iter(self.loader)
        batch = next(self._it)
        check_micro_batches(batch.step, batch.micro_batches_in_step, self.num_microbatches, "Megatron's schedule")
        if self.log_metrics and batch.index_in_step == 0 and batch.step_metrics is not None:
            # once per step, at its first micro-batch, on global rank 0 only: the record is the step's, every rank's same
            log.info("%s", format_step_metrics(batch.step_metrics))
        if any(s.attend_from < s.start for s in batch.segments):
            if self.pipeline_parallel_size > 1 and not self.slices:
                raise ValueError(_pp_slices_message(self.pipeline_parallel_size, batch))
            if not self.slices:
                s = next(s for s in batch.segments if s.attend_from < s.start)
                raise ValueError(
                    f"step {batch.step}, micro-batch {batch.index_in_step} holds a slice of document {s.doc} (tokens "
                    f"{s.start}..{s.end - 1} attend from {s.attend_from}), which Megatron's own schedules cannot run. "
                    "At PP 1 build the iterator with slices=True and train with sliced_forward_backward (core "
                    f"attention PackloaderCoreAttention); or {SLICES_PP_ALTERNATIVE}")
        out = megatron_batch(batch, **self._kw)
        # the configured pipeline schedule (PlanConfig.schedule) for sliced_pipeline_forward_backward
        out["schedule"] = getattr(getattr(self.loader, "config", None), "schedule", None)
        return out

    def state_dict(self) -> dict:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state)
        self._it = None


def get_batch(data_iterator, vp_stage: int | None = None):
    """Drop-in for pretrain_gpt's ``get_batch``: (tokens, labels, loss_mask, attention_mask, position_ids,
    packed_seq_params); all None on a pipeline stage without data (``data_iterator`` None)."""
    if data_iterator is None:
        return None, None, None, None, None, None
    b = next(data_iterator)
    return b["tokens"], b["labels"], b["loss_mask"], b["attention_mask"], b["position_ids"], b["packed_seq_params"]


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Per-token loss in Megatron's 3-tuple form: (loss sum, number of loss tokens, report). With
    ``calculate_per_token_loss=True`` Megatron sums both over micro-batches and DP/CP ranks and divides once, so the
    step's loss is the mean over every loss token of the global step."""
    losses = output_tensor.reshape(-1).float()
    mask = loss_mask.reshape(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().detach().to(torch.int)
    report = {"lm loss": torch.cat([loss.detach().view(1), num_tokens.view(1).to(loss.dtype)])}
    return loss, num_tokens, report


def forward_step(data_iterator, model):
    """Drop-in ``forward_step`` for a GPTModel: the THD batch with its PackedSeqParams, the per-token loss."""
    tokens, labels, loss_mask, attention_mask, position_ids, params = get_batch(data_iterator)
    output = model(tokens, position_ids, attention_mask, labels=labels, packed_seq_params=params)
    return output, partial(loss_func, loss_mask)


def _global_rank() -> int:
    """torch.distributed's rank where it is initialised, else 0."""
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _pp_size() -> int:
    """Pipeline-parallel size from megatron.core.parallel_state when it is initialised, else 1."""
    try:
        ps = require("megatron.core.parallel_state")
    except ImportError:
        return 1
    return ps.get_pipeline_model_parallel_world_size() if ps.model_parallel_is_initialized() else 1


def _pp_slices_message(pp: int, batch: PackedBatch | None) -> str:
    where = ""
    if batch is not None:
        s = next(s for s in batch.segments if s.attend_from < s.start)
        where = (f" (step {batch.step}, micro-batch {batch.index_in_step}: document {s.doc}, tokens "
                 f"{s.start}..{s.end - 1} attend from {s.attend_from})")
    return (f"pipeline_model_parallel_size={pp}: Megatron's pipeline schedules run every micro-batch on its own, "
            f"without the earlier slices' keys and values, so they cannot run sliced plans{where}; build the "
            "iterator with slices=True and train with sliced_pipeline_forward_backward, or "
            f"{SLICES_PP_ALTERNATIVE}{pipeline_alternative()}")


def _parallel_ranks() -> dict[str, int]:
    """dp/cp rank and size from megatron.core.parallel_state when it is initialised, else a single rank."""
    ps = require("megatron.core.parallel_state")
    if not ps.model_parallel_is_initialized():
        return {"dp_rank": 0, "dp_size": 1, "cp_rank": 0, "cp_size": 1}
    return {
        "dp_rank": ps.get_data_parallel_rank(),
        "dp_size": ps.get_data_parallel_world_size(),
        "cp_rank": ps.get_context_parallel_rank(),
        "cp_size": ps.get_context_parallel_world_size(),
    }


def make_datasets_provider(
    loader_factory: Callable[[int, str], Iterable[PackedBatch] | None],
    *,
    num_microbatches: int | None = None,
    **batch_kwargs: Any,
) -> Callable:
    """A ``train_valid_test_datasets_provider`` for Megatron's ``pretrain`` with ``--dataloader-type external``.

    ``loader_factory(dp_rank, split)`` builds this DP rank's loader for split "train", "valid" or "test" (or returns
    None for a split without data). The provider reads DP and CP ranks from ``megatron.core.parallel_state`` and
    returns one ``MegatronDataIterator`` per split; ``train_val_test_num_samples`` is ignored (packloader's steps
    are counted in tokens). ``provider.is_distributed = True``: Megatron calls it on every rank.
    """

    def provider(train_val_test_num_samples=None, vp_stage=None):
        r = _parallel_ranks()
        out = []
        for split in ("train", "valid", "test"):
            loader = loader_factory(r["dp_rank"], split)
            out.append(None if loader is None else MegatronDataIterator(
                loader, num_microbatches=num_microbatches, cp_size=r["cp_size"], cp_rank=r["cp_rank"],
                **batch_kwargs))
        return tuple(out)

    provider.is_distributed = True
    return provider


# megatron-core's TransformerConfig raises "Token dispatcher type: allgather does not support variable sequence
# length" for its default dispatcher, even in a model without MoE layers
ALLTOALL = (" and, in a TransformerConfig, moe_token_dispatcher_type='alltoall' (megatron-core refuses "
            "variable_seq_lengths with its default 'allgather' dispatcher, even without MoE)")


def check_megatron_config(config: Any, *, pipeline_parallel_size: int | None = None,
                          fixed_token_count: bool = False) -> None:
    """Refuse a Megatron ``TransformerConfig``/``ModelParallelConfig`` that would mis-handle packloader batches:
    per-token loss needs ``calculate_per_token_loss=True``; pipeline parallelism with micro-batches of different
    token counts needs ``variable_seq_lengths=True`` (unless every micro-batch is padded to one size), which
    megatron-core (0.16) accepts only with ``moe_token_dispatcher_type="alltoall"``, MoE or not."""
    if hasattr(config, "calculate_per_token_loss") and not config.calculate_per_token_loss:
        raise ValueError("set calculate_per_token_loss=True: packloader's micro-batches hold different numbers of "
                         "loss tokens, and averaging per micro-batch would weight tokens unequally")
    pp = pipeline_parallel_size if pipeline_parallel_size is not None else getattr(
        config, "pipeline_model_parallel_size", 1)
    variable = pp > 1 and not fixed_token_count
    if variable and not getattr(config, "variable_seq_lengths", False):
        raise ValueError(f"pipeline_model_parallel_size={pp} with packed micro-batches of varying token counts needs "
                         f"variable_seq_lengths=True{ALLTOALL} (or PackedLoader(pad_to_tokens=...) for one fixed "
                         "size)")
    dispatcher = getattr(config, "moe_token_dispatcher_type", None)
    if (variable or getattr(config, "variable_seq_lengths", False)) and dispatcher == "allgather":
        raise ValueError(f"variable_seq_lengths=True with moe_token_dispatcher_type={dispatcher!r}: megatron-core's "
                         f"TransformerConfig refuses that pair{ALLTOALL}")

