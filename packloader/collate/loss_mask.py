"""Loss masks in collate: labels -100 where a document's mask says the target token does not train (SFT).

The token copying stays in numba (`fill.py`), which writes every next-token label; this pass then clears the
labels whose target is masked, only for documents that carry a mask (`sources.loss_mask.MaskedTokens`), and takes
them off each micro-batch's loss-token count. Labels never cross a document either way: a document's last token
has no target.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from packloader.collate.batch import IGNORE_INDEX
from packloader.sources.loss_mask import loss_mask_of


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
