"""Loss masks in collate: labels -100 where a document's mask says the target token does not train (SFT).

A mask is a token array's `loss_mask` attribute (bool, one per token; `sources.loss_mask.MaskedTokens` sets it):
collate reads it by name and imports nothing from the sources. The token copying stays in numba (`fill.py`), which
writes every next-token label; this pass then clears the labels whose target is masked, only for documents that
carry a mask, and takes them off each micro-batch's loss-token count. Labels never cross a document either way: a
document's last token has no target.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from packloader.collate.batch import IGNORE_INDEX


def loss_mask_of(tokens) -> np.ndarray | None:
    """The document's loss mask, or None when every token trains."""
    return getattr(tokens, "loss_mask", None)


def segment_targets(tokens, start: int, end: int) -> int:
    """Loss targets of tokens start..end-1 of a document: token t's target is token t + 1 of the same document,
    counted when the mask lets t + 1 train (a piece's last token predicts the next piece's first)."""
    n = len(tokens)
    hi = min(end + 1, n)
    lo = start + 1
    if hi <= lo:
        return 0
    mask = loss_mask_of(tokens)
    if mask is None:
        return hi - lo
    return int(np.count_nonzero(mask[lo:hi]))


def apply_loss_masks(get: Callable, doc: np.ndarray, start: np.ndarray, end: np.ndarray, out_at: np.ndarray,
                     mb_ptr: list[int], labels: np.ndarray, n_loss: np.ndarray) -> None:
    """Segment j (tokens start[j]..end[j]-1 of document doc[j], written at out_at[j]): clear label t where token
    t + 1 of the document is masked; subtract the cleared targets from n_loss of segment j's micro-batch."""
    masks: dict[int, np.ndarray | None] = {}
    for d in np.unique(doc).tolist():
        masks[d] = None if d < 0 else loss_mask_of(get(d))
    if not any(m is not None for m in masks.values()):
        return
    mb_of = np.repeat(np.arange(len(mb_ptr) - 1), np.diff(np.asarray(mb_ptr)))
    for j in range(len(doc)):
        mask = masks[int(doc[j])]
        if mask is None:
            continue
        s, e = int(start[j]), int(end[j])
        nxt = mask[s + 1 : e + 1]  # targets of tokens s..e-1 (one fewer at the document's end)
        off = np.flatnonzero(~nxt)
        if len(off):
            labels[int(out_at[j]) + off] = IGNORE_INDEX
            n_loss[mb_of[j]] -= len(off)
