"""Layout remapping over gloo: exact round trips, forward equals indexing the global tensor, gradients equal the
single-process reference, with all_to_all, the all_gather fallback, and the automatic fallback."""

import pytest
import torch
from helpers.distributed import run_ranks

from packloader.contracts import Segment

pytestmark = pytest.mark.multiprocess  # every test here starts processes

CASES = {
    "mixed": [37, 1, 1, 200, 5, 64, 3, 90, 11],
    "one-long": [301],
    "single-tokens": [1, 1, 1, 1, 1],
}


def _global(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    x = torch.randn(T, 3, 2, generator=g, dtype=torch.float64)
    c = torch.randn(T, 3, 2, generator=g, dtype=torch.float64)
    w = torch.randn(T, 3, 2, generator=g, dtype=torch.float64)
    return x, c, w


def _reference_attention(h, runs_or_lengths):
    """Causal attention of each document (whole), h [n, d] in document order."""
    out, o = [], 0
    for n in runs_or_lengths:
        x = h[o : o + n]
        s = x @ x.T / x.shape[1] ** 0.5
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        out.append(torch.softmax(s, -1) @ x)
        o += n
    return torch.cat(out) if out else h[:0]


def _rank_remap(rank, world, lengths, method, fail_a2a):
    import packloader.runtime.remap as remap_mod
    from packloader.runtime.remap import Remapper, micro_batch_layouts

    remap_mod._A2A_SUPPORT.clear()
    if fail_a2a:
        def broken(*a, **k):
            raise RuntimeError("ProcessGroupGloo does not support alltoall")
        remap_mod._a2a = broken
    segs = [Segment(doc=i, start=0, end=n, attend_from=0) for i, n in enumerate(lengths)]
    lin, att = micro_batch_layouts(segs, world)
    x, c, w = _global(lengths, 1)
    li, ai = torch.as_tensor(lin.indices[rank]), torch.as_tensor(att.indices[rank])
    local = x[li].clone().requires_grad_()
    rm = Remapper(lin, att, method=method)
    a = rm.to_attention(local)
    forward_exact = torch.equal(a.detach(), x[ai])
    round_trip_exact = torch.equal(rm.to_linear(a).detach(), local.detach())
    y = rm.to_linear(torch.sin(a) * c[ai])
    (y.pow(2) * w[li]).sum().backward()
    fell_back = fail_a2a and remap_mod._A2A_SUPPORT.get("gloo") is False
    # numpy, not tensors: a tensor sent through the result queue is shared memory that dies with the process
    return forward_exact, round_trip_exact, local.grad.numpy(), li.numpy(), fell_back


def _rank_all_cases(rank, world, methods):
    return {(case, m): _rank_remap(rank, world, CASES[case], m, False) for case in sorted(CASES) for m in methods}


@pytest.mark.parametrize("world", [2, 3, 4])
def test_remap_forward_round_trip_and_gradients(world):
    methods = ["auto", "all_to_all", "all_gather"] if world == 3 else ["auto"]
    results = run_ranks(_rank_all_cases, world, methods)
    for case, lengths in CASES.items():
        x, c, w = _global(lengths, 1)
        xr = x.clone().requires_grad_()
        ((torch.sin(xr) * c).pow(2) * w).sum().backward()
        for m in methods:
            for per_rank in results:
                fwd_ok, rt_ok, grad, li, _ = per_rank[(case, m)]
                assert fwd_ok and rt_ok, (case, m)
                torch.testing.assert_close(torch.from_numpy(grad), xr.grad[li], rtol=1e-12, atol=1e-12)


def test_auto_falls_back_to_all_gather_when_all_to_all_is_missing():
    lengths = CASES["mixed"]
    x, c, w = _global(lengths, 1)
    xr = x.clone().requires_grad_()
    ((torch.sin(xr) * c).pow(2) * w).sum().backward()
    for fwd_ok, rt_ok, grad, li, fell_back in run_ranks(_rank_remap, 2, lengths, "auto", True):
        assert fwd_ok and rt_ok and fell_back
        torch.testing.assert_close(torch.from_numpy(grad), xr.grad[li], rtol=1e-12, atol=1e-12)


class _Pairs:
    def segment_times(self, q, p):
        f = q * p + q * (q + 1) / 2.0
        return f, 2.5 * f


def _inputs(lengths):
    g = torch.Generator().manual_seed(2)
    T = sum(lengths)
    return torch.randn(T, 8, generator=g, dtype=torch.float64), torch.randn(T, 8, generator=g, dtype=torch.float64)


def _attention_weights():
    g = torch.Generator().manual_seed(5)
    return {n: torch.randn(8, 8, generator=g, dtype=torch.float64) / 3 for n in "qkvo"}


def _layer(x, w, attend):
    """A small attention layer: q/k/v/o projections per token, attention over 2 heads (GQA: 1 kv head)."""
    n = x.shape[0]
    q = (x @ w["q"]).view(n, 2, 4)
    k = (x @ w["k"])[:, :4].reshape(n, 1, 4)
    v = (x @ w["v"])[:, :4].reshape(n, 1, 4)
    return attend(q, k, v).reshape(n, 8) @ w["o"]


def _rank_attention_in_attention_layout(rank, world, lengths):
    """Zeppelin's layer: projections in the linear layout, attention in the attention layout (short documents
    whole on one rank, the long one sharded and run as CP attention), output projection back in the linear one."""
    from packloader.runtime.cp_attention import cp_attention
    from packloader.runtime.remap import Remapper, micro_batch_layouts

    segs = [Segment(doc=i, start=0, end=n, attend_from=0) for i, n in enumerate(lengths)]
    lin, att = micro_batch_layouts(segs, world, cost_model=_Pairs())
    x, w = _inputs(lengths)
    weights = {n: t.clone().requires_grad_() for n, t in _attention_weights().items()}
    li = torch.as_tensor(lin.indices[rank])
    local = x[li].clone().requires_grad_()
    rm = Remapper(lin, att)

    def attend(q, k, v):
        out = cp_attention(rm.to_attention(q), rm.to_attention(k), rm.to_attention(v), att.shards[rank])
        return rm.to_linear(out)

    out = _layer(local, weights, attend)
    (out * w[li]).sum().backward()
    sharded = att.shards.sharded_segments.tolist()
    return out.detach().numpy(), local.grad.numpy(), li.numpy(), {n: t.grad.numpy() for n, t in weights.items()}, sharded


def _dense(q, k, v, lengths):
    out, o = [], 0
    for n in lengths:
        ks, vs = k[o : o + n].repeat_interleave(2, 1), v[o : o + n].repeat_interleave(2, 1)
        s = torch.einsum("qhd,khd->hqk", q[o : o + n], ks) / 2.0
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), vs))
        o += n
    return torch.cat(out)


def test_attention_in_the_attention_layout_matches_the_whole_batch():
    lengths = [200, 3, 17, 1, 60, 9, 22]
    x, w = _inputs(lengths)
    weights = {n: t.clone().requires_grad_() for n, t in _attention_weights().items()}
    xr = x.clone().requires_grad_()
    ref = _layer(xr, weights, lambda q, k, v: _dense(q, k, v, lengths))
    (ref * w).sum().backward()
    results = run_ranks(_rank_attention_in_attention_layout, 3, lengths)
    wgrad = {n: sum(torch.from_numpy(r[3][n]) for r in results) for n in weights}
    for out, grad, li, _, sharded in results:
        assert 0 in sharded and len(sharded) < len(lengths)  # the long one runs as CP attention, some stay whole
        torch.testing.assert_close(torch.from_numpy(out), ref.detach()[li])
        torch.testing.assert_close(torch.from_numpy(grad), xr.grad[li])
    for n, t in weights.items():
        torch.testing.assert_close(wgrad[n], t.grad)
