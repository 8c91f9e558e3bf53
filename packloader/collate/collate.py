"""Segments plus document tokens -> the `PackedBatch` of `batch.py`: the batch contract every trainer adapter reads.

For a micro-batch's segments `(doc, start, end, attend_from)` and each document's full token array:

- `input_ids`: the segments' tokens, concatenated in segment order;
- `labels[t]`: the document's next token after token t, and -100 only at a document's last token. Across a
  piece boundary too: a piece's last token predicts the next piece's first token, as Megatron's concat-and-chunk
  (each sample reads seq_len + 1 tokens) does, so every token of a document but its first is a target exactly
  once whatever the context, and the step's loss tokens are its tokens minus one per document
  (`segment_loss_tokens`);
- `position_ids`: `t - attend_from`, the token's offset in its attention span: 0 at the start of each document
  and of each independent piece of a document longer than the context (a piece is a sequence of its own, as in
  every trainer's concat-and-chunk, so positions stay below the context and every segment start shows as a 0);
  a slice (attend_from < start) continues its piece's positions, since it attends to the piece's earlier keys;
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

from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import torch

from packloader.collate.batch import IGNORE_INDEX, PackedBatch
from packloader.collate.fill import fill_segments, layout_segments
from packloader.collate.loss_mask import apply_loss_masks, loss_mask_of, segment_targets
from packloader.contracts import Segment, StepPlan

LAYOUTS = ("flat", "hf")


def _check_segment(seg: Segment, length: int) -> None:
    if not (0 <= seg.attend_from <= seg.start < seg.end <= length):
        raise ValueError(
            f"segment {seg} of document {seg.doc} (length {length}): expected 0 <= attend_from <= start < end <= length"
        )


def segment_loss_tokens(seg: Segment, doc_length: int, tokens=None) -> int:
    """Tokens of a segment that carry a loss target: all but the document's last token (a piece's last token
    predicts the next piece's first), and with a loss mask on `tokens` (SFT) only those whose target trains."""
    if tokens is not None and loss_mask_of(tokens) is not None:
        return segment_targets(tokens, seg.start, seg.end)
    return (seg.end - seg.start) - (1 if seg.end >= doc_length else 0)


def loss_tokens_in_plan(plan: StepPlan, doc_lengths: Mapping[int, int],
                        tokens: Mapping[int, np.ndarray] | None = None) -> int:
    """Tokens with a loss target in a whole step (all ranks, all micro-batches): the per-token loss normaliser.

    A segment that several ranks hold (a DP-Merge micro-batch) counts once. `tokens`: documents whose arrays
    carry a loss mask (SFT) count their trained targets only; the others count by length.
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
                doc = None if tokens is None else tokens.get(s.doc)
                total += segment_loss_tokens(s, int(doc_lengths[s.doc]), doc)
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
    return collate_step(
        [segments], tokens, step=step, micro_batches_in_step=micro_batches_in_step,
        loss_tokens_in_step=loss_tokens_in_step, layout=layout, pad_to_multiple=pad_to_multiple,
        pad_to_tokens=pad_to_tokens, pad_id=pad_id, index_in_step=[index_in_step], extra=[extra],
    )[0]


def collate_step(
    micro_batches: Sequence[Sequence[Segment]],
    tokens: Mapping[int, np.ndarray],
    *,
    step: int = 0,
    micro_batches_in_step: int | None = None,
    loss_tokens_in_step: int | None = None,
    layout: str = "flat",
    pad_to_multiple: int | None = None,
    pad_to_tokens: int | None = None,
    pad_id: int = 0,
    index_in_step: Sequence[int] | None = None,
    extra: Sequence[dict | None] | None = None,
    common_extra: dict | None = None,
    dp_groups: Sequence[list[int] | None] | None = None,
    epoch: int = 0,
    last_in_epoch: bool = False,
    plan: StepPlan | None = None,
    stats: Any = None,
    step_metrics: Any = None,
) -> "CollatedStep":
    """Several micro-batches of one step at once: the loader's collate stage. The bookkeeping (offsets,
    cu_seqlens, maxima, loss tokens) and the token copying each run once for the whole step, in numba (`fill.py`,
    releasing the GIL), so the Python layer only builds arrays and batches.

    Returns a sequence whose item i is micro-batch i's PackedBatch, built when it is taken: a step waiting in the
    prefetch queue is a handful of arrays, not thousands of tensors and dicts that the garbage collector would
    have to walk (eager batches set off full collections with torch imported; a plain DataLoader sets off none).

    `index_in_step[i]`, `extra[i]` and `dp_groups[i]` are micro-batch i's index in the step (default i), extra
    entries (on top of `common_extra`, which all share) and DP-Merge group; `micro_batches_in_step` defaults to
    len(micro_batches). `epoch`, `plan`, `stats` and `step_metrics` go to every batch, `last_in_epoch` to the last
    one only (the loader's bookkeeping, see PackedBatch). The tensors are views of per-step arrays (a trainer that keeps one
    batch keeps its step's buffers, a few bytes per token of the step).
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if pad_to_multiple is not None and pad_to_multiple < 1:
        raise ValueError(f"pad_to_multiple must be >= 1, got {pad_to_multiple}")
    padded = pad_to_multiple is not None or pad_to_tokens is not None
    n_mb = len(micro_batches)
    index = list(range(n_mb)) if index_in_step is None else [int(i) for i in index_in_step]
    per_step = n_mb if micro_batches_in_step is None else int(micro_batches_in_step)
    get = tokens.get if hasattr(tokens, "get") else tokens.__getitem__

    micro_batches = [list(segs) for segs in micro_batches]
    mb_ptr, doc, start, end, attend = _segment_table(micro_batches, pad_to_tokens is not None and pad_to_tokens > 0)
    buf, base, length = _document_buffer(micro_batches, doc, start, end, attend, get)

    multiple = (pad_to_multiple or 1) if padded else 0
    out_at, out_end, cu, cu_k, cu_p, mb_at, n_loss, max_q, max_k, over = layout_segments(
        start, end, attend, length, np.array(mb_ptr, dtype=np.int64), multiple,
        -1 if pad_to_tokens is None else int(pad_to_tokens))
    if over >= 0:
        a, b = mb_ptr[over], mb_ptr[over + 1]
        total = int(np.sum(out_end[a:b] - out_at[a:b]))
        raise ValueError(
            f"step {step}, micro-batch {index[over]}: {total} tokens after padding to multiples "
            f"of {pad_to_multiple or 1} exceed pad_to_tokens={pad_to_tokens}"
        )
    # one buffer per step for each of the three token tensors, filled in one call that releases the GIL once
    # (a call per micro-batch made the collate thread queue for the GIL after each one: measured slower)
    all_ids = np.empty(int(mb_at[-1]), dtype=np.int64)
    all_labels = np.empty_like(all_ids)
    all_pos = np.empty_like(all_ids)
    if len(start):
        fill_segments(buf, base, start, end, attend, length, out_at, out_end, int(pad_id), all_ids, all_labels,
                      all_pos)
        apply_loss_masks(get, doc, start, end, base, out_at, mb_ptr, all_labels, n_loss)
    return CollatedStep(StepArrays(
        segments=micro_batches, ptr=mb_ptr, at=mb_at.tolist(), ids=all_ids, labels=all_labels, pos=all_pos,
        doc=doc, cu=cu, cu_k=cu_k, cu_p=cu_p if padded else None, loss=n_loss.tolist(), max_q=max_q.tolist(),
        max_k=max_k.tolist(), index=index, extra=list(extra) if extra is not None else [None] * n_mb,
        common=dict(common_extra or {}), dp_groups=list(dp_groups) if dp_groups is not None else [None] * n_mb,
        step=int(step), per_step=per_step, step_loss=None if loss_tokens_in_step is None else int(loss_tokens_in_step),
        layout=layout, epoch=int(epoch), last_in_epoch=bool(last_in_epoch), plan=plan, stats=stats,
        step_metrics=step_metrics,
    ))


def _segment_table(micro_batches: list[list[Segment]], pad_entry: bool):
    """The step's segments as columns (doc, start, end, attend_from) with each micro-batch's row range; an
    empty micro-batch padded to pad_to_tokens (`pad_entry`) holds one all-padding row of document -1."""
    rows: list[tuple[int, int, int, int]] = []
    mb_ptr = [0]
    for segs in micro_batches:
        if segs:
            rows.extend((s.doc, s.start, s.end, s.attend_from) for s in segs)
        elif pad_entry:
            rows.append((-1, 0, 0, 0))
        mb_ptr.append(len(rows))
    seg = np.array(rows, dtype=np.int64).reshape(-1, 4)
    doc, start, end, attend = (np.ascontiguousarray(c) for c in seg.T)
    return mb_ptr, doc, start, end, attend


def _document_buffer(micro_batches: list[list[Segment]], doc: np.ndarray, start: np.ndarray, end: np.ndarray,
                     attend: np.ndarray, get):
    """Each document's tokens once, in one buffer; returns it with each row's document offset in it and the
    document's length, after checking every row against its document."""
    uniq, where = np.unique(doc, return_inverse=True)
    arrays = []
    for d in uniq.tolist():
        if d == -1:
            arrays.append(np.zeros(0, np.int32))
            continue
        t = get(d)
        if t is None:
            s = next(s for segs in micro_batches for s in segs if s.doc == d)
            raise KeyError(f"no tokens for document {d} (segment {s})")
        arrays.append(np.asarray(t))
    doc_len = np.array([len(t) for t in arrays], dtype=np.int64)
    doc_at = np.concatenate([[0], np.cumsum(doc_len)[:-1]]).astype(np.int64) if len(arrays) else doc_len
    length = doc_len[where]
    base = doc_at[where]
    real = doc >= 0
    bad = real & ~((attend >= 0) & (attend <= start) & (start < end) & (end <= length))
    if bad.any():
        j = int(np.flatnonzero(bad)[0])
        _check_segment(Segment(int(doc[j]), int(start[j]), int(end[j]), int(attend[j])), int(length[j]))
    buf = np.concatenate(arrays) if arrays else np.zeros(1, np.int64)
    if buf.dtype != np.int32:
        buf = buf.astype(np.int64, copy=False)
    return buf, base, length


@dataclass(slots=True)
class StepArrays:
    """A collated step before its batches are built: per-step arrays with per-micro-batch offsets into them."""

    segments: list[list[Segment]]  # per micro-batch
    ptr: list[int]  # micro-batch i's segments are rows ptr[i]:ptr[i+1] of doc and of the cu arrays (+ i)
    at: list[int]  # micro-batch i's tokens are at[i]:at[i+1] of ids, labels and pos
    ids: np.ndarray
    labels: np.ndarray
    pos: np.ndarray
    doc: np.ndarray
    cu: np.ndarray
    cu_k: np.ndarray
    cu_p: np.ndarray | None
    loss: list[int]  # per micro-batch
    max_q: list[int]
    max_k: list[int]
    index: list[int]
    extra: list[dict | None]
    common: dict
    dp_groups: list[list[int] | None]
    step: int
    per_step: int
    step_loss: int | None  # None: each batch's own loss tokens
    layout: str
    epoch: int
    last_in_epoch: bool  # applies to the last micro-batch
    plan: StepPlan | None
    stats: Any
    step_metrics: Any = None
    entries: np.ndarray | None = None  # a mixture's entry of each row of `doc` (CollatedStep.set_entries)
    entry_names: list[str] | None = None


class CollatedStep(SequenceABC):
    """The micro-batches of a step as arrays; item i is built as a PackedBatch when taken (see collate_step)."""

    __slots__ = ("_s",)

    def __init__(self, arrays: StepArrays) -> None:
        self._s = arrays

    def __len__(self) -> int:
        return len(self._s.segments)

    def set_entries(self, entry_of, names: list[str]) -> None:
        """Each batch's `entries`: `entry_of(doc ids)` of its segments (a mixture's entry indexes into `names`)."""
        self._s.entries = np.asarray(entry_of(self._s.doc), dtype=np.int64)
        self._s.entry_names = list(names)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        s = self._s
        n = len(s.segments)
        if not -n <= i < n:
            raise IndexError(f"micro-batch {i} of a step with {n}")
        i %= n
        a, b = s.ptr[i], s.ptr[i + 1]
        lo, hi = s.at[i], s.at[i + 1]
        # numpy slices, then from_numpy: cheaper than slicing tensors
        ids, labels, pos = torch.from_numpy(s.ids[lo:hi]), torch.from_numpy(s.labels[lo:hi]), \
            torch.from_numpy(s.pos[lo:hi])
        if s.layout == "hf":
            ids, labels, pos = ids.unsqueeze(0), labels.unsqueeze(0), pos.unsqueeze(0)
        loss = s.loss[i]
        extra = s.extra[i]
        return PackedBatch(
            input_ids=ids,
            labels=labels,
            position_ids=pos,
            cu_seqlens=torch.from_numpy(s.cu[a + i : b + i + 1]),
            cu_seqlens_k=torch.from_numpy(s.cu_k[a + i : b + i + 1]),
            max_seqlen=s.max_q[i],
            max_seqlen_k=s.max_k[i],
            doc_ids=torch.from_numpy(s.doc[a:b]),
            segments=s.segments[i],
            num_loss_tokens=loss,
            loss_tokens_in_step=loss if s.step_loss is None else s.step_loss,
            step=s.step,
            index_in_step=s.index[i],
            micro_batches_in_step=s.per_step,
            cu_seqlens_padded=None if s.cu_p is None else torch.from_numpy(s.cu_p[a + i : b + i + 1]),
            layout=s.layout,
            dp_group=s.dp_groups[i],
            epoch=s.epoch,
            last_in_epoch=s.last_in_epoch and i == n - 1,
            plan=s.plan,
            stats=s.stats,
            step_metrics=s.step_metrics,
            extra={**s.common, **extra} if extra else dict(s.common),
            entries=None if s.entries is None else torch.from_numpy(s.entries[a:b]),
            entry_names=s.entry_names,
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
