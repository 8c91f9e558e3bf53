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
from numba import njit

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


def apply_loss_masks(get: Callable, doc: np.ndarray, start: np.ndarray, end: np.ndarray, base: np.ndarray,
                     out_at: np.ndarray, mb_ptr: list[int], labels: np.ndarray, n_loss: np.ndarray) -> None:
    """Segment j (tokens start[j]..end[j]-1 of document doc[j], whose tokens start at base[j] of the step's
    document buffer, written at out_at[j]): clear label t where token t + 1 of the document is masked; subtract
    the cleared targets from n_loss of segment j's micro-batch."""
    uniq, where = np.unique(doc, return_inverse=True)
    arrays = [np.zeros(0, np.int32) if d < 0 else get(d) for d in uniq.tolist()]
    masks = [loss_mask_of(t) for t in arrays]
    if all(m is None for m in masks):
        return
    # the masks in the document buffer's layout (`collate._document_buffer`: each document once, in id order)
    mask_buf = np.concatenate([np.ones(len(t), bool) if m is None else np.asarray(m, bool)
                               for t, m in zip(arrays, masks)] + [np.zeros(1, bool)])
    has_mask = np.array([m is not None for m in masks], dtype=np.bool_)[where]
    doc_len = np.array([len(t) for t in arrays], dtype=np.int64)[where]
    mb_of = np.repeat(np.arange(len(mb_ptr) - 1), np.diff(np.asarray(mb_ptr))).astype(np.int64)
    _clear_masked(mask_buf, np.asarray(base, np.int64), start, end, doc_len, np.asarray(out_at, np.int64), mb_of,
                  has_mask, labels, n_loss)


@njit(cache=True, nogil=True)
def _clear_masked(mask_buf, base, start, end, doc_len, out_at, mb_of, has_mask, labels, n_loss) -> None:
    for j in range(base.shape[0]):
        if not has_mask[j]:
            continue
        s = start[j]
        hi = min(end[j] + 1, doc_len[j])  # targets of tokens s..end-1: tokens s+1..end (one fewer at the end)
        for t in range(s + 1, hi):
            if not mask_buf[base[j] + t]:
                labels[out_at[j] + t - s - 1] = IGNORE_INDEX
                n_loss[mb_of[j]] -= 1
