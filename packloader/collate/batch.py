"""The tensors a trainer receives for one micro-batch on one rank: the batch contract every trainer adapter reads."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from packloader.contracts import LoaderStats, Segment, StepMetrics, StepPlan

IGNORE_INDEX = -100


class SlicesNotSupported(ValueError):
    """A plan (or a micro-batch) holds slices and the consumer that was handed it cannot run them."""


@dataclass
class PackedBatch:
    """One micro-batch, flat `[T]` convention (use `to_hf()` for `[1, T]`).

    Labels: `labels[t]` is the document's next token after token t, or -100 at each document's last token, so no
    loss crosses a document boundary; a slice's or piece's last token still predicts the first token of the next
    slice or piece. Positions: `t - attend_from`, restarting at 0 at every document and every independent piece
    (so they stay below the context), continuing within a piece across its slices.
    `cu_seqlens` counts query tokens per segment; for a slice (attend_from < start) `cu_seqlens_k` counts its
    keys including the earlier slices' prefix, which the runtime's KV cache supplies. Without slices both equal.
    """

    input_ids: torch.Tensor  # int64 [T]
    labels: torch.Tensor  # int64 [T]
    position_ids: torch.Tensor  # int64 [T]; restarts at 0 per document and piece, continues across slices
    cu_seqlens: torch.Tensor  # int32 [S+1], starts at 0
    cu_seqlens_k: torch.Tensor  # int32 [S+1]
    max_seqlen: int  # Python int: never a tensor (no device sync)
    max_seqlen_k: int
    doc_ids: torch.Tensor  # int64 [S]: the loader's document id of each segment
    segments: list[Segment]
    num_loss_tokens: int  # labels != -100 in this micro-batch
    loss_tokens_in_step: int  # labels != -100 over the whole global step, all ranks: the per-token normaliser
    step: int
    index_in_step: int  # this micro-batch's index among this rank's micro-batches of the step
    micro_batches_in_step: int  # how many micro-batches this rank runs in this step
    # Padded variant for CUDA graphs / TransformerEngine: each segment padded to a multiple, total to a fixed count.
    cu_seqlens_padded: torch.Tensor | None = None
    layout: str = "flat"  # "flat": [T] token tensors, "hf": [1, T]
    # DP-Merge: the DP ranks that share this micro-batch (its MicroBatch.dp_group); None: this rank's alone
    dp_group: list[int] | None = None
    # What PackedLoader knows about the step (a batch collated outside the loader keeps the defaults):
    epoch: int = 0
    last_in_epoch: bool = False  # this rank's last micro-batch of the epoch
    plan: StepPlan | None = None  # the whole step's plan, all ranks
    stats: LoaderStats | None = None  # the loader's counts up to and including this step
    step_metrics: StepMetrics | None = None  # what the loader knows about the step, for the trainer's logs
    extra: dict[str, Any] = field(default_factory=dict)  # the caller's own entries (collate's `extra`)
    # a mixture's entry of each segment (int64 [S], an index into `entry_names`); None for a single source
    entries: torch.Tensor | None = None
    entry_names: list[str] | None = None
    # Per-document CP (StepPlan.cp_mode "dynamic"): this pool GPU's part, a collate.cp_document_shards.DynamicCPShard; the
    # token tensors then hold this GPU's tokens only, cu_seqlens its query runs, cu_seqlens_k their gathered keys
    cp: Any = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def dp_shared(self) -> bool:
        """A DP-Merge micro-batch (SlimPack's, on by default): every DP rank of `dp_group` receives these same
        tokens and runs them together as context parallelism (each rank its shard,
        `packloader.runtime.groups.dp_merge_attention`), so a check that sums tokens over ranks sees them
        len(dp_group) times; `tokens_to_count` says which copy counts."""
        return self.dp_group is not None and len(self.dp_group) > 1

    def tokens_to_count(self, dp_rank: int) -> int:
        """The tokens DP rank `dp_rank` should count for this micro-batch in an exactly-once check: all of them,
        except on a shared micro-batch (`dp_shared`), whose tokens the first rank of its group counts and the
        others 0, as `loss_tokens_in_step` and the plan checker count it once."""
        if self.dp_shared and dp_rank != min(self.dp_group):
            return 0
        return self.num_tokens

    def to_hf(self) -> dict[str, Any]:
        """Keyword arguments for a transformers causal LM's packed path, `[1, T]` in either layout.

        `shift_labels` are these labels, which transformers' loss takes as they are (a piece's last token keeps its
        target in the next piece); `labels` are the same targets in transformers' unshifted convention (-100 at
        every segment's first token), for code that shifts them itself. `use_cache=False`: with a KV cache
        transformers does not look for packed sequences and attention would cross documents. The cu_seq_lens /
        max_length entries are the flash-attention varlen arguments; other attention implementations ignore them.

        A micro-batch holding a SlimPack slice is refused (SlicesNotSupported): the slice's keys begin in an
        earlier micro-batch, so `cu_seq_lens_k` would count keys this row does not hold, and transformers' flash
        path would cut every such row into the wrong sequences."""
        if self.cp is not None and any(g.size > 1 for g in self.cp.groups):
            raise ValueError(
                f"PackedBatch.to_hf(): step {self.step}, micro-batch {self.index_in_step} is one GPU's part of a "
                "per-document CP micro-batch whose keys are spread over its CP groups: run its attention with "
                "packloader.runtime.cp_document_attention.dynamic_cp_attention")
        for s in self.segments:
            if s.attend_from != s.start:
                raise SlicesNotSupported(
                    f"PackedBatch.to_hf(): step {self.step}, micro-batch {self.index_in_step} holds a slice of "
                    f"document {s.doc} (tokens {s.start}..{s.end}, attending from {s.attend_from}), whose keys start "
                    "in an earlier micro-batch: a transformers model given this row alone would attend to the wrong "
                    "tokens. Plan with PlanConfig(allow_slicing=False), or run slices with "
                    "packloader.runtime.slices.SliceExecutor (packloader_integrations.hf.PackedTrainer does)"
                )
        labels = self.labels.reshape(1, -1)
        unshifted = torch.full_like(labels, IGNORE_INDEX)
        unshifted[0, 1:] = labels[0, :-1]  # token t is the target of token t - 1 ...
        offsets = self.cu_seqlens_padded if self.cu_seqlens_padded is not None else self.cu_seqlens
        starts = offsets[:-1].long()
        unshifted[0, starts[starts < labels.shape[1]]] = IGNORE_INDEX  # ... unless a segment starts at t
        return {
            "input_ids": self.input_ids.reshape(1, -1),
            "labels": unshifted,
            "shift_labels": labels,
            "position_ids": self.position_ids.reshape(1, -1),
            "use_cache": False,
            "cu_seq_lens_q": self.cu_seqlens,
            "cu_seq_lens_k": self.cu_seqlens_k,
            "max_length_q": self.max_seqlen,
            "max_length_k": self.max_seqlen_k,
        }
