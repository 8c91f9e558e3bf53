"""Segments plus document tokens -> the `PackedBatch` of `batch.py` (the batch contract of DESIGN.md).

For a micro-batch's segments `(doc, start, end, attend_from)` and each document's full token array:

- `input_ids`: the segments' tokens, concatenated in segment order;
- `labels[t]`: the document's next token after token t (also across a piece or slice boundary, since the next
  token belongs to the same document), and -100 only at a document's last token;
- `position_ids`: the token's offset in its document (restarts at 0 for each document, continues across the
  pieces and slices of one document);
- `cu_seqlens` (int32): cumulative query tokens per segment; `cu_seqlens_k`: cumulative keys, a slice's
  earlier-slice prefix (start - attend_from) included; `max_seqlen`, `max_seqlen_k` as Python ints;
- `doc_ids`: each segment's document id; `num_loss_tokens`: labels that are not -100.

Padded variant (`pad_to_multiple`, `pad_to_tokens`; for CUDA graphs and TransformerEngine's THD layout): each
segment is followed by padding up to a multiple of `pad_to_multiple` tokens, and the last segment's padding is
extended so the micro-batch holds exactly `pad_to_tokens` tokens. Padding tokens are `pad_id`, their labels
-100, their positions continue the segment's. `cu_seqlens` keeps the true lengths; `cu_seqlens_padded` gives each
segment's offset in the padded tensors (as TransformerEngine's `cu_seqlens_q_padded`); `max_seqlen` and
`max_seqlen_k` are the padded maxima (an upper bound is what the kernels need). A micro-batch with no segments
padded to `pad_to_tokens` holds one all-padding entry: cu_seqlens [0, 0], cu_seqlens_padded [0, P], doc id -1.

Layouts: "flat" gives `[T]` token tensors; "hf" gives `[1, T]` (the Hugging Face packed convention, the same
as `PackedBatch.to_hf()`); the cu_seqlens tensors are 1-D in both.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

import numpy as np
import torch

from packloader.collate.batch import IGNORE_INDEX, PackedBatch
from packloader.contracts import Segment, StepPlan

LAYOUTS = ("flat", "hf")


def _check_segment(seg: Segment, length: int) -> None:
    if not (0 <= seg.attend_from <= seg.start < seg.end <= length):
        raise ValueError(
            f"segment {seg} of document {seg.doc} (length {length}): expected 0 <= attend_from <= start < end <= length"
        )


def segment_loss_tokens(seg: Segment, doc_length: int) -> int:
    """Tokens of a segment that carry a loss target: all but the document's last token."""
    return (seg.end - seg.start) - (1 if seg.end >= doc_length else 0)


def loss_tokens_in_plan(plan: StepPlan, doc_lengths: Mapping[int, int]) -> int:
    """Tokens with a loss target in a whole step (all ranks, all micro-batches): the per-token loss normaliser.

    A segment that several ranks hold (a DP-Merge micro-batch) counts once.
    """
    seen: set[tuple[int, int, int]] = set()
    total = 0
    for rank in plan.ranks:
        for mb in rank.micro_batches:
            for s in mb.segments:
                key = (s.doc, s.start, s.end)
                if key in seen:
                    continue
                seen.add(key)
                total += segment_loss_tokens(s, int(doc_lengths[s.doc]))
    return total


def collate(
    segments: Sequence[Segment],
    tokens: Mapping[int, np.ndarray],
    *,
    step: int = 0,
    index_in_step: int = 0,
    micro_batches_in_step: int = 1,
    loss_tokens_in_step: int | None = None,
    layout: str = "flat",
    pad_to_multiple: int | None = None,
    pad_to_tokens: int | None = None,
    pad_id: int = 0,
    extra: dict | None = None,
) -> PackedBatch:
    """One micro-batch. `tokens[doc]` is document `doc`'s whole token array (its length is the document's length).

    `loss_tokens_in_step` defaults to this micro-batch's own count (a one-micro-batch step).
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if pad_to_multiple is not None and pad_to_multiple < 1:
        raise ValueError(f"pad_to_multiple must be >= 1, got {pad_to_multiple}")
    segments = list(segments)
    n = len(segments)
    qlen = np.empty(n, dtype=np.int64)
    prefix = np.empty(n, dtype=np.int64)
    starts = np.empty(n, dtype=np.int64)
    docs = np.empty(n, dtype=np.int64)
    for i, s in enumerate(segments):
        doc = tokens.get(s.doc) if hasattr(tokens, "get") else tokens[s.doc]
        if doc is None:
            raise KeyError(f"no tokens for document {s.doc} (segment {s})")
        _check_segment(s, len(doc))
        qlen[i], prefix[i], starts[i], docs[i] = s.end - s.start, s.start - s.attend_from, s.start, s.doc

    padded = pad_to_multiple is not None or pad_to_tokens is not None
    if padded:
        m = pad_to_multiple or 1
        plen = -(-qlen // m) * m
        total = int(plen.sum())
        if pad_to_tokens is not None:
            if total > pad_to_tokens:
                raise ValueError(
                    f"step {step}, micro-batch {index_in_step}: {total} tokens after padding to multiples of {m} "
                    f"exceed pad_to_tokens={pad_to_tokens}"
                )
            if n:
                plen[-1] += pad_to_tokens - total
            elif pad_to_tokens > 0:
                plen = np.array([pad_to_tokens], dtype=np.int64)
    else:
        plen = qlen
    T = int(plen.sum())

    input_ids = np.full(T, pad_id, dtype=np.int64) if padded else np.empty(T, dtype=np.int64)
    labels = np.full(T, IGNORE_INDEX, dtype=np.int64) if padded else np.empty(T, dtype=np.int64)
    offsets = np.zeros(len(plen) + 1, dtype=np.int64)
    np.cumsum(plen, out=offsets[1:])
    for i, s in enumerate(segments):
        doc = tokens[s.doc]
        o, q = int(offsets[i]), int(qlen[i])
        input_ids[o : o + q] = doc[s.start : s.end]
        if s.end < len(doc):
            labels[o : o + q] = doc[s.start + 1 : s.end + 1]
        else:
            labels[o : o + q - 1] = doc[s.start + 1 : s.end]
            labels[o + q - 1] = IGNORE_INDEX
    # positions: offset in the document, continuing through a segment's padding
    seg_start = np.concatenate([starts, np.zeros(len(plen) - n, np.int64)])
    position_ids = np.arange(T, dtype=np.int64) - np.repeat(offsets[:-1], plen) + np.repeat(seg_start, plen)

    cu = np.zeros(len(plen) + 1, dtype=np.int32)
    np.cumsum(qlen, out=cu[1 : n + 1])
    cu_k = np.zeros(len(plen) + 1, dtype=np.int32)
    np.cumsum(qlen + prefix, out=cu_k[1 : n + 1])
    doc_ids = docs if len(plen) == n else np.concatenate([docs, [-1]])
    if len(plen) > n:  # the all-padding entry of an empty micro-batch
        cu[-1], cu_k[-1] = cu[n], cu_k[n]
    if padded:
        max_q = int(plen.max()) if len(plen) else 0
        max_k = int((plen[:n] + prefix).max()) if n else max_q
        max_k = max(max_k, max_q)
    else:
        max_q = int(qlen.max()) if n else 0
        max_k = int((qlen + prefix).max()) if n else 0
    num_loss = int(np.count_nonzero(labels != IGNORE_INDEX))

    def shaped(a: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(a)
        return t.unsqueeze(0) if layout == "hf" else t

    return PackedBatch(
        input_ids=shaped(input_ids),
        labels=shaped(labels),
        position_ids=shaped(position_ids),
        cu_seqlens=torch.from_numpy(cu),
        cu_seqlens_k=torch.from_numpy(cu_k),
        max_seqlen=max_q,
        max_seqlen_k=max_k,
        doc_ids=torch.from_numpy(doc_ids),
        segments=segments,
        num_loss_tokens=num_loss,
        loss_tokens_in_step=num_loss if loss_tokens_in_step is None else int(loss_tokens_in_step),
        step=int(step),
        index_in_step=int(index_in_step),
        micro_batches_in_step=int(micro_batches_in_step),
        cu_seqlens_padded=torch.from_numpy(offsets.astype(np.int32)) if padded else None,
        extra={"layout": layout, **(extra or {})},
    )


def collate_padded(
    segments: Sequence[Segment],
    tokens: Mapping[int, np.ndarray],
    *,
    pad_to_multiple: int = 1,
    pad_to_tokens: int | None = None,
    pad_id: int = 0,
    **kwargs,
) -> PackedBatch:
    """The padded variant: each segment padded to a multiple, the micro-batch to `pad_to_tokens` (see the module)."""
    return collate(segments, tokens, pad_to_multiple=pad_to_multiple, pad_to_tokens=pad_to_tokens, pad_id=pad_id,
                   **kwargs)


def collate_concat(docs: Iterable[np.ndarray]) -> dict[str, torch.Tensor]:
    """The plain baseline collate (what a simple DataLoader does): concatenate whole documents, labels shifted
    inside each document. Used by the benchmark's reference DataLoader."""
    docs = [np.asarray(d) for d in docs]
    ids = np.concatenate(docs).astype(np.int64) if docs else np.zeros(0, np.int64)
    labels = np.roll(ids, -1)
    ends = np.cumsum([len(d) for d in docs]) - 1
    labels[ends] = IGNORE_INDEX
    return {"input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(labels)}
