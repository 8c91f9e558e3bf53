"""One Llama decoder layer (RMSNorm, rotary embedding, fused-QKV grouped-query attention, SwiGLU MLP) with the
attention call left to the caller.

Calibration and the GPU proof both run this layer: calibration with the attention call passing the queries
through (what remains is the linear part the cost model prices per token), the proof with varlen attention over
real packs. One definition keeps the linear part calibration times the same work a real layer does: the fused
projection's views and their gradient, rope on q and k, the residual adds.
"""

from __future__ import annotations

import math
from typing import Callable, Protocol

import torch
from torch import nn

# q [Tq, Hq, D] (after rope), k/v [Tq, Hkv, D] (k after rope, v a view of the fused projection) -> [Tq, Hq, D]
Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

ROPE_BASE = 10000.0
RMS_EPS = 1e-6


class _Dims(Protocol):
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = RMS_EPS) -> torch.Tensor:
    """RMSNorm with the statistics in float32 for half inputs (as Llama's own implementations do)."""
    stats = x if x.dtype == torch.float64 else x.float()
    return x * torch.rsqrt(stats.pow(2).mean(-1, keepdim=True) + eps).to(x.dtype) * weight


def rope_cos_sin(pos: torch.Tensor, head_dim: int, dtype: torch.dtype,
                 base: float = ROPE_BASE) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [T, 1, head_dim/2] of each token's position: computed once per micro-batch and shared by
    every layer (as Hugging Face's Llama shares its position embeddings)."""
    if head_dim % 2:
        raise ValueError(f"rotary embedding needs an even head_dim, got {head_dim}")
    half = head_dim // 2
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    freq = 1.0 / (base ** (torch.arange(half, device=pos.device, dtype=wide) / half))
    ang = pos.to(wide)[:, None] * freq[None, :]
    return ang.cos()[:, None, :].to(dtype), ang.sin()[:, None, :].to(dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D]: dims i and i + D/2 form a pair turned by position x frequency i (the rotate-half
    layout of Hugging Face and Megatron's non-interleaved rope)."""
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], -1)


class LlamaLayer(nn.Module):
    """A Llama decoder layer; `forward(x [T, hidden], (cos, sin), attention)`."""

    def __init__(self, *, hidden: int, heads: int, kv_heads: int, head_dim: int, ffn: int) -> None:
        super().__init__()
        if heads % kv_heads:
            raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        qd, kvd = heads * head_dim, kv_heads * head_dim
        self.n1, self.n2 = nn.Parameter(torch.ones(hidden)), nn.Parameter(torch.ones(hidden))
        self.qkv = nn.Linear(hidden, qd + 2 * kvd, bias=False)
        self.o = nn.Linear(qd, hidden, bias=False)
        self.gate_up = nn.Linear(hidden, 2 * ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)
        for lin in (self.qkv, self.o, self.gate_up, self.down):
            nn.init.normal_(lin.weight, std=1.0 / math.sqrt(lin.in_features))

    @classmethod
    def of(cls, shape: _Dims) -> "LlamaLayer":
        """The layer of a shape (anything with hidden, heads, kv_heads, head_dim, ffn: a calibrate.LayerShape)."""
        return cls(hidden=shape.hidden, heads=shape.heads, kv_heads=shape.kv_heads, head_dim=shape.head_dim,
                   ffn=shape.ffn)

    def forward(self, x: torch.Tensor, rot: tuple[torch.Tensor, torch.Tensor], attention: Attention) -> torch.Tensor:
        T, D = x.shape[0], self.head_dim
        qd, kvd = self.heads * D, self.kv_heads * D
        q, k, v = self.qkv(rms_norm(x, self.n1)).split([qd, kvd, kvd], dim=-1)
        q, k = rope(q.view(T, self.heads, D), *rot), rope(k.view(T, self.kv_heads, D), *rot)
        out = attention(q, k, v.view(T, self.kv_heads, D))
        x = x + self.o(out.reshape(T, qd))
        g, u = self.gate_up(rms_norm(x, self.n2)).chunk(2, dim=-1)
        return x + self.down(nn.functional.silu(g) * u)
