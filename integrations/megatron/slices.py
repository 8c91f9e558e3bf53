"""Sliced plans at PP 1: Megatron's core attention over a step's slices (`PackloaderCoreAttention`) and the
forward-backward that runs them through `SliceExecutor` (`sliced_forward_backward`)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from .._lazy import require
from .rope import ROPE_ALTERNATIVE, SliceRope, slice_rope_of


class PackloaderCoreAttention(torch.nn.Module):
    """A ``core_attention`` for Megatron's layer spec (``ModuleSpec(module=SelfAttention, submodules=
    SelfAttentionSubmodules(core_attention=PackloaderCoreAttention, ...))``) on the THD path: packloader's
    ``varlen_attention`` over ``packed_seq_params``' segments, any device (CPU reference backend included), and
    inside ``sliced_forward_backward`` the slice context's attention (the earlier slices' keys and values); a
    packloader CP shard (``packed_seq_params.packloader_shard``, cp_layout "packloader" or per-document CP) runs
    ``cp_attention`` over ``packed_seq_params.cp_group``, else Megatron's CP group.
    Causal, no dropout; no parameters, so it swaps with TransformerEngine's or the local core attention. With RoPE,
    the sliced schedules give it the model's `SliceRope`, which turns a slice's queries and keys to their positions
    in the document before the slice context stores or reads any keys."""

    def __init__(self, config: Any, layer_number: int, attn_mask_type: Any = None, attention_type: str = "self",
                 softmax_scale: float | None = None, **kwargs: Any) -> None:
        super().__init__()
        self.config = config
        self.layer_number = layer_number
        kv = getattr(config, "kv_channels", None) or config.hidden_size // config.num_attention_heads
        self.softmax_scale = softmax_scale if softmax_scale is not None else kv ** -0.5
        self.slice_rope = None  # set by the sliced schedules for a RoPE model (see .rope)

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
            if self.slice_rope is not None:  # Megatron rotated each segment from position 0; a slice starts later
                query, key = self.slice_rope.rotate(query, key, ctx, packed_seq_params)
            out = ctx.attention(query, key, value, self.layer_number, softmax_scale=self.softmax_scale)
        elif getattr(packed_seq_params, "packloader_shard", None) is not None \
                and packed_seq_params.packloader_shard.cp_size > 1:
            out = _cp_attention(query, key, value, packed_seq_params, self.softmax_scale)
        else:
            p = packed_seq_params
            out = varlen_attention(query, key, value, p.cu_seqlens_q.to(torch.int32), p.cu_seqlens_kv.to(torch.int32),
                                   int(p.max_seqlen_q), int(p.max_seqlen_kv), causal=True,
                                   softmax_scale=self.softmax_scale)
        return out.reshape(out.shape[0], -1)


def _cp_attention(query, key, value, params, softmax_scale):
    """A packloader CP shard's attention over its group: `params.cp_group` (per-document CP, Megatron's hybrid
    field), else Megatron's CP group."""
    from packloader.runtime.cp_attention import cp_attention

    group = getattr(params, "cp_group", None)
    if group is None:
        group = require("megatron.core.parallel_state").get_context_parallel_group()
    return cp_attention(query, key, value, params.packloader_shard, group, softmax_scale=softmax_scale)


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
    The attention of ``model`` must be ``PackloaderCoreAttention``; a RoPE model's slices are turned to their
    document positions there, and rotary settings that cannot be are refused first (``rope.slice_rope_of``). Returns the forward data store (the loss
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
    install_slice_rope(model, config)
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


def install_slice_rope(model: torch.nn.Module, config: Any) -> SliceRope | None:
    """Hand the model's RoPE correction (or None) to each of its ``PackloaderCoreAttention`` layers; with RoPE and
    none of them, refuse (the correction happens there)."""
    rope = slice_rope_of(model, config)
    cores = [m for m in model.modules() if isinstance(m, PackloaderCoreAttention)]
    if rope is not None and not cores:
        raise ValueError("position_embedding_type='rope' with sliced plans needs the layer spec's core_attention to "
                         "be PackloaderCoreAttention (it rotates each slice's queries and keys to their document "
                         f"positions); {ROPE_ALTERNATIVE}")
    for m in cores:
        m.slice_rope = rope
    return rope
