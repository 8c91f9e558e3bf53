"""One varlen attention function over packed documents, with three backends.

``varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=..., window=...,
softmax_scale=..., return_lse=..., backend=...)`` takes ``q [Tq, Hq, D]``, ``k/v [Tk, Hkv, D]`` (GQA:
``Hq % Hkv == 0``) and int32 ``cu_seqlens`` of S+1 entries; segment s is queries ``cu_q[s]:cu_q[s+1]`` against keys
``cu_k[s]:cu_k[s+1]``. Masks follow flash-attn exactly:

* causal is **bottom-right aligned**: query i of a segment with lq queries and lk keys sees keys
  ``j <= i + lk - lq`` (for lq == lk this is the usual lower triangle; a query block that continues earlier keys,
  e.g. a slice after its document's KV cache or a CP shard after the all-gathered prefix, gets the right mask);
* ``window = (left, right)``: query i sees keys ``i + lk - lq - left <= j <= i + lk - lq + right`` (-1 = unbounded);
  with causal, right is 0;
* a query row that sees no key at all (only possible with lk < lq) outputs zeros.

Backends, in order of preference for an automatic choice:

``flash``      ``flash_attn.flash_attn_varlen_func`` (the ``flash`` extra; CUDA, fp16/bf16), imported lazily.
``torch``      ``torch.nn.attention.varlen.varlen_attn`` (CUDA, fp16/bf16); its signature is detected with
               ``inspect`` (``is_causal=`` on torch 2.10, ``window_size=(-1, 0)`` for causal from 2.11).
``reference``  per-document attention in plain torch: any device, any float dtype, gradients (also of the lse),
               window, GQA. What CPU tests and CPU calibration use.

The automatic choice depends on the device and dtype (the CUDA kernels take only fp16/bf16) and is logged once
per (device type, dtype, backend). ``PACKLOADER_ATTN_BACKEND`` forces a backend like ``backend=``. A forced
backend that cannot run says what to install or change.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
import os
from typing import Any

import torch

log = logging.getLogger(__name__)

BACKENDS = ("flash", "torch", "reference")
ENV_BACKEND = "PACKLOADER_ATTN_BACKEND"
_HALF = (torch.float16, torch.bfloat16)

__all__ = [
    "BACKENDS",
    "BackendUnavailable",
    "available_backends",
    "select_backend",
    "varlen_attention",
    "reference_varlen_attention",
]


class BackendUnavailable(RuntimeError):
    """A forced attention backend that cannot run here (missing package, no CUDA, wrong dtype)."""


# --------------------------------------------------------------------------------------- backend discovery


@functools.lru_cache(maxsize=None)
def _flash_func():
    """flash_attn_varlen_func, or None when flash-attn is not installed (or fails to import)."""
    try:
        from flash_attn import flash_attn_varlen_func  # type: ignore[import-not-found]
    except Exception as e:  # noqa: BLE001 - an ImportError or a broken CUDA build alike mean "not available"
        log.debug("flash-attn not importable: %s", e)
        return None
    return flash_attn_varlen_func


@functools.lru_cache(maxsize=None)
def _torch_varlen():
    """(varlen_attn, AuxRequest or None, parameter names) or None when this torch has no varlen_attn."""
    try:
        from torch.nn.attention import varlen as _v
    except Exception as e:  # noqa: BLE001
        log.debug("torch.nn.attention.varlen not importable: %s", e)
        return None
    fn = getattr(_v, "varlen_attn", None)
    if fn is None:
        return None
    try:
        params = frozenset(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        params = frozenset()
    return fn, getattr(_v, "AuxRequest", None), params


def _installed(name: str) -> bool:
    if name == "flash":
        return _flash_func() is not None
    if name == "torch":
        return _torch_varlen() is not None
    return name == "reference"


def available_backends() -> list[str]:
    """The backends that can run on some device of this machine, in preference order ("reference" always)."""
    cuda = torch.cuda.is_available()
    return [b for b in BACKENDS if b == "reference" or (cuda and _installed(b))]


def _why_not(name: str, device: torch.device, dtype: torch.dtype | None) -> str | None:
    """None if backend `name` can run on `device` with `dtype`, else the reason (with what to do about it)."""
    if name not in BACKENDS:
        return f"unknown attention backend {name!r}; expected one of {', '.join(BACKENDS)}"
    if name == "reference":
        return None
    if not _installed(name):
        if name == "flash":
            return ("attention backend 'flash' needs flash-attn, which is not importable here: install it with "
                    "`pip install 'packloader[flash]'` (or `pip install flash-attn --no-build-isolation`) on a CUDA machine")
        return (f"attention backend 'torch' needs torch.nn.attention.varlen.varlen_attn (PyTorch >= 2.10); this is "
                f"torch {torch.__version__}: upgrade torch or use backend='flash' / 'reference'")
    if device.type != "cuda":
        return f"attention backend {name!r} runs on CUDA only, got tensors on {device}; use backend='reference' on CPU"
    if dtype is not None and dtype not in _HALF:
        return f"attention backend {name!r} takes float16/bfloat16 only, got {dtype}; cast q/k/v or use backend='reference'"
    return None


_logged: set[tuple[str, str, str]] = set()


def select_backend(device: torch.device | str, forced: str | None = None, dtype: torch.dtype | None = None) -> str:
    """The backend varlen_attention uses for tensors on `device` (and of `dtype`, when given).

    `forced` (or the ``PACKLOADER_ATTN_BACKEND`` environment variable when `forced` is None) names a backend; if it
    cannot run here a BackendUnavailable says why and what to install. Otherwise the first of flash, torch,
    reference that can run. The choice is logged once per (device type, dtype, backend).
    """
    device = torch.device(device)
    from_env = forced is None and bool(os.environ.get(ENV_BACKEND))
    forced = forced if forced is not None else (os.environ.get(ENV_BACKEND) or None)
    if forced is not None:
        forced = forced.strip().lower()
        reason = _why_not(forced, device, dtype)
        if reason is not None:
            raise BackendUnavailable(f"{ENV_BACKEND}={os.environ[ENV_BACKEND]!r}: {reason}" if from_env else reason)
        choice = forced
    else:
        choice = next(b for b in BACKENDS if _why_not(b, device, dtype) is None)
    key = (device.type, str(dtype), choice)
    if key not in _logged:
        _logged.add(key)
        log.info("packloader varlen attention: backend %r for %s tensors%s%s", choice, device.type,
                 f" of {dtype}" if dtype is not None else "", " (forced)" if forced else "")
    return choice


# --------------------------------------------------------------------------------------- the dispatcher


def _check_inputs(q, k, v, cu_q, cu_k, window) -> None:
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"q, k, v must be [tokens, heads, head_dim]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape[:2] != v.shape[:2]:
        raise ValueError(f"k and v must have the same tokens and heads; got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"q and k head_dim differ: {q.shape[2]} vs {k.shape[2]}")
    hq, hkv = q.shape[1], k.shape[1]
    if hkv == 0 or hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    for name, cu in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        if cu.dim() != 1 or cu.dtype != torch.int32:
            raise ValueError(f"{name} must be a 1-D int32 tensor, got {cu.dtype} {tuple(cu.shape)}")
    if cu_q.shape != cu_k.shape:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have the same length, got {cu_q.numel()} and {cu_k.numel()}")
    if len(window) != 2:
        raise ValueError(f"window must be (left, right), got {window!r}")


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool = True,
    window: tuple[int, int] = (-1, -1),
    softmax_scale: float | None = None,
    return_lse: bool = False,
    backend: str | None = None,
):
    """Attention of packed segments; see the module docstring for the exact mask.

    Returns ``out [Tq, Hq, D]`` (dtype of q), and ``lse [Hq, Tq]`` float32 (the natural-log sum of exp of the scaled
    scores of each query row) when `return_lse`. `max_seqlen_q/k` are Python ints (never tensors: no device sync).
    """
    window = (int(window[0]), int(window[1])) if window is not None else (-1, -1)
    _check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, window)
    max_seqlen_q, max_seqlen_k = int(max_seqlen_q), int(max_seqlen_k)
    if causal:
        window = (window[0], 0)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    name = select_backend(q.device, backend, q.dtype)
    if name == "flash":
        return _flash(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window, softmax_scale, return_lse)
    if name == "torch":
        return _torch(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window, softmax_scale, return_lse)
    return reference_varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=causal, window=window,
                                      softmax_scale=softmax_scale, return_lse=return_lse)


# --------------------------------------------------------------------------------------- CUDA backends


def _flash(q, k, v, cu_q, cu_k, max_q, max_k, causal, window, scale, return_lse):
    fn = _flash_func()
    res = fn(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, softmax_scale=scale, causal=causal,
             window_size=window, return_attn_probs=return_lse)
    if not return_lse:
        return res
    out, lse = res[0], res[1]
    if lse.dim() == 3:  # flash-attn < 2.4 returned a padded [S, H, max_seqlen_q] lse for varlen
        lse = _unpad_lse(lse, cu_q)
    return out, lse.float()


def _unpad_lse(lse: torch.Tensor, cu_q: torch.Tensor) -> torch.Tensor:
    cu = cu_q.tolist()
    parts = [lse[s, :, : cu[s + 1] - cu[s]] for s in range(len(cu) - 1)]
    return torch.cat(parts, dim=1) if parts else lse.new_empty(lse.shape[1], 0)


def _torch(q, k, v, cu_q, cu_k, max_q, max_k, causal, window, scale, return_lse):
    fn, aux_cls, params = _torch_varlen()
    kwargs: dict[str, Any] = {}
    gqa = q.shape[1] != k.shape[1]
    if gqa and "enable_gqa" in params:
        kwargs["enable_gqa"] = True
    elif gqa:  # an older varlen_attn without GQA: repeat the key/value heads (autograd sums them back)
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    if "scale" in params:
        kwargs["scale"] = scale
    elif abs(scale - 1.0 / math.sqrt(q.shape[-1])) > 1e-12:
        q = q * (scale * math.sqrt(q.shape[-1]))  # the kernel applies 1/sqrt(D)
    if "window_size" in params:
        # torch >= 2.11: causal is window_size=(-1, 0). Its is_causal path may go to cuDNN, whose causal mask is
        # top-left aligned on some versions; a left bound >= every key length is the same bottom-right causal
        # mask on the flash path and keeps cuDNN out of it, so use that unless q and k share cu_seqlens (then
        # top-left and bottom-right agree). It costs nothing: ATen's mha_varlen_fwd/bwd turn a left window of at
        # least max_seqlen_k into -1, so the flash path runs its plain causal kernel.
        if causal and window[0] < 0 and cu_q is not cu_k:
            window = (max(max_k, 1), 0)
        kwargs["window_size"] = tuple(window)
    else:
        if window[0] >= 0 or (not causal and window[1] >= 0):
            raise BackendUnavailable(f"this torch's varlen_attn ({torch.__version__}) has no sliding window; "
                                     "use backend='flash' or 'reference', or upgrade torch")
        if "is_causal" in params:
            kwargs["is_causal"] = causal
        elif causal:
            raise BackendUnavailable("this torch's varlen_attn takes neither window_size nor is_causal; use another backend")
    if return_lse:
        if aux_cls is None or "return_aux" not in params:
            raise BackendUnavailable(f"this torch's varlen_attn ({torch.__version__}) cannot return the lse; "
                                     "use backend='flash' or 'reference'")
        kwargs["return_aux"] = aux_cls(lse=True)
        out, lse = fn(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)
        return out, lse.float()
    return fn(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)


# --------------------------------------------------------------------------------------- reference


def _segment_attention(qs, ks, vs, causal, window, scale, compute_dtype):
    """One segment: qs [lq, Hq, D], ks/vs [lk, Hkv, D] -> out [lq, Hq, D] (compute dtype), lse [Hq, lq]."""
    lq, hq, d = qs.shape
    lk, hkv, _ = ks.shape
    g = hq // hkv
    qg = qs.to(compute_dtype).reshape(lq, hkv, g, d)
    s = torch.einsum("qhgd,khd->hgqk", qg, ks.to(compute_dtype)) * scale  # [Hkv, g, lq, lk]
    left, right = window
    if causal or left >= 0 or right >= 0:
        i = torch.arange(lq, device=qs.device).unsqueeze(1) + (lk - lq)
        j = torch.arange(lk, device=qs.device).unsqueeze(0)
        allowed = torch.ones(lq, lk, dtype=torch.bool, device=qs.device)
        if causal or right >= 0:
            allowed &= j <= i + (0 if causal else right)
        if left >= 0:
            allowed &= j >= i - left
        s = s.masked_fill(~allowed, float("-inf"))
    # A detached row max keeps every path finite (also rows that see no key) and gives exact gradients.
    m = s.detach().amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s - m)
    denom = e.sum(dim=-1, keepdim=True)
    seen = denom > 0
    denom_safe = torch.where(seen, denom, torch.ones_like(denom))
    out = torch.einsum("hgqk,khd->qhgd", e / denom_safe, vs.to(compute_dtype)).reshape(lq, hq, d)
    lse = torch.where(seen, m + torch.log(denom_safe), torch.full_like(denom, float("-inf")))
    return out, lse.reshape(hq, lq)


def reference_varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    *,
    causal: bool = True,
    window: tuple[int, int] = (-1, -1),
    softmax_scale: float | None = None,
    return_lse: bool = False,
):
    """The plain-torch backend (any device, differentiable). Scores are computed in float32 for half inputs and
    in the input dtype otherwise (float64 stays float64, for gradcheck, and so does its lse). Empty query rows get
    out 0 and lse -inf; the lse is differentiable here (the CUDA kernels' is not)."""
    window = (int(window[0]), int(window[1]))
    if causal:
        window = (window[0], 0)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    compute = torch.float32 if q.dtype in _HALF or q.dtype == torch.float32 else q.dtype
    cq = cu_seqlens_q.tolist()
    ck = cu_seqlens_k.tolist()
    nseg = len(cq) - 1
    outs, lses = [], []
    covered = cq[-1] if cq else 0
    if covered != q.shape[0] or (ck and ck[-1] > k.shape[0]):
        raise ValueError(f"cu_seqlens_q ends at {covered} for {q.shape[0]} query tokens; cu_seqlens_k ends at "
                         f"{ck[-1] if ck else 0} for {k.shape[0]} key tokens")
    for s in range(nseg):
        q0, q1, k0, k1 = cq[s], cq[s + 1], ck[s], ck[s + 1]
        if q1 < q0 or k1 < k0:
            raise ValueError(f"cu_seqlens must be non-decreasing (segment {s}: q {q0}..{q1}, k {k0}..{k1})")
        if q1 == q0:
            continue
        if k1 == k0:  # no keys at all: zeros, lse -inf
            outs.append(q.new_zeros(q1 - q0, q.shape[1], v.shape[2], dtype=compute))
            lses.append(torch.full((q.shape[1], q1 - q0), float("-inf"), dtype=compute, device=q.device))
            continue
        o, l = _segment_attention(q[q0:q1], k[k0:k1], v[k0:k1], causal, window, softmax_scale, compute)
        outs.append(o)
        lses.append(l)
    if outs:
        out = torch.cat(outs, dim=0).to(q.dtype)
        lse = torch.cat(lses, dim=1)
        lse = lse if q.dtype == torch.float64 else lse.float()
    else:
        out = q.new_zeros(0, q.shape[1], v.shape[2])
        lse = torch.zeros(q.shape[1], 0, dtype=torch.float32, device=q.device)
    if return_lse:
        return out, lse
    return out
