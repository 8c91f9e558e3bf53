"""Megatron-core adapter: packloader micro-batches as the batches of Megatron's GPT training step (THD format).

What a Megatron pretraining script needs, in its own terms::

    from packloader_integrations.megatron import make_datasets_provider, forward_step

    provider = make_datasets_provider(lambda dp_rank, split: PackedLoader(..., dp_rank=dp_rank, epochs=None)
                                      if split == "train" else None)
    pretrain(provider, model_provider, ModelType.encoder_or_decoder, forward_step,
             args_defaults={"dataloader_type": "external"})   # or --dataloader-type external

and in the model config ``calculate_per_token_loss=True`` (the loss is a sum over tokens, normalised by the
number of loss tokens of the whole global step, micro-batches, DP and CP ranks together) and, with pipeline
parallelism, ``variable_seq_lengths=True`` (see ``check_megatron_config``).

Each batch is a dict (``megatron_batch``): ``tokens``, ``labels``, ``position_ids`` (int64 ``[1, n]``),
``loss_mask`` (float32 ``[1, n]``), ``attention_mask`` None (THD attention masks by ``cu_seqlens``) and a real
``megatron.core.packed_seq_params.PackedSeqParams`` with ``qkv_format="thd"``. Labels where ``loss_mask`` is 0
hold ``label_pad`` (default 0), not -100: Megatron's cross-entropy indexes the vocabulary with every label and
relies on ``loss_mask`` to drop them.

Context parallelism, two layouts (``cp_layout``):

``"packloader"`` (default) this CP rank's shard from ``packloader.collate.cp_shard`` (mode ``cp_mode``, default
                 "document": every document in 2 x CP chunks, remainders dealt round-robin, no padding, so documents
                 need not be multiples of 2 x CP). ``PackedSeqParams`` then describes this rank's *local* query runs
                 (``cu_seqlens_q``) and the keys each run sees in the all-gathered buffer (``cu_seqlens_kv``); the
                 ``CPRankShard`` is in ``batch["cp_shard"]`` and on ``packed_seq_params.packloader_shard``. The
                 attention that consumes it is ``packloader.runtime.cp_attention`` (all-gather of K/V, then varlen
                 attention); TransformerEngine's CP attention cannot, it assumes the "te" layout.
``"te"``         what ``megatron.core.utils.get_thd_batch_on_this_cp_rank`` produces with TransformerEngine, computed
                 here without TE: each segment padded to a multiple of 2 x CP (collate with ``pad_to_multiple=2*CP``,
                 checked), this rank taking chunks ``r`` and ``2CP-1-r`` of every padded segment; ``PackedSeqParams``
                 holds the global ``cu_seqlens`` and ``cu_seqlens_padded``.

Variable micro-batch sizes: packloader's micro-batches hold different token counts. Megatron-core handles that
with ``ModelParallelConfig.variable_seq_lengths=True``: the pipeline's p2p communication then exchanges tensor
shapes before every send (a small extra message). Without pipeline parallelism nothing is needed. With the
padded variant (``pad_to_tokens``: every micro-batch the same size) it is not needed either.

Empty micro-batches: every DP rank runs Megatron's one ``num_microbatches`` per step, so a rank with fewer pieces
than the fullest one gets empty slots from the planner. ``megatron_batch`` turns one into a row of 2 x CP padding
tokens with ``loss_mask`` 0 (``placeholder_batch``): every pipeline stage runs it like any micro-batch, so the
schedule's sends and receives and the DP gradient reduction stay in step, and it adds nothing to the loss or to
the per-token normaliser (``loss_func`` counts 0 tokens for it).

Tensor parallelism: every TP rank builds the same loader (same dp_rank) and gets the same batches, since plans are
deterministic; no broadcast from TP rank 0 (``get_batch_on_this_tp_rank``) is needed.

Sliced plans (SlimPack: ``Segment.attend_from < start``, a later slice attends to the keys and values of its
document's earlier slices in earlier micro-batches of the same step):

* PP 1: ``MegatronDataIterator(..., slices=True)`` (or ``make_datasets_provider(..., slices=True)``) passes sliced
  batches on, with their segments in ``batch["segments"]``; ``sliced_forward_backward`` replaces
  ``forward_backward_no_pipelining`` (same keyword arguments, same return value) and runs each step through
  ``packloader.runtime.slices.SliceExecutor``; the layer spec's ``core_attention`` must be
  ``PackloaderCoreAttention``, which runs the executor's slice context (``varlen_attention`` with the earlier
  slices' keys). Per-token loss, ``finalize_model_grads_func`` and DDP's gradient sync as Megatron's own schedule.
  Position embeddings must read ``position_ids`` (a slice continues its piece's positions): Megatron's THD RoPE
  restarts every packed segment at position 0, right for whole documents and pieces, wrong for a slice.
* PP > 1: Megatron's pipeline schedules run each micro-batch once per stage with no KV cache between
  micro-batches, so they cannot run slices; the iterator refuses them at construction (``slices=True``) or at the
  first sliced batch, naming ``pipeline_model_parallel_size`` and ``PlanConfig(allow_slicing=False)``.
* CP > 1 with slices is refused too (``packloader.collate.cp_shard`` does not shard slices).
"""

from __future__ import annotations

import contextlib
from functools import partial
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import torch

from packloader.collate.batch import IGNORE_INDEX, PackedBatch

from ._common import check_micro_batches, flat, pipeline_alternative, placeholder_batch, refuse_slices
from ._lazy import require

SLICES_PP_ALTERNATIVE = "plan with PlanConfig(allow_slicing=False)"

CP_LAYOUTS = ("packloader", "te")

__all__ = [
    "CP_LAYOUTS",
    "megatron_batch",
    "MegatronDataIterator",
    "get_batch",
    "loss_func",
    "forward_step",
    "make_datasets_provider",
    "check_megatron_config",
    "te_partition_index",
    "PackloaderCoreAttention",
    "sliced_forward_backward",
]


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


def megatron_batch(
    batch: PackedBatch,
    *,
    cp_size: int = 1,
    cp_rank: int = 0,
    cp_layout: str = "packloader",
    cp_mode: str = "document",
    cost_model: Any = None,
    label_pad: int = 0,
    device: Any = None,
    slices: bool = False,
) -> dict[str, Any]:
    """One PackedBatch -> the dict Megatron's GPT ``get_batch`` returns, for this CP rank (see the module). With
    ``slices=True`` a sliced batch (CP 1 only) is passed on for ``sliced_forward_backward``: its
    ``PackedSeqParams`` count this batch's own rows (``cu_seqlens_kv == cu_seqlens_q``; the earlier slices' keys come
    from the executor's cache) and ``batch["segments"]`` holds the segments."""
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
    if batch.num_tokens == 0:  # an empty slot: 2 x CP padding tokens (each CP rank two), no loss target
        batch = placeholder_batch(batch, 2 * cp_size)
    PackedSeqParams = _packed_seq_params_cls()
    ids, lab, pos = flat(batch.input_ids), flat(batch.labels), flat(batch.position_ids)
    shard = None
    if cp_size == 1 or cp_layout == "te":
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
    else:
        from packloader.collate.cp_shard import plan_cp_shards
        from packloader.runtime.cp_cost import cp_cost

        if batch.cu_seqlens_padded is not None:
            raise ValueError("cp_layout='packloader' shards the unpadded micro-batch: build the loader without "
                             "pad_to_multiple / pad_to_tokens")
        lengths = [s.end - s.start for s in batch.segments]
        offsets = [s.start - s.attend_from for s in batch.segments]  # the collate's positions (0: no slices)
        shard = plan_cp_shards(lengths, cp_size, cp_mode, position_offsets=offsets, cost=cp_cost(cost_model))[cp_rank]
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
        params.packloader_shard = shard  # travels with the params down to the attention module
    loss_mask = (lab != IGNORE_INDEX).to(torch.float32)
    labels = torch.where(lab == IGNORE_INDEX, torch.full_like(lab, label_pad), lab)
    if device is not None:
        for name in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
            setattr(params, name, getattr(params, name).to(device, non_blocking=True))
    out = {
        "tokens": ids.unsqueeze(0),
        "labels": labels.unsqueeze(0),
        "loss_mask": loss_mask.unsqueeze(0),
        "attention_mask": None,
        "position_ids": pos.unsqueeze(0),
        "packed_seq_params": params,
    }
    if device is not None:
        for k in ("tokens", "labels", "loss_mask", "position_ids"):
            out[k] = out[k].to(device, non_blocking=True)
    out["cp_shard"] = shard
    out["num_loss_tokens_in_step"] = int(batch.loss_tokens_in_step)
    out["segments"] = list(batch.segments)
    return out


class MegatronDataIterator:
    """This rank's packloader micro-batches as Megatron batch dicts; an iterator, as Megatron's
    ``--dataloader-type external`` expects. ``num_microbatches``: Megatron's micro-batches per step (checked against
    every packloader step). ``state_dict``/``load_state_dict`` pass through to the loader (exact resume)."""

    def __init__(self, loader: Iterable[PackedBatch], *, num_microbatches: int | None = None, cp_size: int = 1,
                 cp_rank: int = 0, cp_layout: str = "packloader", cp_mode: str = "document", cost_model: Any = None,
                 label_pad: int = 0, device: Any = None, slices: bool = False,
                 pipeline_parallel_size: int | None = None) -> None:
        self.loader = loader
        self.num_microbatches = num_microbatches
        self.pipeline_parallel_size = _pp_size() if pipeline_parallel_size is None else int(pipeline_parallel_size)
        if slices and self.pipeline_parallel_size > 1:
            raise ValueError(_pp_slices_message(self.pipeline_parallel_size, None))
        self.slices = slices
        self._kw = dict(cp_size=cp_size, cp_rank=cp_rank, cp_layout=cp_layout, cp_mode=cp_mode,
                        cost_model=cost_model, label_pad=label_pad, device=device, slices=slices)
        self._it: Iterator[PackedBatch] | None = None

    def __iter__(self) -> "MegatronDataIterator":
        return self

    def __next__(self) -> dict[str, Any]:
        if self._it is None:
            self._it = iter(self.loader)
        batch = next(self._it)
        check_micro_batches(batch.step, batch.micro_batches_in_step, self.num_microbatches, "Megatron's schedule")
        if any(s.attend_from < s.start for s in batch.segments):
            if self.pipeline_parallel_size > 1:
                raise ValueError(_pp_slices_message(self.pipeline_parallel_size, batch))
            if not self.slices:
                s = next(s for s in batch.segments if s.attend_from < s.start)
                raise ValueError(
                    f"step {batch.step}, micro-batch {batch.index_in_step} holds a slice of document {s.doc} (tokens "
                    f"{s.start}..{s.end - 1} attend from {s.attend_from}), which Megatron's own schedules cannot run. "
                    "At PP 1 build the iterator with slices=True and train with sliced_forward_backward (core "
                    f"attention PackloaderCoreAttention); or {SLICES_PP_ALTERNATIVE}")
        return megatron_batch(batch, **self._kw)

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
            f"without the earlier slices' keys and values, so they cannot run sliced plans{where}; "
            f"{SLICES_PP_ALTERNATIVE} (slices run through sliced_forward_backward at pipeline_model_parallel_size=1)"
            f"{pipeline_alternative()}")


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


def check_megatron_config(config: Any, *, pipeline_parallel_size: int | None = None,
                          fixed_token_count: bool = False) -> None:
    """Refuse a Megatron ``TransformerConfig``/``ModelParallelConfig`` that would mis-handle packloader batches:
    per-token loss needs ``calculate_per_token_loss=True``; pipeline parallelism with micro-batches of different
    token counts needs ``variable_seq_lengths=True`` (unless every micro-batch is padded to one size)."""
    if hasattr(config, "calculate_per_token_loss") and not config.calculate_per_token_loss:
        raise ValueError("set calculate_per_token_loss=True: packloader's micro-batches hold different numbers of "
                         "loss tokens, and averaging per micro-batch would weight tokens unequally")
    pp = pipeline_parallel_size if pipeline_parallel_size is not None else getattr(
        config, "pipeline_model_parallel_size", 1)
    if pp > 1 and not fixed_token_count and not getattr(config, "variable_seq_lengths", False):
        raise ValueError(f"pipeline_model_parallel_size={pp} with packed micro-batches of varying token counts needs "
                         "variable_seq_lengths=True (or PackedLoader(pad_to_tokens=...) for one fixed size)")


class PackloaderCoreAttention(torch.nn.Module):
    """A ``core_attention`` for Megatron's layer spec (``ModuleSpec(module=SelfAttention, submodules=
    SelfAttentionSubmodules(core_attention=PackloaderCoreAttention, ...))``) on the THD path: packloader's
    ``varlen_attention`` over ``packed_seq_params``' segments, any device (CPU reference backend included), and
    inside ``sliced_forward_backward`` the slice context's attention (the earlier slices' keys and values).
    Causal, no dropout; no parameters, so it swaps with TransformerEngine's or the local core attention."""

    def __init__(self, config: Any, layer_number: int, attn_mask_type: Any = None, attention_type: str = "self",
                 softmax_scale: float | None = None, **kwargs: Any) -> None:
        super().__init__()
        self.config = config
        self.layer_number = layer_number
        kv = getattr(config, "kv_channels", None) or config.hidden_size // config.num_attention_heads
        self.softmax_scale = softmax_scale if softmax_scale is not None else kv ** -0.5

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **kwargs):
        from packloader.runtime.attention import varlen_attention
        from packloader.runtime.slices import current_slice_context

        if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
            raise ValueError("PackloaderCoreAttention runs packed THD batches: pass packed_seq_params (qkv_format='thd')")
        if query.dim() == 4:  # [t, 1, h, d]
            query, key, value = query.squeeze(1), key.squeeze(1), value.squeeze(1)
        ctx = current_slice_context()
        if ctx is not None:
            out = ctx.attention(query, key, value, self.layer_number, softmax_scale=self.softmax_scale)
        else:
            p = packed_seq_params
            out = varlen_attention(query, key, value, p.cu_seqlens_q.to(torch.int32), p.cu_seqlens_kv.to(torch.int32),
                                   int(p.max_seqlen_q), int(p.max_seqlen_kv), causal=True,
                                   softmax_scale=self.softmax_scale)
        return out.reshape(out.shape[0], -1)


def sliced_forward_backward(*, forward_step_func, data_iterator, model, num_microbatches: int,
                            seq_length: int | None = None, micro_batch_size: int | None = None,
                            decoder_seq_length: int | None = None, forward_only: bool = False,
                            collect_non_loss_data: bool = False, first_val_step: bool | None = None, **unused: Any):
    """Drop-in for ``megatron.core.pipeline_parallel.schedules.forward_backward_no_pipelining`` (PP 1) that runs
    one step's micro-batches, slices included, through ``SliceExecutor``.

    Reads the step's ``num_microbatches`` batches from ``data_iterator`` first (a kept micro-batch runs its forward
    twice: once without a graph, once recomputed for its backward), then calls ``forward_step_func`` on a one-batch
    iterator each time; the loss goes through Megatron's own ``forward_step_calc_loss`` (per-token loss with
    ``calculate_per_token_loss=True``), gradients accumulate under the model's ``no_sync`` and
    ``config.finalize_model_grads_func`` runs once with the step's token count, as in Megatron's schedule.
    The attention of ``model`` must be ``PackloaderCoreAttention``. Returns the forward data store (the loss
    reports, one per micro-batch, in order)."""
    from packloader.runtime.slices import SliceExecutor

    sched = require("megatron.core.pipeline_parallel.schedules")
    utils = require("megatron.core.utils")
    if isinstance(model, list):
        if len(model) != 1:
            raise ValueError("sliced_forward_backward runs without virtual pipeline stages: pass one model chunk")
        model = model[0]
    if isinstance(data_iterator, list):
        data_iterator = data_iterator[0]
    config = utils.get_model_config(model)
    batches = [next(data_iterator) for _ in range(num_microbatches)]
    for i, b in enumerate(batches):
        if "segments" not in b:
            raise ValueError(f"micro-batch {i} has no 'segments': build the batches with megatron_batch / "
                             "MegatronDataIterator(slices=True)")
    stores: list[list] = [[] for _ in batches]
    num_tokens = [torch.zeros((), dtype=torch.int) for _ in batches]
    cp_size = 1

    def step_fn(mb, ctx):
        store: list = []
        out = forward_step_func(iter([mb.batch]), model)
        output_tensor, loss_func = out if isinstance(out, tuple) else (out, None)
        loss, n = sched.forward_step_calc_loss(model, output_tensor, loss_func, config, None, collect_non_loss_data,
                                               num_microbatches, store, cp_group_size=cp_size, is_last_stage=True)
        stores[mb.i], num_tokens[mb.i] = store, n
        return loss

    class _MB:
        def __init__(self, i, batch):
            self.i, self.batch, self.segments = i, batch, batch["segments"]

    mbs = [_MB(i, b) for i, b in enumerate(batches)]
    if forward_only:
        from packloader.runtime.slices import SliceContext, SliceKVCache, analyse_chain

        kept = analyse_chain(mbs)
        cache = SliceKVCache()
        with torch.no_grad():
            for j, mb in enumerate(mbs):
                with SliceContext(mb.segments, cache, store=kept[j]).active() as ctx:
                    step_fn(mb, ctx)
    else:
        no_sync = config.no_sync_func if config.no_sync_func is not None else contextlib.nullcontext
        with no_sync():
            SliceExecutor().run(mbs, step_fn)
    total = sum(int(n) for n in num_tokens)
    if config.finalize_model_grads_func is not None and not forward_only:
        device = next(model.parameters()).device
        config.finalize_model_grads_func([model], torch.tensor(total, dtype=torch.int, device=device)
                                         if config.calculate_per_token_loss else None)
    return [r for s in stores for r in s]
