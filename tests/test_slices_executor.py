"""A document run as a chain of slices over several micro-batches gives the same outputs and the same gradients
(inputs and q/k/v/o weights) as the same document run whole; the plan check names the step, rank and document."""

import pytest
import torch
from torch import nn

from packloader.contracts import MicroBatch, RankPlan, Segment, StepPlan
from packloader.runtime.slices import (
    SliceContext,
    SliceExecutor,
    SlicesNotSupported,
    current_slice_context,
    find_slices,
    require_no_slices,
)

D, HQ, HKV, HD = 8, 4, 2, 4


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q = nn.Linear(D, HQ * HD, bias=False)
        self.k = nn.Linear(D, HKV * HD, bias=False)
        self.v = nn.Linear(D, HKV * HD, bias=False)
        self.o = nn.Linear(HQ * HD, D, bias=False)

    def forward(self, x, attend, layer):
        T = x.shape[0]
        out = attend(self.q(x).view(T, HQ, HD), self.k(x).view(T, HKV, HD), self.v(x).view(T, HKV, HD), layer)
        return self.o(out.reshape(T, HQ * HD))


class Model(nn.Module):
    """Two attention layers with residuals and a per-token nonlinearity: layer 2's keys depend on layer 1's
    attention over earlier slices, so gradients must cross micro-batches through both caches."""

    def __init__(self, dropout=0.0):
        super().__init__()
        self.layers = nn.ModuleList([Attention(), Attention()])
        self.drop = nn.Dropout(dropout)

    def forward(self, x, attend):
        for i, layer in enumerate(self.layers):
            x = x + self.drop(layer(torch.tanh(x), attend, i))
        return x


def dense_whole(lengths):
    """Independent reference: causal GQA attention of whole documents by an explicit mask."""

    def attend(q, k, v, layer):
        outs, o = [], 0
        for n in lengths:
            qs, ks, vs = q[o : o + n], k[o : o + n].repeat_interleave(HQ // HKV, 1), v[o : o + n].repeat_interleave(HQ // HKV, 1)
            s = torch.einsum("qhd,khd->hqk", qs, ks) / HD**0.5
            s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
            outs.append(torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), vs))
            o += n
        return torch.cat(outs)

    return attend


LENGTHS = {0: 50, 1: 12, 2: 30, 3: 7, 4: 1}
CHAINS = {
    "three-slices-mixed": [
        [Segment(0, 0, 20, 0), Segment(1, 0, 12, 0)],
        [Segment(2, 0, 18, 0), Segment(0, 20, 35, 0)],
        [Segment(3, 0, 7, 0), Segment(0, 35, 50, 0), Segment(2, 18, 30, 0), Segment(4, 0, 1, 0)],
    ],
    "slices-in-one-micro-batch-too": [
        [Segment(0, 0, 10, 0), Segment(0, 10, 20, 0), Segment(3, 0, 7, 0)],
        [Segment(1, 0, 12, 0), Segment(0, 20, 49, 0), Segment(2, 0, 30, 0)],
        [Segment(0, 49, 50, 0), Segment(4, 0, 1, 0)],
    ],
    "one-token-slices": [[Segment(0, i, i + 1, 0)] for i in range(50)]
    + [[Segment(d, 0, LENGTHS[d], 0) for d in (1, 2, 3, 4)]],
}


def _setup(seed=0, dropout=0.0):
    torch.manual_seed(seed)
    model = Model(dropout).double()
    xs = {d: torch.randn(n, D, dtype=torch.float64) for d, n in LENGTHS.items()}
    ws = {d: torch.randn(n, D, dtype=torch.float64) for d, n in LENGTHS.items()}
    return model, xs, ws


def _reference(model, xs, ws):
    docs = sorted(LENGTHS)
    x = torch.cat([xs[d] for d in docs]).clone().requires_grad_()
    out = model(x, dense_whole([LENGTHS[d] for d in docs]))
    (out * torch.cat([ws[d] for d in docs])).sum().backward()
    grads_x, o = {}, 0
    outs = {}
    for d in docs:
        grads_x[d] = x.grad[o : o + LENGTHS[d]]
        outs[d] = out.detach()[o : o + LENGTHS[d]]
        o += LENGTHS[d]
    return outs, grads_x, {n: p.grad.clone() for n, p in model.named_parameters()}


def _sliced(model, xs, ws, chain, **kw):
    leaves = {d: x.clone().requires_grad_() for d, x in xs.items()}
    outs = {d: torch.full((n, D), float("nan"), dtype=torch.float64) for d, n in LENGTHS.items()}

    def step_fn(segs, ctx):
        x = torch.cat([leaves[s.doc][s.start : s.end] for s in segs])
        out = model(x, ctx.attention)
        o = 0
        for s in segs:
            outs[s.doc][s.start : s.end] = out.detach()[o : o + s.end - s.start]
            o += s.end - s.start
        return (out * torch.cat([ws[s.doc][s.start : s.end] for s in segs])).sum()

    losses = SliceExecutor(**kw).run(chain, step_fn)
    return outs, {d: l.grad for d, l in leaves.items()}, {n: p.grad.clone() for n, p in model.named_parameters()}, losses


@pytest.mark.parametrize("recompute", [True, False])
@pytest.mark.parametrize("chain", sorted(CHAINS))
def test_sliced_chain_matches_whole_documents(chain, recompute):
    model, xs, ws = _setup()
    ref_out, ref_gx, ref_gw = _reference(model, xs, ws)
    model.zero_grad()
    out, gx, gw, losses = _sliced(model, xs, ws, CHAINS[chain], recompute=recompute)
    for d in LENGTHS:
        torch.testing.assert_close(out[d], ref_out[d], rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(gx[d], ref_gx[d], rtol=1e-10, atol=1e-10)
    assert set(gw) == {f"layers.{i}.{p}.weight" for i in (0, 1) for p in "qkvo"}
    for name in gw:
        torch.testing.assert_close(gw[name], ref_gw[name], rtol=1e-10, atol=1e-10)
    total = sum(float((ref_out[d] * ws[d]).sum()) for d in LENGTHS)
    assert sum(float(l) for l in losses) == pytest.approx(total, rel=1e-10)


@pytest.mark.parametrize("recompute", [True, False])
def test_gradients_accumulate_like_a_plain_loop(recompute):
    # two runs without zero_grad: .grad holds twice the reference, as two plain backward passes would
    model, xs, ws = _setup()
    _, _, ref_gw = _reference(model, xs, ws)
    model.zero_grad()
    _sliced(model, xs, ws, CHAINS["three-slices-mixed"], recompute=recompute)
    _, _, gw, _ = _sliced(model, xs, ws, CHAINS["three-slices-mixed"], recompute=recompute)
    for name in gw:
        torch.testing.assert_close(gw[name], 2 * ref_gw[name], rtol=1e-10, atol=1e-10)


def test_recomputation_replays_dropout():
    model, xs, ws = _setup(dropout=0.3)
    seen = []

    def step_fn(segs, ctx):
        assert current_slice_context() is ctx
        x = torch.cat([xs[s.doc][s.start : s.end] for s in segs])
        out = model(x, ctx.attention)
        loss = (out * torch.cat([ws[s.doc][s.start : s.end] for s in segs])).sum()
        seen.append((tuple(segs), torch.is_grad_enabled(), float(loss)))
        return loss

    SliceExecutor().run(CHAINS["three-slices-mixed"], step_fn)
    # micro-batches 0 and 1 are read by later ones: forward without a graph, then recomputed with one
    first = {segs: loss for segs, grad, loss in seen if not grad}
    again = {segs: loss for segs, grad, loss in seen if grad and segs in first}
    assert len(first) == 2 and first == again


@pytest.mark.parametrize("recompute", [True, False])
def test_forward_calls_per_micro_batch(recompute):
    # "three-slices-mixed": later micro-batches read keys of micro-batches 0 and 1, none read micro-batch 2's
    model, xs, ws = _setup()
    chain = CHAINS["three-slices-mixed"]
    calls = []

    def step_fn(segs, ctx):
        calls.append((chain.index(segs), torch.is_grad_enabled()))
        return model(torch.cat([xs[s.doc][s.start : s.end] for s in segs]), ctx.attention).sum()

    SliceExecutor(recompute=recompute).run(chain, step_fn)
    if recompute:  # 0 and 1 forward without a graph, 2 with one; then 1 and 0 recomputed with one
        assert calls == [(0, False), (1, False), (2, True), (1, True), (0, True)]
    else:  # one forward each, all with their graphs
        assert calls == [(0, True), (1, True), (2, True)]


@pytest.mark.parametrize("recompute", [True, False])
def test_cache_holds_only_what_later_slices_read_and_is_freed(recompute):
    model, xs, ws = _setup()
    ex = SliceExecutor(recompute=recompute)
    sizes = []

    def step_fn(segs, ctx):
        out = model(torch.cat([xs[s.doc][s.start : s.end] for s in segs]), ctx.attention)
        sizes.append((torch.is_grad_enabled(), len(ex.cache), ex.cache.nbytes()))
        return out.sum()

    ex.run(CHAINS["three-slices-mixed"], step_fn)
    # forward pass: after mb 0 the keys/values of A[0:20) at 2 layers; after mb 1 also A[20:35) and C[0:18)
    assert [n for g, n, _ in sizes[:2]] == [2, 6]
    kv_elems = 2 * 2 * (20 + 15 + 18) * HKV * HD  # k and v, 2 layers, cached tokens
    assert sizes[1][2] == kv_elems * 8
    assert len(ex.cache) == 0  # freed at the end


def test_missing_earlier_slice_is_an_error():
    model, xs, ws = _setup()
    chain = [[Segment(0, 20, 35, 0)], [Segment(0, 0, 20, 0)]]  # wrong order
    with pytest.raises(ValueError, match=r"micro-batch 0: document 0 is sliced .* token 0 .* no earlier micro-batch"):
        SliceExecutor().run(chain, lambda segs, ctx: model(torch.zeros(15, D, dtype=torch.float64), ctx.attention).sum())


def test_context_without_cache_refuses_a_slice():
    ctx = SliceContext([Segment(5, 10, 12, 0)])
    q = torch.zeros(2, HQ, HD)
    with pytest.raises(RuntimeError, match="document 5"):
        ctx.attention(q, q[:, :HKV], q[:, :HKV])


def _plan():
    return StepPlan(
        step=7,
        ranks=[
            RankPlan(micro_batches=[MicroBatch(segments=[Segment(1, 0, 10, 0)])]),
            RankPlan(micro_batches=[MicroBatch(segments=[Segment(9, 0, 64, 0)]),
                                    MicroBatch(segments=[Segment(3, 0, 5, 0), Segment(9, 64, 100, 0)])]),
        ],
    )


def test_require_no_slices_names_step_rank_and_document():
    plan = _plan()
    assert [(r.step, r.rank, r.micro_batch, r.segment.doc) for r in find_slices(plan)] == [(7, 1, 1, 9)]
    with pytest.raises(SlicesNotSupported, match=r"step 7, rank 1, micro-batch 1: document 9 is sliced .*allow_slicing=False"):
        require_no_slices(plan)
    require_no_slices(StepPlan(step=0, ranks=[RankPlan(micro_batches=[MicroBatch(segments=[Segment(1, 0, 10, 0)])])]))
    require_no_slices(plan.ranks[0].micro_batches)  # a sequence of micro-batches without slices


def test_executor_that_cannot_run_slices_refuses_them():
    chain = CHAINS["three-slices-mixed"]
    with pytest.raises(SlicesNotSupported, match=r"step 3, rank 2, micro-batch 1: document 0"):
        SliceExecutor(supports_slices=False, rank=2).run(chain, lambda s, c: None, step=3)
    # without slices it is a plain loop
    model, xs, ws = _setup()
    ref_out, ref_gx, ref_gw = _reference(model, xs, ws)
    model.zero_grad()
    whole = [[Segment(d, 0, LENGTHS[d], 0) for d in (0, 1)], [Segment(d, 0, LENGTHS[d], 0) for d in (2, 3, 4)]]
    _, gx, gw, _ = _sliced(model, xs, ws, whole, supports_slices=False)
    for name in gw:
        torch.testing.assert_close(gw[name], ref_gw[name], rtol=1e-10, atol=1e-10)


def _rope(x, pos):
    """Rotary embedding of x [T, H, HD] at integer positions pos [T] (pairs of channels, base 10000)."""
    half = HD // 2
    inv = 1.0 / (10000 ** (torch.arange(half, dtype=torch.float64) / half))
    ang = pos.to(torch.float64)[:, None] * inv[None, :]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], -1)


class RopeModel(Model):
    """Model with positions: an absolute sinusoid added to the input and RoPE on queries and keys, so a token's
    output depends on its own position and on the relative positions of the keys it attends to."""

    def forward(self, x, attend, pos):
        x = x + 0.5 * torch.sin(pos.to(x.dtype)[:, None] * torch.linspace(0.05, 1.0, D, dtype=x.dtype))
        for i, layer in enumerate(self.layers):
            h = torch.tanh(x)
            T = h.shape[0]
            q = _rope(layer.q(h).view(T, HQ, HD), pos)
            k = _rope(layer.k(h).view(T, HKV, HD), pos)
            out = attend(q, k, layer.v(h).view(T, HKV, HD), i)
            x = x + layer.o(out.reshape(T, HQ * HD))
        return x


@pytest.mark.parametrize("recompute", [True, False])
def test_slices_with_collate_positions_match_whole_pieces_under_rope(recompute):
    """Document 0 (50 tokens) at context 30 is two independent pieces, [0, 30) and [30, 50), each sliced over
    micro-batches; the collate's positions (a piece from 0, its slices continuing it) with RoPE and an absolute
    position term give what each piece run whole from position 0 gives (the reference: dense attention, explicit
    positions 0..len-1 per piece). Slices restarting at 0, or a piece keeping the document's offset, would not."""
    import numpy as np

    from packloader.collate.collate import collate

    chain = [
        [Segment(0, 0, 12, 0), Segment(1, 0, 12, 0)],
        [Segment(0, 12, 30, 0), Segment(0, 30, 38, 30)],
        [Segment(2, 0, 30, 0), Segment(0, 38, 50, 30)],
    ]
    pieces = [(0, 0, 30), (0, 30, 50), (1, 0, 12), (2, 0, 30)]
    torch.manual_seed(0)
    model = RopeModel().double()
    xs = {d: torch.randn(n, D, dtype=torch.float64) for d, n in LENGTHS.items()}
    ws = {d: torch.randn(n, D, dtype=torch.float64) for d, n in LENGTHS.items()}
    toks = {d: np.zeros(n, np.int64) for d, n in LENGTHS.items()}

    x = torch.cat([xs[d][a:b] for d, a, b in pieces]).clone().requires_grad_()
    pos = torch.cat([torch.arange(b - a) for _, a, b in pieces])
    out = model(x, dense_whole([b - a for _, a, b in pieces]), pos)
    (out * torch.cat([ws[d][a:b] for d, a, b in pieces])).sum().backward()
    ref_out = {}
    o = 0
    for d, a, b in pieces:
        ref_out[(d, a)] = out.detach()[o : o + b - a]
        o += b - a
    ref_gw = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    outs = {d: torch.full((n, D), float("nan"), dtype=torch.float64) for d, n in LENGTHS.items()}

    def step_fn(segs, ctx):
        b = collate(segs, toks)
        h = torch.cat([xs[s.doc][s.start : s.end] for s in segs])
        y = model(h, ctx.attention, b.position_ids)
        o = 0
        for s in segs:
            outs[s.doc][s.start : s.end] = y.detach()[o : o + s.end - s.start]
            o += s.end - s.start
        return (y * torch.cat([ws[s.doc][s.start : s.end] for s in segs])).sum()

    SliceExecutor(recompute=recompute).run(chain, step_fn)
    for d, a, b in pieces:
        torch.testing.assert_close(outs[d][a:b], ref_out[(d, a)], rtol=1e-10, atol=1e-10)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_gw[n], rtol=1e-10, atol=1e-10)
