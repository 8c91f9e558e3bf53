"""Per mixture entry counts of a step (`StepMetrics.entry_tokens` / `entry_loss_tokens`) and each segment's entry
on the batch (`PackedBatch.entries`), for per-entry logs and losses; nothing for a single source."""

from __future__ import annotations

from typing import Mapping

import msgspec
import numpy as np
import torch

from packloader.contracts import StepMetrics, StepPlan


def entry_counts(plan: StepPlan, entry_of, names: list[str],
                 doc_lengths: Mapping[int, int]) -> tuple[dict[str, int], dict[str, int]]:
    """Tokens and loss tokens of each entry in the whole step (all ranks); a segment several GPUs hold counts once,
    as `loss_tokens_in_plan` counts it. Every entry is listed, 0 where it trained nothing this step."""
    segs = list({(s.doc, s.start, s.end) for r in plan.ranks for mb in r.micro_batches for s in mb.segments})
    if not segs:
        return dict.fromkeys(names, 0), dict.fromkeys(names, 0)
    doc, start, end = (np.array(c, np.int64) for c in zip(*segs))
    length = np.fromiter((doc_lengths[d] for d in doc.tolist()), np.int64, len(doc))
    q = end - start
    loss = q - (end >= length)  # segment_loss_tokens: a document's last token has no target
    entries = entry_of(doc)
    tok = np.bincount(entries, weights=q, minlength=len(names)).astype(np.int64).tolist()
    los = np.bincount(entries, weights=loss, minlength=len(names)).astype(np.int64).tolist()
    return dict(zip(names, tok)), dict(zip(names, los))


def with_entry_counts(metrics: StepMetrics, plan: StepPlan, stream, doc_lengths: Mapping[int, int]) -> StepMetrics:
    """`metrics` with the per-entry counts when `stream` is a mixture (it has `entry_of`), else as it is."""
    if not hasattr(stream, "entry_of"):
        return metrics
    tokens, loss = entry_counts(plan, stream.entry_of, stream.names, doc_lengths)
    return msgspec.structs.replace(metrics, entry_tokens=tokens, entry_loss_tokens=loss)


def tag_entries(batches, stream) -> None:
    """Set each batch's `entries` (int64 [S], the entry index of each segment) and `entry_names` for a mixture."""
    if not hasattr(stream, "entry_of"):
        return
    if hasattr(batches, "set_entries"):  # a lazily built CollatedStep
        batches.set_entries(stream.entry_of, stream.names)
        return
    for b in batches:
        if b is None:
            continue
        ids = b.doc_ids.cpu().numpy() if isinstance(b.doc_ids, torch.Tensor) else np.asarray(b.doc_ids)
        b.entries = torch.from_numpy(stream.entry_of(ids).astype(np.int64))
        b.entry_names = list(stream.names)
