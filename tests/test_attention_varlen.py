"""varlen_attention: the CPU reference against an independent dense masked attention (mask built by brute force
from cu_seqlens and the bottom-right causal / window rules), gradients (gradcheck in float64), GQA, lse; backend
selection and errors; the CUDA backends' argument mapping checked through stand-in kernels on CPU."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from packloader.runtime import attention as A
from packloader.runtime.attention import BackendUnavailable, available_backends, select_backend, varlen_attention


def cu(lengths) -> torch.Tensor:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32)


def dense_mask(lq, lk, causal, window) -> torch.Tensor:
    """[Tq, Tk] bool: query t of segment s may see key u of segment s. Brute force, one pair at a time."""
    tq, tk = sum(lq), sum(lk)
    m = torch.zeros(tq, tk, dtype=torch.bool)
    left, right = window
    if causal:
        right = 0
    q0 = k0 = 0
    for a, b in zip(lq, lk):
        for i in range(a):
            for j in range(b):
                d = j - (i + b - a)  # key position relative to the query's bottom-right aligned diagonal
                ok = True
                if right >= 0 and d > right:
                    ok = False
                if left >= 0 and d < -left:
                    ok = False
                m[q0 + i, k0 + j] = ok
        q0 += a
        k0 += b
    return m


def dense_attention(q, k, v, mask, scale):
    """Plain softmax attention over the whole packed batch with a [Tq, Tk] mask; rows with no key give 0 / -inf."""
    g = q.shape[1] // k.shape[1]
    kk = k.repeat_interleave(g, dim=1)
    vv = v.repeat_interleave(g, dim=1)
    s = torch.einsum("qhd,khd->hqk", q, kk) * scale
    s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [H, Tq]
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return torch.einsum("hqk,khd->qhd", p, vv), lse


CASES = [
    # (query lengths, key lengths, Hq, Hkv, causal, window)
    ([5, 1, 7], [5, 1, 7], 4, 4, True, (-1, -1)),
    ([5, 1, 7], [5, 1, 7], 4, 2, True, (-1, -1)),
    ([5, 1, 7], [5, 1, 7], 4, 1, False, (-1, -1)),
    ([6, 3], [6, 3], 2, 2, True, (2, -1)),
    ([6, 3], [6, 3], 2, 1, False, (2, 1)),
    ([3, 2, 4], [8, 2, 9], 4, 2, True, (-1, -1)),  # queries continue a longer key prefix (slices, CP shards)
    ([3, 4], [8, 9], 2, 2, True, (3, -1)),
    ([4, 2], [2, 2], 2, 1, True, (-1, -1)),  # fewer keys than queries: the first rows see nothing
    ([1, 1, 1], [1, 1, 1], 2, 2, True, (-1, -1)),
]


@pytest.mark.parametrize("lq,lk,hq,hkv,causal,window", CASES)
def test_reference_matches_dense(lq, lk, hq, hkv, causal, window):
    torch.manual_seed(0)
    d = 8
    q = torch.randn(sum(lq), hq, d, dtype=torch.float64)
    k = torch.randn(sum(lk), hkv, d, dtype=torch.float64)
    v = torch.randn(sum(lk), hkv, d, dtype=torch.float64)
    scale = 0.3
    out, lse = varlen_attention(q, k, v, cu(lq), cu(lk), max(lq), max(lk), causal=causal, window=window,
                                softmax_scale=scale, return_lse=True, backend="reference")
    ref, ref_lse = dense_attention(q, k, v, dense_mask(lq, lk, causal, window), scale)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("lq,lk,hq,hkv,causal,window", CASES)
def test_reference_gradients_match_dense(lq, lk, hq, hkv, causal, window):
    torch.manual_seed(1)
    d = 4
    q = torch.randn(sum(lq), hq, d, dtype=torch.float64, requires_grad=True)
    k = torch.randn(sum(lk), hkv, d, dtype=torch.float64, requires_grad=True)
    v = torch.randn(sum(lk), hkv, d, dtype=torch.float64, requires_grad=True)
    g = torch.randn(sum(lq), hq, d, dtype=torch.float64)
    out = varlen_attention(q, k, v, cu(lq), cu(lk), max(lq), max(lk), causal=causal, window=window, backend="reference")
    got = torch.autograd.grad((out * g).sum(), (q, k, v))
    ref, _ = dense_attention(q, k, v, dense_mask(lq, lk, causal, window), 1 / math.sqrt(d))
    want = torch.autograd.grad((ref * g).sum(), (q, k, v))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("causal,window,hkv,lq,lk", [
    (True, (-1, -1), 2, [3, 1, 2], [3, 1, 2]),
    (True, (1, -1), 1, [3, 2], [3, 2]),
    (False, (-1, -1), 2, [2, 3], [2, 3]),
    (True, (-1, -1), 1, [2, 2], [4, 3]),
])
def test_gradcheck_float64(causal, window, hkv, lq, lk):
    torch.manual_seed(2)
    q = torch.randn(sum(lq), 2, 3, dtype=torch.float64, requires_grad=True)
    k = torch.randn(sum(lk), hkv, 3, dtype=torch.float64, requires_grad=True)
    v = torch.randn(sum(lk), hkv, 3, dtype=torch.float64, requires_grad=True)

    def f(q, k, v):
        out, lse = varlen_attention(q, k, v, cu(lq), cu(lk), max(lq), max(lk), causal=causal, window=window,
                                    return_lse=True, backend="reference")
        return out, lse

    assert torch.autograd.gradcheck(f, (q, k, v), eps=1e-6, atol=1e-7)


def test_empty_rows_are_zero_and_gradients_finite():
    q = torch.randn(4, 1, 2, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 1, 2, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 1, 2, dtype=torch.float64, requires_grad=True)
    out, lse = varlen_attention(q, k, v, cu([4]), cu([2]), 4, 2, return_lse=True, backend="reference")
    assert torch.all(out[:2] == 0) and torch.all(torch.isneginf(lse[:, :2]))
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_half_inputs_compute_in_float32():
    torch.manual_seed(3)
    q = torch.randn(9, 2, 8)
    k = torch.randn(9, 2, 8)
    v = torch.randn(9, 2, 8)
    c = cu([4, 5])
    ref = varlen_attention(q, k, v, c, c, 5, 5, backend="reference")
    half = varlen_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), c, c, 5, 5, backend="reference")
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.float(), ref, rtol=3e-2, atol=3e-2)


def test_bad_inputs_are_clear_errors():
    q = torch.randn(4, 3, 8)
    k = torch.randn(4, 2, 8)
    c = cu([4])
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        varlen_attention(q, k, k, c, c, 4, 4)
    with pytest.raises(ValueError, match="int32"):
        varlen_attention(q, q, q, c.long(), c, 4, 4)
    with pytest.raises(ValueError, match="tokens, heads, head_dim"):
        varlen_attention(q[0], q, q, c, c, 4, 4)
    with pytest.raises(ValueError, match="cu_seqlens_q ends at"):
        varlen_attention(q, q, q, cu([3]), cu([3]), 3, 3, backend="reference")


# ----------------------------------------------------------------------------------------------- selection


def test_cpu_selects_reference_and_logs_once(caplog, monkeypatch):
    monkeypatch.delenv(A.ENV_BACKEND, raising=False)
    monkeypatch.setattr(A, "_logged", set())
    assert "reference" in available_backends()
    with caplog.at_level(logging.INFO, logger="packloader.runtime.attention"):
        for _ in range(3):
            assert select_backend("cpu", dtype=torch.float32) == "reference"
            assert select_backend(torch.device("cpu")) == "reference"
    msgs = [r.getMessage() for r in caplog.records if "backend" in r.getMessage()]
    assert len(msgs) == 2  # once per (device, dtype, backend)
    assert not any("print" in m for m in msgs)


def test_forced_missing_backend_says_what_to_install(monkeypatch):
    monkeypatch.delenv(A.ENV_BACKEND, raising=False)
    monkeypatch.setattr(A, "_flash_func", lambda: None)
    with pytest.raises(BackendUnavailable, match=r"pip install 'packloader\[flash\]'"):
        select_backend("cuda", "flash")
    if A._torch_varlen() is not None:
        with pytest.raises(BackendUnavailable, match="CUDA only"):
            select_backend("cpu", "torch")
    with pytest.raises(BackendUnavailable, match="unknown attention backend 'tpu'"):
        select_backend("cpu", "tpu")
    q = torch.randn(3, 1, 4)
    c = cu([3])
    with pytest.raises(BackendUnavailable):
        varlen_attention(q, q, q, c, c, 3, 3, backend="flash")


def test_env_var_forces_backend(monkeypatch):
    monkeypatch.setenv(A.ENV_BACKEND, "flash")
    monkeypatch.setattr(A, "_flash_func", lambda: None)
    with pytest.raises(BackendUnavailable, match="flash-attn"):
        select_backend("cpu")
    monkeypatch.setenv(A.ENV_BACKEND, "reference")
    assert select_backend("cpu") == "reference"


def test_cuda_backends_refuse_float32(monkeypatch):
    monkeypatch.setattr(A, "_flash_func", lambda: object())
    with pytest.raises(BackendUnavailable, match="float16/bfloat16"):
        select_backend("cuda", "flash", torch.float32)
    # Automatic choice on CUDA with float32 falls through to the reference instead.
    assert select_backend("cuda", None, torch.float32) == "reference"
    assert select_backend("cuda", None, torch.bfloat16) == "flash"


# ------------------------------------------------------------- CUDA backends' argument mapping, on CPU stand-ins


def _ref(q, k, v, cq, ck, causal, window, scale, lse=False):
    return A.reference_varlen_attention(q, k, v, cq, ck, causal=causal, window=window, softmax_scale=scale, return_lse=lse)


def fake_flash(q, k, v, cq, ck, mq, mk, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
               return_attn_probs=False, **_):
    assert dropout_p == 0.0 and q.shape[1] % k.shape[1] == 0
    out, lse = _ref(q, k, v, cq, ck, causal, window_size, softmax_scale, lse=True)
    return (out, lse, None) if return_attn_probs else out


def fake_varlen_new(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                    window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
    """torch >= 2.11 semantics: causal is window_size == (-1, 0); other windows are flash (bottom-right) windows."""
    if query.shape[1] != key.shape[1]:
        assert enable_gqa
    causal = tuple(window_size) == (-1, 0)
    win = (-1, -1) if causal else tuple(window_size)
    out, lse = _ref(query, key, value, cu_seq_q, cu_seq_k, causal, win, scale, lse=True)
    return (out, lse) if return_aux is not None and return_aux.lse else out


def fake_varlen_old(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False):
    """torch 2.10 semantics: is_causal, no scale (1/sqrt(D)), no GQA, no lse."""
    assert query.shape[1] == key.shape[1]
    return _ref(query, key, value, cu_seq_q, cu_seq_k, is_causal, (-1, -1), None)


class _Aux:
    def __init__(self, lse=False):
        self.lse = lse


def _inputs(hkv=2, lq=(4, 3), lk=(6, 3)):
    torch.manual_seed(4)
    q = torch.randn(sum(lq), 4, 8, dtype=torch.float64)
    k = torch.randn(sum(lk), hkv, 8, dtype=torch.float64)
    v = torch.randn(sum(lk), hkv, 8, dtype=torch.float64)
    return q, k, v, cu(lq), cu(lk), max(lq), max(lk)


@pytest.mark.parametrize("causal,window", [(True, (-1, -1)), (True, (2, -1)), (False, (-1, -1)), (False, (1, 2))])
def test_flash_mapping(causal, window):
    q, k, v, cq, ck, mq, mk = _inputs()
    import unittest.mock as um

    with um.patch.object(A, "_flash_func", lambda: fake_flash):
        out, lse = A._flash(q, k, v, cq, ck, mq, mk, causal, (window[0], 0) if causal else window, 0.2, True)
    want, want_lse = _ref(q, k, v, cq, ck, causal, window, 0.2, lse=True)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(lse, want_lse.float())


@pytest.mark.parametrize("causal,window", [(True, (-1, -1)), (True, (2, -1)), (False, (-1, -1)), (False, (1, 2))])
@pytest.mark.parametrize("hkv", [4, 2])
def test_torch_mapping_new_signature(causal, window, hkv, monkeypatch):
    import inspect

    params = frozenset(inspect.signature(fake_varlen_new).parameters)
    monkeypatch.setattr(A, "_torch_varlen", lambda: (fake_varlen_new, _Aux, params))
    q, k, v, cq, ck, mq, mk = _inputs(hkv)
    out, lse = A._torch(q, k, v, cq, ck, mq, mk, causal, (window[0], 0) if causal else window, 0.2, True)
    want, want_lse = _ref(q, k, v, cq, ck, causal, window, 0.2, lse=True)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(lse, want_lse.float())


@pytest.mark.parametrize("causal", [True, False])
def test_torch_mapping_old_signature(causal, monkeypatch):
    import inspect

    params = frozenset(inspect.signature(fake_varlen_old).parameters)
    monkeypatch.setattr(A, "_torch_varlen", lambda: (fake_varlen_old, None, params))
    lens = (4, 3)
    q, k, v, cq, ck, mq, mk = _inputs(2, lens, lens)
    out = A._torch(q, k, v, cq, ck, mq, mk, causal, (-1, 0) if causal else (-1, -1), 0.2, False)
    torch.testing.assert_close(out, _ref(q, k, v, cq, ck, causal, (-1, -1), 0.2))
    with pytest.raises(BackendUnavailable, match="cannot return the lse"):
        A._torch(q, k, v, cq, ck, mq, mk, causal, (-1, 0) if causal else (-1, -1), 0.2, True)
    with pytest.raises(BackendUnavailable, match="sliding window"):
        A._torch(q, k, v, cq, ck, mq, mk, True, (2, 0), 0.2, False)
