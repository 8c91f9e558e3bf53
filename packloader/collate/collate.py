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


_AR = np.arange(1 << 16, dtype=np.int64)


def _arange(a: int, b: int) -> np.ndarray:
    """np.arange(a, b) as a view of a cached range when it fits (positions are rebuilt for every micro-batch)."""
    global _AR
    if b > len(_AR):
        _AR = np.arange(max(b, 2 * len(_AR)), dtype=np.int64)
    return _AR[a:b]


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
    # bookkeeping in Python ints: a micro-batch has few segments, and numpy calls on tiny arrays cost more
    docs_of: list[np.ndarray] = []
    qlen: list[int] = []
    klen: list[int] = []
    num_loss = 0
    for s in segments:
        doc = tokens.get(s.doc) if hasattr(tokens, "get") else tokens[s.doc]
        if doc is None:
            raise KeyError(f"no tokens for document {s.doc} (segment {s})")
        length = len(doc)
        if not (0 <= s.attend_from <= s.start < s.end <= length):
            _check_segment(s, length)
        docs_of.append(doc)
        q = s.end - s.start
        qlen.append(q)
        klen.append(s.end - s.attend_from)
        num_loss += q - (1 if s.end == length else 0)

    padded = pad_to_multiple is not None or pad_to_tokens is not None
    if padded:
        m = pad_to_multiple or 1
        plen = [-(-q // m) * m for q in qlen]
        total = sum(plen)
        if pad_to_tokens is not None:
            if total > pad_to_tokens:
                raise ValueError(
                    f"step {step}, micro-batch {index_in_step}: {total} tokens after padding to multiples of {m} "
                    f"exceed pad_to_tokens={pad_to_tokens}"
                )
            if n:
                plen[-1] += pad_to_tokens - total
            elif pad_to_tokens > 0:
                plen = [pad_to_tokens]
    else:
        plen = qlen
    offsets = [0]
    for p_ in plen:
        offsets.append(offsets[-1] + p_)
    T = offsets[-1]

    if padded:
        input_ids = np.full(T, pad_id, dtype=np.int64)
        labels = np.full(T, IGNORE_INDEX, dtype=np.int64)
    else:
        input_ids = np.empty(T, dtype=np.int64)
        labels = np.empty(T, dtype=np.int64)
    position_ids = np.empty(T, dtype=np.int64)
    for i, s in enumerate(segments):
        doc = docs_of[i]
        o, q = offsets[i], qlen[i]
        input_ids[o : o + q] = doc[s.start : s.end]
        if s.end < len(doc):
            labels[o : o + q] = doc[s.start + 1 : s.end + 1]
        else:
            labels[o : o + q - 1] = doc[s.start + 1 : s.end]
            labels[o + q - 1] = IGNORE_INDEX
        # positions: offset in the document, continuing through the segment's padding
        position_ids[o : offsets[i + 1]] = _arange(s.start, s.start + offsets[i + 1] - o)
    if len(plen) > n:  # the all-padding entry of an empty micro-batch
        position_ids[:] = _arange(0, T)

    cu = [0]
    cu_k = [0]
    for q, k in zip(qlen, klen):
        cu.append(cu[-1] + q)
        cu_k.append(cu_k[-1] + k)
    doc_ids = [s.doc for s in segments]
    if len(plen) > n:
        cu.append(cu[-1])
        cu_k.append(cu_k[-1])
        doc_ids.append(-1)
    if padded:
        max_q = max(plen) if plen else 0
        max_k = max([p_ + k - q for p_, k, q in zip(plen, klen, qlen)] + [max_q])
    else:
        max_q = max(qlen) if n else 0
        max_k = max(klen) if n else 0

    def shaped(a: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(a)
        return t.unsqueeze(0) if layout == "hf" else t

    return PackedBatch(
        input_ids=shaped(input_ids),
        labels=shaped(labels),
        position_ids=shaped(position_ids),
        cu_seqlens=torch.tensor(cu, dtype=torch.int32),
        cu_seqlens_k=torch.tensor(cu_k, dtype=torch.int32),
        max_seqlen=max_q,
        max_seqlen_k=max_k,
        doc_ids=torch.tensor(doc_ids, dtype=torch.int64),
        segments=segments,
        num_loss_tokens=num_loss,
        loss_tokens_in_step=num_loss if loss_tokens_in_step is None else int(loss_tokens_in_step),
        step=int(step),
        index_in_step=int(index_in_step),
        micro_batches_in_step=int(micro_batches_in_step),
        cu_seqlens_padded=torch.tensor(offsets, dtype=torch.int32) if padded else None,
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
