"""The token-copying loop of collate in numba: one call fills every micro-batch of a step.

Per segment in Python it was three slice copies and a positions range (profiled: the collate stage was about a
third of the pre-tokenized loader's time, mostly per-segment interpreter overhead). `nogil` lets it run while
another loader thread holds the GIL.
"""

from __future__ import annotations

import numpy as np
from numba import njit

IGNORE = -100


@njit(cache=True, nogil=True)
def fill_segments(buf: np.ndarray, base: np.ndarray, start: np.ndarray, end: np.ndarray, attend: np.ndarray,
                  doc_len: np.ndarray, out_at: np.ndarray, out_end: np.ndarray, pad_id: int, input_ids: np.ndarray,
                  labels: np.ndarray, positions: np.ndarray) -> None:
    """Segment i is tokens start[i]..end[i]-1 of the document whose whole tokens are buf[base[i]:base[i]+doc_len[i]];
    it goes to out_at[i].., followed by padding up to out_end[i] (pad_id, label IGNORE, positions continuing).
    Token t's position is t - attend[i]: 0 at the start of a document or independent piece (attend == start), and
    continuing the piece's positions in a slice (attend is the piece's first token)."""
    for i in range(len(base)):
        o = out_at[i]
        s = start[i]
        q = end[i] - s
        p0 = s - attend[i]
        b = base[i] + s
        # separate branch-free loops, so that LLVM vectorises them
        for t in range(q):
            input_ids[o + t] = buf[b + t]
        for t in range(out_end[i] - o):
            positions[o + t] = p0 + t
        has_next = max(0, min(q, doc_len[i] - s - 1))  # tokens whose next token is in the document
        for t in range(has_next):
            labels[o + t] = buf[b + t + 1]
        for t in range(has_next, out_end[i] - o):
            labels[o + t] = IGNORE
        for t in range(q, out_end[i] - o):
            input_ids[o + t] = pad_id


@njit(cache=True, nogil=True)
def layout_segments(start: np.ndarray, end: np.ndarray, attend: np.ndarray, length: np.ndarray, mb_ptr: np.ndarray,
                    multiple: int, pad_to_tokens: int):
    """Where every segment of a step goes, micro-batch by micro-batch (segments mb_ptr[i]..mb_ptr[i+1]-1).

    multiple > 0 pads each segment to a multiple of it; pad_to_tokens >= 0 extends the last segment's padding so
    the micro-batch holds exactly that many tokens (an empty micro-batch is given as one segment with
    start == end == 0). Micro-batches follow one another in the step's buffers. Returns per segment: out_at,
    out_end (offsets in the step's buffers); per micro-batch at mb_ptr[i] + i .. mb_ptr[i+1] + i (one entry more
    than its segments): cu, cu_k, cu_padded (offsets in the micro-batch); mb_at (n_mb + 1: where each
    micro-batch starts in the step's buffers, and their end); per micro-batch: loss tokens, max_q, max_k; and the
    first micro-batch whose padded length exceeds pad_to_tokens (-1: none).
    """
    n_seg = start.shape[0]
    n_mb = mb_ptr.shape[0] - 1
    out_at = np.empty(n_seg, np.int64)
    out_end = np.empty(n_seg, np.int64)
    cu = np.empty(n_seg + n_mb, np.int32)
    cu_k = np.empty(n_seg + n_mb, np.int32)
    cu_p = np.empty(n_seg + n_mb, np.int32)
    mb_at = np.zeros(n_mb + 1, np.int64)
    loss = np.zeros(n_mb, np.int64)
    max_q = np.zeros(n_mb, np.int64)
    max_k = np.zeros(n_mb, np.int64)
    over = -1
    padded = multiple > 0 or pad_to_tokens >= 0
    m = multiple if multiple > 0 else 1
    for i in range(n_mb):
        a, b = mb_ptr[i], mb_ptr[i + 1]
        base = mb_at[i]
        total = 0
        for j in range(a, b):
            q = end[j] - start[j]
            p = (q + m - 1) // m * m if padded else q
            out_at[j] = base + total
            total += p
            out_end[j] = base + total
        if pad_to_tokens >= 0 and b > a:
            if total > pad_to_tokens:
                if over < 0:
                    over = i
            else:
                out_end[b - 1] += pad_to_tokens - total
                total = pad_to_tokens
        mb_at[i + 1] = base + total
        c = a + i  # this micro-batch's first entry in the cu arrays
        cu[c] = 0
        cu_k[c] = 0
        cu_p[c] = 0
        for j in range(a, b):
            q = end[j] - start[j]
            k = end[j] - attend[j]
            p = out_end[j] - out_at[j]
            cu[c + j - a + 1] = cu[c + j - a] + q
            cu_k[c + j - a + 1] = cu_k[c + j - a] + k
            cu_p[c + j - a + 1] = out_end[j] - base
            if q > 0:
                loss[i] += q - (1 if end[j] == length[j] else 0)
            if padded:
                max_q[i] = max(max_q[i], p)
                max_k[i] = max(max_k[i], p + k - q)
            else:
                max_q[i] = max(max_q[i], q)
                max_k[i] = max(max_k[i], k)
        if padded:
            max_k[i] = max(max_k[i], max_q[i])
    return out_at, out_end, cu, cu_k, cu_p, mb_at, loss, max_q, max_k, over
