"""Megatron-LM's GPT dataset packing (``concat``), behind the Planner contract so its plans are scored like
every other.

The step's pieces are concatenated in draw order into one token stream, cut into samples of exactly
``max_tokens`` tokens at multiples of ``max_tokens`` over the stream; sample c goes to DP rank ``c % dp`` as its
micro-batch ``c // dp`` (Megatron's pretraining sampler with a micro-batch size of 1). Megatron never pads a
sample: the tail that does not fill a whole round of ``dp`` samples waits for the next step (it stays in the
planner queue, so boundaries stay at multiples of ``max_tokens`` over the run's stream). A document cut by a
sample boundary becomes independent chunks (``attend_from == start``), i.e. document-masked attention as packed
THD training runs it (Megatron with ``reset_attention_mask``); the second chunk does not see the first.
Megatron's extra label token per sample is not repeated: labels are made per document by the collator, so
every token appears exactly once.
"""

from __future__ import annotations

import numpy as np

from packloader.balancers.planners.base import Model, PackingPlanner, StepLayout
from packloader.balancers.planners.packing import Packing, Pieces
from packloader.balancers.planners.registry import Planner, register_planner
from packloader.contracts import PlanConfig, QueuedDoc


def concat_chunks(lengths: np.ndarray, cap: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Cut the concatenation of `lengths` at multiples of `cap`: (piece, start within piece, end within piece,
    chunk) of every resulting segment, in stream order."""
    lengths = np.asarray(lengths, dtype=np.int64)
    cum = np.cumsum(lengths)
    total = int(cum[-1]) if len(cum) else 0
    if total == 0:
        empty = np.zeros(0, np.int64)
        return empty, empty, empty, empty
    starts = cum - lengths
    cuts = np.arange(cap, total, cap, dtype=np.int64)
    seg_lo = np.unique(np.concatenate([starts[lengths > 0], cuts]))
    seg_hi = np.append(seg_lo[1:], total)
    piece = np.searchsorted(cum, seg_lo, side="right")
    return piece, seg_lo - starts[piece], seg_hi - starts[piece], seg_lo // cap


class ConcatPlanner(PackingPlanner):
    """Megatron-LM's concatenate-and-chunk samples (see the module docstring)."""

    name = "concat"

    def solve(self, pieces: Pieces, layout: StepLayout, model: Model) -> Packing:
        flush = layout.flush
        cfg = self.config
        dp, cap = cfg.parallel.dp, cfg.max_tokens
        total = pieces.total_tokens
        full = total // cap
        nchunks = -(-total // cap)
        pinned = layout.micro_batches or cfg.num_micro_batches
        rounds = pinned or full // dp
        take = rounds * dp if (not flush and rounds >= 1 and rounds * dp <= full) else nchunks
        m = max(1, pinned or 0, -(-take // dp))
        piece, lo, hi, chunk = concat_chunks(pieces.length, cap)
        keep = chunk < take
        queued: list[QueuedDoc] = []
        for i in np.nonzero(~keep)[0]:  # the tail of the stream waits for the next step, in stream order
            p = piece[i]
            queued.append(QueuedDoc(int(pieces.doc[p]), int(pieces.offset[p] + lo[i]), int(hi[i] - lo[i]), int(pieces.drawn[p])))
        piece, lo, hi, chunk = piece[keep], lo[keep], hi[keep], chunk[keep]
        start = pieces.offset[piece] + lo
        # chunk c -> rank c % dp, position c // dp; micro-batch id = rank * m + position
        seg_mb = (chunk % dp) * m + chunk // dp
        rank_mbs = (np.arange(dp)[:, None] * m + np.arange(m)[None, :]).astype(np.int64)
        return Packing(
            seg_doc=pieces.doc[piece], seg_start=start, seg_end=pieces.offset[piece] + hi, seg_af=start.copy(),
            seg_mb=seg_mb.astype(np.int64), rank_mbs=rank_mbs, queued=queued, strategy=self.name,
        )


@register_planner("concat", role="baseline", summary="concatenate and chunk (Megatron GPT dataset)", report_order=10)
def _make_concat(config: PlanConfig, options: object, model: Model) -> Planner:
    return ConcatPlanner(config, model)
