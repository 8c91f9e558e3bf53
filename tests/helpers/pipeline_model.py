"""A small Llama-like model (embedding, RMSNorm, rotary GQA attention, SwiGLU MLP, LM head) split into pipeline
stage modules, and its single-process reference over whole documents with an explicit causal mask (independent
of packloader's attention), and a hand-made sliced plan: what tests/test_pipeline_slices.py and
benchmarks/pipeline_slices.py run."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from packloader.contracts import MicroBatch, RankPlan, Segment

VOCAB, H, HQ, HKV, HD, FF = 48, 16, 4, 2, 4, 32


def rope(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    freq = 1.0 / (10000 ** (torch.arange(half, dtype=x.dtype) / half))
    ang = pos.to(x.dtype)[:, None] * freq[None, :]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], -1)


class RMSNorm(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.w = nn.Parameter(torch.ones(n))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.w


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.n1, self.n2 = RMSNorm(H), RMSNorm(H)
        self.q = nn.Linear(H, HQ * HD, bias=False)
        self.k = nn.Linear(H, HKV * HD, bias=False)
        self.v = nn.Linear(H, HKV * HD, bias=False)
        self.o = nn.Linear(HQ * HD, H, bias=False)
        self.gate = nn.Linear(H, FF, bias=False)
        self.up = nn.Linear(H, FF, bias=False)
        self.down = nn.Linear(FF, H, bias=False)

    def forward(self, x, pos, attend):
        T = x.shape[0]
        h = self.n1(x)
        q = rope(self.q(h).view(T, HQ, HD), pos)
        k = rope(self.k(h).view(T, HKV, HD), pos)
        out = attend(q, k, self.v(h).view(T, HKV, HD))
        x = x + self.o(out.reshape(T, HQ * HD))
        h = self.n2(x)
        return x + self.down(nn.functional.silu(self.gate(h)) * self.up(h))


class Llama(nn.Module):
    def __init__(self, layers: int, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(VOCAB, H)
        self.layers = nn.ModuleList([Block() for _ in range(layers)])
        self.norm = RMSNorm(H)
        self.head = nn.Linear(H, VOCAB, bias=False)
        for p in self.parameters():  # away from 1 so that the norms' gradients are not special
            with torch.no_grad():
                p.add_(0.05 * torch.randn_like(p))
        self.double()


def _ctx_attend(q, k, v):
    from packloader.runtime.slices import current_slice_context

    return current_slice_context().attention(q, k, v)


class StageModule(nn.Module):
    """Layers lo..hi-1 of `model`, with the embedding on the first stage and norm + head on the last."""

    def __init__(self, model: Llama, lo: int, hi: int, first: bool, last: bool):
        super().__init__()
        self.first, self.last = first, last
        self.embed = model.embed if first else None
        self.layers = nn.ModuleList(model.layers[lo:hi])
        self.norm = model.norm if last else None
        self.head = model.head if last else None

    def forward(self, x, positions):
        if self.first:
            x = self.embed(x)
        for layer in self.layers:
            x = layer(x, positions, _ctx_attend)
        if self.last:
            x = self.head(self.norm(x))
        return x


def documents(lengths: dict[int, int], seed: int = 1) -> dict[int, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {d: torch.randint(0, VOCAB, (n,), generator=g) for d, n in lengths.items()}


def micro_batch_inputs(mb: MicroBatch, docs: dict[int, torch.Tensor]):
    """(token ids, position ids, labels) of a micro-batch in packed order; a document's last token has no label."""
    none = torch.zeros(0, dtype=torch.long)  # an empty micro-batch has empty inputs
    ids, pos, lab = [none], [none], [none]
    for s in mb.segments:
        d = docs[s.doc]
        ids.append(d[s.start:s.end])
        pos.append(torch.arange(s.start, s.end))
        nxt = torch.full((s.end - s.start,), -100, dtype=torch.long)
        hi = min(s.end, len(d) - 1)
        if hi > s.start:
            nxt[: hi - s.start] = d[s.start + 1 : hi + 1]
        lab.append(nxt)
    return torch.cat(ids), torch.cat(pos), torch.cat(lab)


def loss_tokens(docs: dict[int, torch.Tensor]) -> int:
    return sum(len(d) - 1 for d in docs.values())


def reference(model: Llama, docs: dict[int, torch.Tensor]) -> tuple[float, dict[str, torch.Tensor]]:
    """Loss (token loss sum / loss tokens) and gradients of every document run whole, one at a time, with an
    explicit causal-mask attention."""
    model.zero_grad()
    n_loss = loss_tokens(docs)
    total = 0.0

    for d, ids in docs.items():
        n = len(ids)
        mask = torch.ones(n, n, dtype=torch.bool).triu(1)

        def attend(q, k, v):
            k = k.repeat_interleave(HQ // HKV, 1)
            v = v.repeat_interleave(HQ // HKV, 1)
            s = torch.einsum("qhd,khd->hqk", q, k) / HD**0.5
            return torch.einsum("hqk,khd->qhd", torch.softmax(s.masked_fill(mask, float("-inf")), -1), v)

        x = model.embed(ids)
        pos = torch.arange(n)
        for layer in model.layers:
            x = layer(x, pos, attend)
        logits = model.head(model.norm(x))
        if n > 1:
            loss = nn.functional.cross_entropy(logits[:-1], ids[1:], reduction="sum") / n_loss
            loss.backward()
            total += float(loss.detach())
    return total, {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def loss_fn(logits: torch.Tensor, target) -> torch.Tensor:
    labels, n_loss = target
    return nn.functional.cross_entropy(logits, labels, ignore_index=-100, reduction="sum") / n_loss


def stage_layers(layers: int, num_stages: int) -> list[tuple[int, int]]:
    cuts = np.linspace(0, layers, num_stages + 1).round().astype(int)
    return [(int(cuts[i]), int(cuts[i + 1])) for i in range(num_stages)]


def _mb(*segs):
    return MicroBatch(segments=[Segment(*s) for s in segs])


# hand-made: document 0 (40 tokens) in three slices over micro-batches 0, 1, 3; document 2 in two slices over
# 1 and 2, sharing micro-batch 1 with document 0's middle slice; whole documents mixed in; a micro-batch
# holding two slices of one document (doc 5); micro-batch 3 both reads doc 0's keys and holds a whole doc
HAND_LENGTHS = {0: 40, 1: 9, 2: 21, 3: 6, 4: 13, 5: 18, 6: 4, 7: 11}
HAND = RankPlan(micro_batches=[
    _mb((0, 0, 14, 0), (1, 0, 9, 0)),
    _mb((2, 0, 10, 0), (0, 14, 30, 0)),
    _mb((3, 0, 6, 0), (2, 10, 21, 0), (6, 0, 4, 0)),
    _mb((4, 0, 13, 0), (0, 30, 40, 0)),
    _mb((5, 0, 7, 0), (5, 7, 18, 0)),
    _mb((7, 0, 11, 0)),
    _mb((6 + 100, 0, 3, 0)),  # a 3-token document (id 106)
    _mb((5 + 200, 0, 5, 0)),
])
HAND_LENGTHS.update({106: 3, 205: 5})
