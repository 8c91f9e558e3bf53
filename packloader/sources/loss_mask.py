"""A document's loss mask, carried with its tokens from the source to collate (SFT: only some tokens train).

`MaskedTokens` is an int32 token array with a `loss_mask` (bool, same length): `loss_mask[t]` is True where token
t is a target the loss trains on (it is predicted from token t - 1 of the same document). Carrying the mask on the
token array keeps every stage between source and collate unchanged: they pass documents around as arrays by id,
and a plain array means "every token trains", as before. A document's first token is never a target, whatever its
mask says.

`dropped`: why a source turned a row into an empty document ("no_loss", "too_long"); the loader skips empty
documents and counts each reason (`LoaderStats.dropped_no_loss`, `dropped_too_long`). Collate reads the mask by
its attribute name (`collate.loss_mask`).
"""

from __future__ import annotations

import numpy as np


class MaskedTokens(np.ndarray):
    """int32 tokens plus `loss_mask` (bool, same length) and, for an emptied row, the reason it was `dropped`.

    Views and copies (slices, casts) are plain arrays: a mask that fits the whole document must never ride on a
    part of it."""

    loss_mask: np.ndarray
    dropped: str | None

    def __new__(cls, tokens, loss_mask, dropped: str | None = None) -> "MaskedTokens":
        arr = np.asarray(tokens, dtype=np.int32).reshape(-1)
        mask = np.asarray(loss_mask, dtype=bool).reshape(-1)
        if mask.shape != arr.shape:
            raise ValueError(f"loss mask of {mask.size} entries for {arr.size} tokens; expected one per token")
        obj = arr.view(cls)
        obj.loss_mask = mask
        obj.dropped = dropped
        return obj

    def __array_finalize__(self, obj) -> None:
        self.loss_mask = None  # type: ignore[assignment]
        self.dropped = None

    def __array_wrap__(self, out_arr, context=None, return_scalar=False):
        # results of ufuncs and reductions are plain arrays (a sum of tokens carries no mask)
        out = np.asarray(out_arr).view(np.ndarray)
        return out[()] if return_scalar else out

    def __reduce__(self):  # pickled whole (spawned dataloader workers, rank exchange)
        return MaskedTokens, (np.asarray(self).view(np.ndarray).copy(), self.loss_mask, self.dropped)


def loss_mask_of(tokens) -> np.ndarray | None:
    """The document's loss mask, or None when every token trains (a plain array)."""
    mask = getattr(tokens, "loss_mask", None)
    return mask if mask is not None else None


def append_token(tokens, token: int, *, trains: bool = True):
    """`tokens` with one more token (the EOS a stream appends); a mask gets one more entry, `trains`."""
    out = np.empty(len(tokens) + 1, dtype=np.int32)
    out[:-1] = tokens
    out[-1] = token
    mask = loss_mask_of(tokens)
    if mask is None:
        return out
    return MaskedTokens(out, np.append(mask, trains), getattr(tokens, "dropped", None))


def as_int32(tokens):
    """int32 tokens, keeping a mask (np.asarray would drop it)."""
    mask = loss_mask_of(tokens)
    if mask is None:
        return np.asarray(tokens, dtype=np.int32)
    if tokens.dtype == np.int32:
        return tokens
    return MaskedTokens(np.asarray(tokens).view(np.ndarray).astype(np.int32), mask, tokens.dropped)
