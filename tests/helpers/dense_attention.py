"""Dense causal softmax attention of one document in plain torch: the independent reference of the context-parallel
attention tests (nothing of packloader's attention in it)."""

from __future__ import annotations

import torch


def dense_causal_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, scale: float):
    """q [n, Hq, D], k/v [n, Hkv, D] (GQA: heads repeated); returns the output and the q, k, v gradients of
    sum(out * w)."""
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    s = torch.einsum("qhd,khd->hqk", q, kk) * scale
    n = q.shape[0]
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.einsum("hqk,khd->qhd", s.softmax(-1), vv)
    (out * w).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad
