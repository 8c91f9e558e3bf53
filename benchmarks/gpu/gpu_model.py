"""A few Llama layers (RMSNorm, rotary GQA attention through packloader's `varlen_attention`, SwiGLU MLP) on any
device, and the packs the parts time through them: a micro-batch of whole documents, or a slice that attends to
earlier keys (its prefix keys/values given per layer, as the slice executor hands them over)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from packloader.runtime.attention import varlen_attention
from packloader.runtime.calibrate import LayerShape


def rope(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    freq = 1.0 / (10000 ** (torch.arange(half, device=x.device, dtype=torch.float32) / half))
    ang = pos.float()[:, None] * freq[None, :]
    cos, sin = ang.cos()[:, None, :].to(x.dtype), ang.sin()[:, None, :].to(x.dtype)
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], -1)


class Layer(nn.Module):
    def __init__(self, s: LayerShape) -> None:
        super().__init__()
        self.s = s
        h, qd, kvd = s.hidden, s.heads * s.head_dim, s.kv_heads * s.head_dim
        self.n1, self.n2 = nn.Parameter(torch.ones(h)), nn.Parameter(torch.ones(h))
        self.qkv = nn.Linear(h, qd + 2 * kvd, bias=False)
        self.o = nn.Linear(qd, h, bias=False)
        self.gate_up = nn.Linear(h, 2 * s.ffn, bias=False)
        self.down = nn.Linear(s.ffn, h, bias=False)
        for lin in (self.qkv, self.o, self.gate_up, self.down):
            nn.init.normal_(lin.weight, std=1.0 / math.sqrt(lin.in_features))

    @staticmethod
    def _rms(x, w):
        return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype) * w

    def forward(self, x, pos, pack: "Pack", prefix: tuple[torch.Tensor, torch.Tensor] | None):
        s, T = self.s, x.shape[0]
        qd, kvd = s.heads * s.head_dim, s.kv_heads * s.head_dim
        q, k, v = self.qkv(self._rms(x, self.n1)).split([qd, kvd, kvd], dim=-1)
        q, k = rope(q.view(T, s.heads, s.head_dim), pos), rope(k.view(T, s.kv_heads, s.head_dim), pos)
        v = v.reshape(T, s.kv_heads, s.head_dim)
        if prefix is not None:  # a slice: its document's earlier keys/values come first in the key buffer
            k, v = pack.keys_with_prefix(k, prefix[0]), pack.keys_with_prefix(v, prefix[1])
        out = pack.attention(q, k, v)
        x = x + self.o(out.reshape(T, qd))
        g, u = self.gate_up(self._rms(x, self.n2)).chunk(2, dim=-1)
        return x + self.down(nn.functional.silu(g) * u)


class Layers(nn.Module):
    def __init__(self, shape: LayerShape, n: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Layer(shape) for _ in range(n)])

    def forward(self, x, pos, pack: "Pack", prefixes=None):
        for i, layer in enumerate(self.layers):
            x = layer(x, pos, pack, None if prefixes is None else prefixes[i])
        return x


@dataclass
class Pack:
    """A micro-batch's segments as the runtime gets them: q[i] query tokens after p[i] earlier keys each."""

    q: np.ndarray
    p: np.ndarray
    device: torch.device
    backend: str | None = None

    def __post_init__(self) -> None:
        self.q = np.asarray(self.q, dtype=np.int64)
        self.p = np.asarray(self.p, dtype=np.int64)
        dev = self.device
        self.cu_q = torch.tensor(np.concatenate([[0], np.cumsum(self.q)]), dtype=torch.int32, device=dev)
        self.cu_k = torch.tensor(np.concatenate([[0], np.cumsum(self.q + self.p)]), dtype=torch.int32, device=dev)
        self.has_prefix = bool(self.p.any())
        cq, cp = np.concatenate([[0], np.cumsum(self.q)]), np.concatenate([[0], np.cumsum(self.p)])
        # (rows of the new keys, rows of the prefix) of each segment, for keys_with_prefix
        self.spans = [(int(cq[i]), int(cq[i + 1]), int(cp[i]), int(cp[i + 1])) for i in range(len(self.q))]

    @property
    def tokens(self) -> int:
        return int(self.q.sum())

    def positions(self) -> torch.Tensor:
        return torch.cat([torch.arange(p, p + q, device=self.device) for q, p in zip(self.q.tolist(), self.p.tolist())])

    def keys_with_prefix(self, new: torch.Tensor, prefix: torch.Tensor) -> torch.Tensor:
        """The key buffer as the runtime's `SliceContext.attention` assembles it (so part 4 times what the
        runtime pays and calibrate_slices measures): each segment's earlier keys, then its own, one torch.cat."""
        parts = []
        for q0, q1, p0, p1 in self.spans:
            if p1 > p0:
                parts.append(prefix[p0:p1])
            parts.append(new[q0:q1])
        return torch.cat(parts)

    def attention(self, q, k, v):
        cu_k = self.cu_k if self.has_prefix else self.cu_q
        return varlen_attention(q, k, v, self.cu_q, cu_k, int(self.q.max()), int((self.q + self.p).max()),
                                causal=True, backend=self.backend)


_NOISE: dict = {}


def noise(n: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """n random numbers on the device, drawn once per (device, dtype) and grown as needed: timing thousands of
    micro-batches must not spend its time drawing their inputs on the CPU."""
    buf = _NOISE.get((str(device), dtype))
    if buf is None or buf.numel() < n:
        gen = torch.Generator(device=device).manual_seed(0)
        buf = torch.randn(max(n, 1 << 20), generator=gen, device=device, dtype=torch.float32).to(dtype)
        _NOISE[(str(device), dtype)] = buf
    return buf[:n]


def pack_runner(model: Layers, pack: Pack, shape: LayerShape, dtype: torch.dtype):
    """A `run()` for the timer: one forward of `pack` through `model` (inputs and prefix K/V drawn once) and
    the output gradient its backward takes."""
    dev, T = pack.device, pack.tokens
    x = noise(T * shape.hidden, dev, dtype).view(T, shape.hidden).clone().requires_grad_()
    gy = noise(T * shape.hidden, dev, dtype).view(T, shape.hidden).flip(0)
    pos = pack.positions()
    prefixes = None
    if pack.has_prefix:
        n = int(pack.p.sum()) * shape.kv_heads * shape.head_dim
        kv = noise(n, dev, dtype).view(-1, shape.kv_heads, shape.head_dim)
        prefixes = [(kv.clone().requires_grad_(), kv.flip(0).requires_grad_()) for _ in model.layers]

    def run():
        x.grad = None
        model.zero_grad(set_to_none=True)
        return [model(x, pos, pack, prefixes)], [gy]

    return run
