"""Part 6, the runtime on the device against the CPU reference (float64, the reference attention backend):

* context-parallel attention (`cp_attention`, every sharding mode) and the layout remapping (`Remapper`: round
  trip and forward) with CP ranks emulated as processes on one GPU over gloo (the collectives' transport copied
  through the CPU, since gloo's collectives take CPU tensors; see `_stage_through_cpu`);
* the slice executor: documents run as chains of slices over micro-batches, outputs and gradients against the
  same documents run whole;
* the dispatcher's overhead: `varlen_attention` against calling the kernel it picks directly (target < 2 %);
* the pipeline schedule (`PlanPipelineSchedule` on a sliced plan; PP 2 with 1F1B, interleaved, ZB-H1 and ZB-V,
  then PP 4 with 1F1B and ZB-H1 while the budget lasts) with its stage processes on one GPU over gloo, the
  point-to-point transport copied through the CPU: loss and gradients against a float64 CPU reference
  (part_runtime_pipeline.py).

Errors are relative to the reference's largest magnitude; bf16 on a GPU gives about 1e-2, float32 on CPU 1e-6."""

from __future__ import annotations

import sys
from pathlib import Path

import part_runtime_pipeline
import torch
from gpu_common import Budget, Ctx, cu_seqlens, time_fwd_bwd

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from helpers.distributed import run_ranks  # noqa: E402

from packloader.contracts import Segment  # noqa: E402
from packloader.runtime.attention import reference_varlen_attention, select_backend, varlen_attention  # noqa: E402

MODES = ("sequence", "document", "hierarchical", "adaptive")


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.double().cpu() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)) if ref.numel() else 0.0


def _qkvw(lengths, hq, hkv, d, seed):
    g = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    return [torch.randn(T, h, d, generator=g, dtype=torch.float64) for h in (hq, hkv, hkv, hq)]


def _ref(lengths, q, k, v, w, dev: torch.device):
    """The float64 reference, computed on `dev` (a 16K-token pack in float64 takes minutes on one CPU thread) and
    returned on the CPU."""
    q, k, v = (t.to(dev, copy=True).requires_grad_() for t in (q, k, v))
    cu = cu_seqlens(lengths, dev)
    out = reference_varlen_attention(q, k, v, cu, cu, causal=True)
    (out * w.to(dev)).sum().backward()
    return tuple(t.cpu() for t in (out.detach(), q.grad, k.grad, v.grad))


def _stage_through_cpu() -> None:
    """Ranks emulated on one GPU talk over gloo, whose collectives take CPU tensors (all_reduce and broadcast
    aside): the transports of cp_attention (all-gather, reduce-scatter) and of the remapping copy through the
    CPU; everything else (the shards' key selection, the kernels, autograd) runs on the GPU."""
    import packloader.runtime.cp_attention as cpa
    import packloader.runtime.remap as remap

    ag, rs, ex = cpa._all_gather, cpa._reduce_scatter, remap._exchange

    def all_gather(out, inp, group):
        o = out.cpu()
        ag(o, inp.cpu(), group)
        out.copy_(o)

    cpa._all_gather = all_gather
    cpa._reduce_scatter = lambda grad, rows, group: rs(grad.cpu(), rows, group).to(grad.device)
    remap._exchange = lambda x, plan, group, method: ex(x.cpu(), plan, group, method).to(x.device)


def _cp_rank(rank, world, device, dtype, backend, packs):
    """On one CP rank: cp_attention and remapped attention of each pack against the whole-pack reference."""
    from packloader.collate.cp_sequence_shards import plan_cp_shards
    from packloader.runtime.cp_attention import cp_attention
    from packloader.runtime.cp_cost import cp_cost
    from packloader.runtime.remap import Remapper, micro_batch_layouts

    dev, dt = torch.device(device), getattr(torch, dtype)
    _stage_through_cpu()  # on CPU (the dry run) the copies are no-ops, and the wrappers still run
    errs = {}
    for pi, lengths in enumerate(packs):
        q, k, v, w = _qkvw(lengths, 8, 2, 64 if dev.type == "cuda" else 8, seed=pi)
        ref = _ref(lengths, q, k, v, w, dev)
        for mode in MODES:
            shard = plan_cp_shards(lengths, world, mode, cost=cp_cost()).ranks[rank]
            idx = torch.from_numpy(shard.token_index)
            loc = [t[idx].to(dev, dt).requires_grad_() for t in (q, k, v)]
            out = cp_attention(*loc, shard, None, backend=backend)
            (out * w[idx].to(dev, dt)).sum().backward()
            errs[f"cp/{mode}/pack{pi}"] = max(_rel(out.detach(), ref[0][idx]),
                                             *(_rel(t.grad, r[idx]) for t, r in zip(loc, ref[1:])))
        segs = [Segment(i, 0, n, 0) for i, n in enumerate(lengths)]
        lin, att = micro_batch_layouts(segs, world)
        li, ai = torch.as_tensor(lin.indices[rank]), torch.as_tensor(att.indices[rank])
        rm = Remapper(lin, att)
        x = q[li].to(dev, dt)
        back = rm.to_linear(rm.to_attention(x))
        errs[f"remap/round-trip/pack{pi}"] = _rel(back, q[li]) if back.numel() else 0.0
        errs[f"remap/forward/pack{pi}"] = _rel(rm.to_attention(x), q[ai]) if len(ai) else 0.0
    return errs


def _slice_check(ctx: Ctx) -> dict:
    """Whole documents against the same documents as slice chains through SliceExecutor (two attention layers)."""
    from packloader.runtime.slices import SliceExecutor

    d = 8 if ctx.dry_run else 128
    lengths = {0: 50, 1: 12, 2: 30} if ctx.dry_run else {0: 5000, 1: 700, 2: 3000}
    a, b = lengths[0] * 2 // 5, lengths[0] * 7 // 10
    chain = [[Segment(0, 0, a, 0), Segment(1, 0, lengths[1], 0)], [Segment(2, 0, lengths[2] // 2, 0), Segment(0, a, b, 0)],
             [Segment(0, b, lengths[0], 0), Segment(2, lengths[2] // 2, lengths[2], 0)]]
    g = torch.Generator().manual_seed(0)
    W = [torch.randn(d, 3 * d, generator=g, dtype=torch.float64) / d ** 0.5 for _ in range(2)]
    xs = {i: torch.randn(n, d, generator=g, dtype=torch.float64) for i, n in lengths.items()}

    def model(x, attend, ws):
        for li, wt in enumerate(ws):
            q, k, v = (t.contiguous() for t in (torch.tanh(x) @ wt).view(x.shape[0], 3, 4, d // 4).unbind(1))
            x = x + attend(q, k, v, li).reshape(x.shape[0], d)
        return x

    docs = sorted(lengths)
    ws_ref = [w.clone().requires_grad_() for w in W]
    cu = cu_seqlens([lengths[i] for i in docs], torch.device("cpu"))
    ref = model(torch.cat([xs[i] for i in docs]), lambda q, k, v, _: reference_varlen_attention(q, k, v, cu, cu), ws_ref)
    ref.pow(2).sum().backward()
    ws = [w.to(ctx.device, ctx.dtype).requires_grad_() for w in W]

    def step_fn(segs, sctx):
        x = torch.cat([xs[s.doc][s.start:s.end] for s in segs]).to(ctx.device, ctx.dtype)
        return model(x, sctx.attention, ws).float().pow(2).sum()

    losses = SliceExecutor(backend=ctx.backend).run(chain, step_fn)
    return {"loss_rel_err": abs(float(sum(losses).detach()) - float(ref.detach().pow(2).sum())) / float(ref.detach().pow(2).sum()),
            "grad_rel_err": max(_rel(w.grad, r.grad) for w, r in zip(ws, ws_ref))}


def _direct(backend: str):
    """The kernel the dispatcher calls for `backend`, called the way the dispatcher calls it (causal, shared
    cu_seqlens)."""
    if backend == "flash":
        from flash_attn import flash_attn_varlen_func  # type: ignore[import-not-found]
        return lambda q, k, v, cu, m: flash_attn_varlen_func(q, k, v, cu, cu, m, m, causal=True)
    if backend == "torch":
        import inspect

        from torch.nn.attention.varlen import varlen_attn
        kw = {"window_size": (-1, 0)} if "window_size" in inspect.signature(varlen_attn).parameters else {"is_causal": True}
        return lambda q, k, v, cu, m: varlen_attn(q, k, v, cu, cu, m, m, **kw)
    return lambda q, k, v, cu, m: reference_varlen_attention(q, k, v, cu, cu, causal=True)


def _overhead(ctx: Ctx) -> list[dict]:
    backend = select_backend(ctx.device, ctx.backend, ctx.dtype)
    direct = _direct(backend)
    shape = ctx.main_shape()
    cases = [[8] * 8, [32]] if ctx.dry_run else [[1024] * 16, [8192] * 4, [32768], [256] * 128]
    rows = []
    g = torch.Generator(device=ctx.device).manual_seed(0)
    for lengths in cases:
        T, m = sum(lengths), max(lengths)
        cu = cu_seqlens(lengths, ctx.device)
        q, k, v = (ctx.randn(T, h, shape.head_dim, gen=g, grad=True) for h in (shape.heads, shape.kv_heads, shape.kv_heads))
        gy = ctx.randn(T, shape.heads, shape.head_dim, gen=g)

        def runner(fn):
            def run():
                for t in (q, k, v):
                    t.grad = None
                return [fn()], [gy]
            return run

        disp = runner(lambda: varlen_attention(q, k, v, cu, cu, m, m, causal=True, backend=backend))
        dire = runner(lambda: direct(q, k, v, cu, m))
        reps = ctx.repeats * 4
        t_d, t_k = [], []
        for _ in range(3):  # alternate, so drift hits both alike
            t_d.append(sum(time_fwd_bwd(ctx, disp, repeats=reps)))
            t_k.append(sum(time_fwd_bwd(ctx, dire, repeats=reps)))
        td, tk = sorted(t_d)[1], sorted(t_k)[1]
        rows.append({"docs": len(lengths), "doc_len": m, "backend": backend, "dispatcher_ms": td * 1e3,
                     "direct_ms": tk * 1e3, "overhead_pct": (td / tk - 1) * 100})
    return rows


def run(ctx: Ctx, budget: Budget, out_dir) -> dict:
    res = {"overhead": _overhead(ctx)}
    budget.check("dispatcher overhead")
    res["slice_executor"] = _slice_check(ctx)
    budget.check("slice executor")
    world = 2 if ctx.dry_run else 4
    packs = [[37, 1, 5, 64, 3, 20]] if ctx.dry_run else [[3000, 17, 1, 900, 64, 5000, 333], [8192]]
    res["cp_world"] = world
    try:  # the ranks' figures are lost on a failure, the ones above are kept
        per_rank = run_ranks(_cp_rank, world, str(ctx.device), str(ctx.dtype).removeprefix("torch."), ctx.backend,
                             packs, timeout=max(120.0, budget.left()))
        res["distributed_max_rel_err"] = {k: max(r[k] for r in per_rank) for k in per_rank[0]}
    except AssertionError as e:
        res["distributed_error"] = str(e)[-2000:]
    try:  # the pipeline check failing outside its ranks (whose failures it keeps itself) keeps the figures above
        res.update(part_runtime_pipeline.run(ctx, budget, run_ranks))
    except Exception as e:  # noqa: BLE001
        res["pipeline"] = f"failed: {type(e).__name__}: {e}"
    return res
