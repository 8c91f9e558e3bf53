"""packloader.runtime.llama_layer (the layer calibration times and the GPU proof runs) against references written
here: rope as a complex rotation, the layer as plain torch ops with separate q/k/v weights and per-document
softmax attention, and calibrate's linear part as that layer with attention passing the queries through."""

from __future__ import annotations

import math

import pytest
import torch

from packloader.runtime.attention import varlen_attention
from packloader.runtime.calibrate import LayerShape, LinearPart
from packloader.runtime.llama_layer import LlamaLayer, rope, rope_cos_sin

SHAPE = LayerShape(hidden=24, heads=4, kv_heads=2, head_dim=6, ffn=40)
DOCS = [5, 1, 9, 3]  # a packed micro-batch of four documents


def complex_rope(x: torch.Tensor, pos: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Dims i and i + D/2 as the real and imaginary part of one number, turned by pos * base^(-i/(D/2))."""
    half = x.shape[-1] // 2
    z = torch.complex(x[..., :half], x[..., half:])
    theta = pos.double()[:, None] * base ** (-torch.arange(half, dtype=torch.float64) / half)
    z = z * torch.polar(torch.ones_like(theta), theta)[:, None, :]
    return torch.cat([z.real, z.imag], -1)


def doc_positions() -> torch.Tensor:
    return torch.cat([torch.arange(n) for n in DOCS])


def test_rope_is_a_complex_rotation():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(17, 3, 8, dtype=torch.float64, generator=gen)
    pos = torch.tensor([0, 1, 2, 7, 100, 4095, 3, 3, 0, 9, 12, 13, 14, 50, 51, 52, 65535])
    got = rope(x, *rope_cos_sin(pos, 8, torch.float64))
    torch.testing.assert_close(got, complex_rope(x, pos), rtol=1e-12, atol=1e-12)
    # position 0 leaves a vector as it is, and a rotation keeps each pair's length
    torch.testing.assert_close(got[0], x[0])
    with pytest.raises(ValueError, match="even head_dim"):
        rope_cos_sin(pos, 7, torch.float64)


def _rms(x, w):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * w


def _causal_softmax_attention(q, k, v):
    """One document: q [n, Hq, D], k/v [n, Hkv, D], each query head reading its group's key/value head."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
    n = q.shape[0]
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


def hand_layer(layer: LlamaLayer, x: torch.Tensor, attend) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The Llama layer with separate Q/K/V and gate/up weights cut from `layer`'s fused ones; `attend(q, k, v)`
    per document or over the pack. Returns (output, k after rope, v)."""
    s = SHAPE
    qd, kvd = s.heads * s.head_dim, s.kv_heads * s.head_dim
    wq, wk, wv = layer.qkv.weight[:qd], layer.qkv.weight[qd:qd + kvd], layer.qkv.weight[qd + kvd:]
    wg, wu = layer.gate_up.weight[: s.ffn], layer.gate_up.weight[s.ffn:]
    pos = doc_positions()
    h = _rms(x, layer.n1)
    q = complex_rope((h @ wq.T).reshape(-1, s.heads, s.head_dim), pos)
    k = complex_rope((h @ wk.T).reshape(-1, s.kv_heads, s.head_dim), pos)
    v = (h @ wv.T).reshape(-1, s.kv_heads, s.head_dim)
    y = x + attend(q, k, v).reshape(-1, qd) @ layer.o.weight.T
    h2 = _rms(y, layer.n2)
    g, u = h2 @ wg.T, h2 @ wu.T
    return y + (g * torch.sigmoid(g) * u) @ layer.down.weight.T, k, v


def per_document(q, k, v):
    out, start = [], 0
    for n in DOCS:
        out.append(_causal_softmax_attention(q[start:start + n], k[start:start + n], v[start:start + n]))
        start += n
    return torch.cat(out)


def _inputs():
    torch.manual_seed(3)
    layer = LlamaLayer.of(SHAPE).double()
    with torch.no_grad():  # norms away from 1, so a missing or misplaced weight shows
        layer.n1.uniform_(0.5, 1.5)
        layer.n2.uniform_(0.5, 1.5)
    x = torch.randn(sum(DOCS), SHAPE.hidden, dtype=torch.float64)
    return layer, x


def test_layer_forward_and_backward_match_a_hand_written_llama_layer():
    layer, x = _inputs()
    cu = torch.tensor([0, *torch.tensor(DOCS).cumsum(0).tolist()], dtype=torch.int32)
    n = max(DOCS)

    def attention(q, k, v):
        return varlen_attention(q, k, v, cu, cu, n, n, causal=True, backend="reference")

    xa = x.clone().requires_grad_()
    got = layer(xa, rope_cos_sin(doc_positions(), SHAPE.head_dim, torch.float64), attention)
    xb = x.clone().requires_grad_()
    want, _, _ = hand_layer(layer, xb, per_document)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    gy = torch.randn_like(got)
    ga = torch.autograd.grad(got, [xa, *layer.parameters()], gy)
    gb = torch.autograd.grad(want, [xb, *layer.parameters()], gy)
    for a, b in zip(ga, gb):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


def test_calibrates_linear_part_is_the_layer_with_attention_passing_q_through():
    layer, x = _inputs()
    lin = LinearPart(SHAPE).double()
    lin.layer.load_state_dict(layer.state_dict())
    xa = x.clone().requires_grad_()
    y, k, v = lin(xa, rope_cos_sin(doc_positions(), SHAPE.head_dim, torch.float64))
    xb = x.clone().requires_grad_()
    want_y, want_k, want_v = hand_layer(layer, xb, lambda q, k, v: q)
    for a, b in ((y, want_y), (k, want_k), (v, want_v)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    # the backward calibration times: through the output and k/v (what attention's backward hands the layer)
    grads = [torch.randn_like(t) for t in (y, k, v)]
    ga = torch.autograd.grad([y, k, v], [xa, *lin.layer.parameters()], grads)
    gb = torch.autograd.grad([want_y, want_k, want_v], [xb, *layer.parameters()], grads)
    for a, b in zip(ga, gb):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)
