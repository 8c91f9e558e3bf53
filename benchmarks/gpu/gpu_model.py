"""A few Llama layers (packloader.runtime.llama_layer, the layer calibration times: RMSNorm, rotary GQA attention
through packloader's `varlen_attention`, SwiGLU MLP) on any device, and the packs the parts time through them: a
micro-batch of whole documents, or a slice that attends to earlier keys (its prefix keys/values given per layer,
as the slice executor hands them over)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from packloader.runtime.attention import varlen_attention
from packloader.runtime.calibrate import LayerShape
from packloader.runtime.llama_layer import LlamaLayer, rope_cos_sin


class Layers(nn.Module):
    """`n` layers of packloader's Llama layer (the one calibration times), attention through the pack's
    varlen attention; rope's cos/sin computed once per forward and shared by the layers."""

    def __init__(self, shape: LayerShape, n: int) -> None:
        super().__init__()
        self.head_dim = shape.head_dim
        self.layers = nn.ModuleList([LlamaLayer.of(shape) for _ in range(n)])

    def forward(self, x, pos, pack: "Pack", prefixes=None):
        rot = rope_cos_sin(pos, self.head_dim, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, rot, pack.attention_fn(None if prefixes is None else prefixes[i]))
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
        runtime pays and calibrate_slices measures): each segment's earlier keys, then its own, one torch.cat of
        one split of each (a slice per segment would cost backward a zero-filled copy of all keys per segment)."""
        own = new.split([q1 - q0 for q0, q1, _, _ in self.spans])
        pre = prefix.split([p1 - p0 for _, _, p0, p1 in self.spans])
        parts = []
        for i, (q0, q1, p0, p1) in enumerate(self.spans):
            if p1 > p0:
                parts.append(pre[i])
            parts.append(own[i])
        return torch.cat(parts)

    def attention_fn(self, prefix: tuple[torch.Tensor, torch.Tensor] | None):
        """The layer's attention call: a slice's earlier keys/values (`prefix`) go first in its key buffer."""
        if prefix is None:
            return self.attention
        return lambda q, k, v: self.attention(q, self.keys_with_prefix(k, prefix[0]), self.keys_with_prefix(v, prefix[1]))

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
