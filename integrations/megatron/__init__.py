"""Megatron-core adapter: packloader micro-batches as the batches of Megatron's GPT training step (THD format).

What a Megatron-LM pretraining script needs, in its own terms (``pretrain`` is Megatron-LM's; megatron-core alone
has no training loop: ``examples/train_megatron.py`` is one, with DDP and ``finalize_model_grads``)::

    from packloader_integrations.megatron import make_datasets_provider, forward_step

    provider = make_datasets_provider(lambda dp_rank, split: PackedLoader(..., dp_rank=dp_rank, epochs=None)
                                      if split == "train" else None)
    pretrain(provider, model_provider, ModelType.encoder_or_decoder, forward_step,
             args_defaults={"dataloader_type": "external"})   # or --dataloader-type external

and in the model config ``calculate_per_token_loss=True`` (the loss is a sum over tokens, normalised by the
number of loss tokens of the whole global step, micro-batches, DP and CP ranks together) and, with pipeline
parallelism, ``variable_seq_lengths=True`` with ``moe_token_dispatcher_type="alltoall"`` (megatron-core refuses the
default "allgather" with it, MoE or not; see ``check_megatron_config``).

Each batch is a dict (``megatron_batch``): ``tokens``, ``labels``, ``position_ids`` (int64 ``[1, n]``),
``loss_mask`` (float32 ``[1, n]``), ``attention_mask`` None (THD attention masks by ``cu_seqlens``) and a real
``megatron.core.packed_seq_params.PackedSeqParams`` with ``qkv_format="thd"``. Labels where ``loss_mask`` is 0
hold ``label_pad`` (default 0), not -100: Megatron's cross-entropy indexes the vocabulary with every label and
relies on ``loss_mask`` to drop them.

Context parallelism, two layouts (``cp_layout``):

``"packloader"`` (default) this CP rank's shard from ``packloader.collate.cp_sequence_shards`` (mode ``cp_shard_mode``, default
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
  Positions: a slice continues its piece's positions. ``position_ids`` carry them (learned absolute embeddings
  read them); Megatron's THD RoPE instead restarts every packed segment at position 0, right for whole documents
  and pieces, wrong for a slice, so with ``position_embedding_type="rope"`` both sliced schedules hand each
  ``PackloaderCoreAttention`` the model's ``SliceRope`` (``rope.py``), which rotates a slice's queries and keys
  further by the angle between Megatron's own frequency rows at the document position ``p + start - attend_from``
  and at ``p`` (from the model's ``rotary_pos_emb``: its inv_freq, ``rope_scaling``, interpolation, interleaving,
  ``rotary_percent``). Rotations of one frequency compose, so every row lands on the unsliced document's angle,
  and the keys kept for later slices are stored already turned. Refused as ``SlicesNotSupported`` naming the
  setting, before any batch is read: ``position_embedding_type`` "yarn" (its mscale scales cosine and sine, so
  rotations do not compose) and "mrope", ``multi_latent_attention``, ``no_rope_freq``, a rotary module other than
  Megatron's ``RotaryEmbedding``; RoPE with a core attention other than ``PackloaderCoreAttention``.
* PP > 1: Megatron's pipeline schedules run each micro-batch once per stage with no KV cache between
  micro-batches, so they cannot run slices. ``sliced_pipeline_forward_backward`` replaces
  ``forward_backward_pipelining_without_interleaving`` (same keyword arguments, same return value): this rank's
  model chunk (a GPTModel built with its stage's ``pre_process``/``post_process``) becomes a
  ``packloader.runtime.pipeline.SlicedPipelineStage`` on Megatron's pipeline group, and the step's micro-batches
  run through ``PlanPipelineSchedule`` in the order the planner's simulator scored (the plan's
  ``backward_order``, from ``batch["step_plan"]``) and the plan's schedule (1F1B, or ZB-H1's split input /
  weight backwards under ``PlanConfig.schedule`` "zb-h1" or "auto"; ``actions=`` runs the written lists). With
  virtual pipeline stages (``ParallelConfig(vpp=2)``, ``virtual_pipeline_model_parallel_size=2``) it replaces
  ``forward_backward_pipelining_with_interleaving`` too: the rank's list of model chunks runs interleaved 1F1B
  and interleaved zero bubble ("interleaved", "zb-h1": chunks as megatron-core builds them, chunk c is stage
  c*pp + rank) or ZB-V ("zb-v": chunks built by ``v_shape_model_chunks``, stages rank and 2*pp-1-rank), W
  actions included; chunks of the other placement are refused by layer number. Each stage keeps its own layers' keys and values of a
  document's earlier slices until the document's last backward. Every pipeline rank reads the step's batches
  from its own iterator (same loader, same DP rank: plans are deterministic), since every stage needs the
  segments. Loss, ``no_sync_func`` and ``finalize_model_grads_func`` as in Megatron's schedule. Tensor
  parallelism works as in Megatron's schedule (each TP rank of a stage runs the same plan on its shard; tested at
  TP 2 x PP 2 against the unsplit model). Refused early,
  naming the setting: a chunk list that is not ``virtual_pipeline_model_parallel_size`` long,
  ``sequence_parallel`` (activations between stages split over TP ranks), CP > 1,
  ``calculate_per_token_loss=False``, DP-Merge micro-batches (``MicroBatch.dp_group``). An iterator without
  ``slices=True`` refuses the first sliced batch at PP > 1, naming ``pipeline_model_parallel_size``.
* CP > 1 with slices is refused too (``packloader.collate.cp_sequence_shards`` does not shard slices).

Per-document context parallelism (``StepPlan.cp_mode`` "dynamic", ``PackedLoader(..., cp_rank=...)``):
``megatron_dynamic_cp_batches`` turns one pool GPU's batch into the sub-samples megatron-core's hybrid context
parallelism runs, one per CP group, with ``PackedSeqParams.local_cp_size`` and ``cp_group`` (``hybrid_cp_batches.py``).

Step metrics: ``MegatronDataIterator`` logs each step's ``packloader.StepMetrics`` once, at its first micro-batch
(logger ``packloader.megatron``, level INFO: predicted step time, imbalance, DP spread, bubbles, tokens, loss
tokens, padding, queue and delay), and every batch dict carries the record as ``batch["step_metrics"]`` for the
training script's own logger (e.g. next to Megatron's measured iteration time).
"""


from .batch import (
    CP_LAYOUTS,
    MegatronDataIterator,
    check_megatron_config,
    forward_step,
    get_batch,
    loss_func,
    make_datasets_provider,
    megatron_batch,
    te_partition_index,
)
from .entry_loss import forward_step_by_entry, loss_func_by_entry
from .hybrid_cp_batches import megatron_dynamic_cp_batches
from .pipeline import check_sliced_pipeline_config, pipeline_schedule_of, sliced_pipeline_forward_backward
from .pipeline_chunks import check_chunk_placement, v_shape_model_chunks
from .slices import PackloaderCoreAttention, sliced_forward_backward

__all__ = [
    "CP_LAYOUTS",
    "megatron_batch",
    "MegatronDataIterator",
    "get_batch",
    "loss_func",
    "forward_step",
    "forward_step_by_entry",
    "loss_func_by_entry",
    "make_datasets_provider",
    "check_megatron_config",
    "te_partition_index",
    "megatron_dynamic_cp_batches",
    "PackloaderCoreAttention",
    "sliced_forward_backward",
    "sliced_pipeline_forward_backward",
    "check_sliced_pipeline_config",
    "pipeline_schedule_of",
    "v_shape_model_chunks",
    "check_chunk_placement",
]

