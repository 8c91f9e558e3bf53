"""Per-document context parallelism for Megatron-core: one pool GPU's part of a dynamic-CP micro-batch
(``PackedBatch.cp``, ``PackedLoader(..., cp_rank=...)``) as the sub-samples megatron-core 0.16's hybrid context
parallelism runs.

Megatron's hybrid path (``hybrid_context_parallel_forward_backward``) runs every sub-sample as its own forward and
backward, each with ``PackedSeqParams.local_cp_size`` (the CP size of that sub-sample) and ``cp_group`` (the process
group of its GPUs: one of the aligned power-of-two blocks of the DP x CP ranks that ``parallel_state`` creates with
``hybrid_context_parallel=True``, the whole DP x CP group at full size; None at size 1). TransformerEngine's
attention switches its CP group to ``cp_group`` per call, or turns CP off when ``local_cp_size`` is 1 without a group;
``GPTModel`` hands ``cp_group`` to its rotary embedding.

``megatron_dynamic_cp_batches`` gives one such sub-sample per CP group of this GPU's micro-batch, in the groups' run
order (larger groups first, then by first GPU: the same on every GPU, so the GPUs of a group run it together). Each
holds the group's documents in packloader's per-document layout (THD, no padding: each document in 2 x size chunks,
this GPU's shard ``g - first``); ``cu_seqlens_q`` counts its query runs, ``cu_seqlens_kv`` the keys each run sees in
the group's gathered keys, and the shard rides on the params as ``packloader_shard`` for ``PackloaderCoreAttention``,
which all-gathers over ``cp_group`` (``packloader.runtime.cp_attention``). TransformerEngine's own CP attention
expects its padded two-chunk layout instead. ``max_seqlen_q``/``max_seqlen_kv`` bound the documents' positions, as
Megatron's RoPE reads them. An empty slot is one padding token at ``local_cp_size`` 1, with no loss. A batch with
slices (dynamic-cp's slice chains) is refused as ``SlicesNotSupported``: the hybrid path keeps no keys between
sub-samples.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from packloader.collate.batch import IGNORE_INDEX, PackedBatch

from .._common import flat
from .._lazy import require
from .batch import gpt_sample

__all__ = ["megatron_dynamic_cp_batches"]


def _params(cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int, max_k: int, size: int, group: Any):
    PackedSeqParams = require("megatron.core.packed_seq_params").PackedSeqParams
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_q, cu_seqlens_kv=cu_k, cu_seqlens_q_padded=cu_q,
                           cu_seqlens_kv_padded=cu_k, max_seqlen_q=int(max_q), max_seqlen_kv=int(max_k),
                           local_cp_size=int(size), cp_group=group)


def _refuse_slices(batch: PackedBatch) -> None:
    """Megatron's hybrid path runs each sub-sample as its own forward and backward: nothing keeps a chain's earlier
    slices' keys (and their gradients) for its later slices, as packloader's DynamicCPExecutor does."""
    from packloader.runtime.slice_check import SlicesNotSupported, find_slices

    found = find_slices([batch], step=batch.step, rank=batch.cp.gpu)
    if found:
        raise SlicesNotSupported(
            f"megatron_dynamic_cp_batches cannot run sliced documents (megatron-core's hybrid CP keeps no keys between "
            f"sub-samples), but the batch has some: {found[0].describe()}. Plan with planner_options={{'dynamic-cp': "
            "{'chains': False}} and allow_slicing=False, or run the step through "
            "packloader.runtime.cp_chains.DynamicCPExecutor")


def megatron_dynamic_cp_batches(batch: PackedBatch, *, groups: Any = None, rank_map: Sequence[int] | None = None,
                                label_pad: int = 0, device: Any = None) -> list[dict[str, Any]]:
    """This pool GPU's sub-samples of one per-document CP micro-batch, one per CP group, in run order (see the
    module). `groups`: the pool's process groups (`packloader.runtime.groups.prepare_cp_pool_groups`, created on every
    rank up front; default the shared cache); `rank_map`: pool GPU -> global rank, as given there. Each dict is
    Megatron's GPT batch (`tokens`, `labels`, `loss_mask`, `position_ids`, `attention_mask` None,
    `packed_seq_params`) plus `cp_shard` (the group's `CPRankShard`), `num_loss_tokens_in_step`, `step_metrics`."""
    from packloader.runtime.groups import cp_pool_group

    shard = batch.cp
    if shard is None:
        raise ValueError(f"step {batch.step}, micro-batch {batch.index_in_step} is not a per-document CP batch "
                         "(PackedBatch.cp is None): use megatron_batch for fixed CP")
    _refuse_slices(batch)
    ids, lab, pos = flat(batch.input_ids), flat(batch.labels), flat(batch.position_ids)
    subs = []
    for g in shard.groups:
        group = cp_pool_group(g.size, g.first, gpu=shard.gpu, rank_map=rank_map, groups=groups)
        _, cu_k, max_k = g.shard.key_layout(causal=True)
        cu_q = torch.from_numpy(g.shard.cu_seqlens_q.astype("int32"))
        params = _params(cu_q, torch.from_numpy(cu_k.astype("int32")), g.shard.max_seqlen_q, max_k, g.size, group)
        params.packloader_shard = g.shard
        sub = gpt_sample(ids[g.lo:g.hi], lab[g.lo:g.hi], pos[g.lo:g.hi], params, label_pad, device)
        sub["cp_shard"] = g.shard
        subs.append(sub)
    if not subs:  # an empty slot: one padding token on this GPU alone, no loss target
        cu = torch.tensor([0, 1], dtype=torch.int32)
        pad = torch.zeros(1, dtype=torch.int64)
        subs.append(gpt_sample(pad, torch.full_like(pad, IGNORE_INDEX), pad, _params(cu, cu, 1, 1, 1, None),
                               label_pad, device))
        subs[0]["cp_shard"] = None
    for sub in subs:
        sub["num_loss_tokens_in_step"] = int(batch.loss_tokens_in_step)
        sub["step_metrics"] = batch.step_metrics
    return subs
