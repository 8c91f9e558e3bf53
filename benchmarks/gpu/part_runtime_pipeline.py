"""Part 6's pipeline check: `PlanPipelineSchedule` (torch.distributed.pipelining with packloader's stages) on the
device, its stage processes emulated on one GPU over gloo, against a float64 CPU reference of the same model.

NCCL refuses two ranks on one GPU and gloo's point-to-point calls take CPU tensors, so every tensor that crosses
ranks is copied through the CPU (`_stage_p2p_through_cpu`: the send/recv calls the engine makes, batched or
not, its warm-up vote and stage metadata where the torch version has them; any other collective is counted, and
the dry run expects none); the stages, their receive buffers, the KV carry of the slices, the
attention kernels and autograd stay on the device. The model is a tiny Llama-like one (embedding, RMSNorm,
rotary GQA attention through the micro-batch's slice context, an MLP, the LM head), four layers split over the
stages; the micro-batches are a hand-made sliced plan (a document in three slices over three micro-batches,
another in two, two slices of one document in one micro-batch, whole documents between). The reference runs
every document whole, one at a time, with an explicit causal mask (no packloader code), in float64 on the CPU.
Errors are relative to the reference's largest magnitude (each parameter's gradient; the max over parameters).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from packloader.contracts import MicroBatch, RankPlan, Segment

# (pp, schedule, stages per rank): the schedules PlanPipelineSchedule runs, each on the same plan
PP2 = ((2, "1f1b", 1), (2, "interleaved", 2), (2, "zb-h1", 1), (2, "zb-v", 2))
PP4 = ((4, "1f1b", 1), (4, "zb-h1", 1))
LAYERS = 4  # one layer per stage at 2 x 2 and at 4 stages


@dataclass(frozen=True)
class Dims:
    vocab: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int


DRY = Dims(vocab=48, hidden=16, heads=4, kv_heads=2, head_dim=4, ffn=32)
DEVICE = Dims(vocab=256, hidden=128, heads=4, kv_heads=2, head_dim=32, ffn=256)  # head_dim the kernels take


def _mb(*segs) -> MicroBatch:
    return MicroBatch(segments=[Segment(*s) for s in segs])


# document 0 in three slices (micro-batches 0, 1, 3), document 2 in two (1, 2), document 5 in two slices inside
# micro-batch 4; whole documents between. Eight micro-batches: a multiple of pp for the interleaved schedules.
LENGTHS = {0: 40, 1: 9, 2: 21, 3: 6, 4: 13, 5: 18, 6: 4, 7: 11, 8: 3, 9: 5}
PLAN = RankPlan(micro_batches=[
    _mb((0, 0, 14, 0), (1, 0, 9, 0)), _mb((2, 0, 10, 0), (0, 14, 30, 0)),
    _mb((3, 0, 6, 0), (2, 10, 21, 0), (6, 0, 4, 0)), _mb((4, 0, 13, 0), (0, 30, 40, 0)),
    _mb((5, 0, 7, 0), (5, 7, 18, 0)), _mb((7, 0, 11, 0)), _mb((8, 0, 3, 0)), _mb((9, 0, 5, 0))])


# ------------------------------------------------------------------------------------------------ the model


def params(d: Dims, seed: int = 0) -> dict[str, torch.Tensor]:
    """Every weight, float64 on the CPU (each stage takes its own to the device)."""
    g = torch.Generator().manual_seed(seed)

    def w(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64) / math.sqrt(shape[0])

    def norm():
        return 1 + 0.1 * torch.randn(d.hidden, generator=g, dtype=torch.float64)

    p = {"embed": torch.randn(d.vocab, d.hidden, generator=g, dtype=torch.float64), "norm": norm(),
         "head": w(d.hidden, d.vocab)}
    for i in range(LAYERS):
        p.update({f"l{i}_n1": norm(), f"l{i}_q": w(d.hidden, d.heads * d.head_dim),
                  f"l{i}_k": w(d.hidden, d.kv_heads * d.head_dim), f"l{i}_v": w(d.hidden, d.kv_heads * d.head_dim),
                  f"l{i}_o": w(d.heads * d.head_dim, d.hidden), f"l{i}_n2": norm(), f"l{i}_up": w(d.hidden, d.ffn),
                  f"l{i}_down": w(d.ffn, d.hidden)})
    return p


def _rms(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def _rope(x, pos):
    half = x.shape[-1] // 2
    freq = 1.0 / 10000 ** (torch.arange(half, dtype=torch.float64, device=x.device) / half)
    ang = pos.double()[:, None] * freq[None, :]  # float64 angles, then the model's dtype
    cos, sin = ang.cos()[:, None, :].to(x.dtype), ang.sin()[:, None, :].to(x.dtype)
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], -1)


def _layer(p, i: int, x, pos, attend, d: Dims):
    T = x.shape[0]
    h = _rms(x, p[f"l{i}_n1"])
    q = _rope((h @ p[f"l{i}_q"]).view(T, d.heads, d.head_dim), pos)
    k = _rope((h @ p[f"l{i}_k"]).view(T, d.kv_heads, d.head_dim), pos)
    x = x + attend(q, k, (h @ p[f"l{i}_v"]).view(T, d.kv_heads, d.head_dim)).reshape(T, -1) @ p[f"l{i}_o"]
    return x + F.silu(_rms(x, p[f"l{i}_n2"]) @ p[f"l{i}_up"]) @ p[f"l{i}_down"]


def _slice_attend(q, k, v):
    from packloader.runtime.slices import current_slice_context

    return current_slice_context().attention(q, k, v)


class Stage(nn.Module):
    """Layers lo..hi-1, with the embedding on the first stage and norm + head on the last."""

    def __init__(self, p: dict[str, torch.Tensor], lo: int, hi: int, first: bool, last: bool, d: Dims,
                 device: torch.device, dtype: torch.dtype):
        super().__init__()
        names = [n for n in p if n.startswith(tuple(f"l{i}_" for i in range(lo, hi)))]
        names += (["embed"] if first else []) + (["norm", "head"] if last else [])
        self.p = nn.ParameterDict({n: nn.Parameter(p[n].to(device, dtype)) for n in names})
        self.lo, self.hi, self.first, self.last, self.d = lo, hi, first, last, d

    def forward(self, x, positions):
        if self.first:
            x = F.embedding(x, self.p["embed"])
        for i in range(self.lo, self.hi):
            x = _layer(self.p, i, x, positions, _slice_attend, self.d)
        return _rms(x, self.p["norm"]) @ self.p["head"] if self.last else x


def documents(d: Dims, seed: int = 1) -> dict[int, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {doc: torch.randint(0, d.vocab, (n,), generator=g) for doc, n in LENGTHS.items()}


def loss_tokens(docs) -> int:
    return sum(len(t) - 1 for t in docs.values())


def reference(d: Dims) -> tuple[float, dict[str, torch.Tensor]]:
    """Loss (token loss sum / loss tokens) and every gradient, each document run whole with a causal mask."""
    p = {n: t.clone().requires_grad_() for n, t in params(d).items()}
    docs = documents(d)
    n_loss, total = loss_tokens(docs), 0.0
    for ids in docs.values():
        n = len(ids)
        mask = torch.ones(n, n, dtype=torch.bool).triu(1)

        def attend(q, k, v):
            k, v = (t.repeat_interleave(d.heads // d.kv_heads, 1) for t in (k, v))
            s = torch.einsum("qhd,khd->hqk", q, k) / d.head_dim ** 0.5
            return torch.einsum("hqk,khd->qhd", torch.softmax(s.masked_fill(mask, float("-inf")), -1), v)

        x = F.embedding(ids, p["embed"])
        for i in range(LAYERS):
            x = _layer(p, i, x, torch.arange(n), attend, d)
        loss = F.cross_entropy((_rms(x, p["norm"]) @ p["head"])[:-1], ids[1:], reduction="sum") / n_loss
        loss.backward()
        total += float(loss.detach())
    return total, {n: t.grad for n, t in p.items()}


def loss_fn(logits, target):
    labels, n_loss = target
    return F.cross_entropy(logits.float(), labels, ignore_index=-100, reduction="sum") / n_loss


# ------------------------------------------------------------------------------------------- the transport


class _Staged:
    """A gloo Work on a CPU copy: `wait` copies a received tensor back to its device buffer (`dst`)."""

    def __init__(self, work, buf: torch.Tensor, dst: torch.Tensor | None):
        self.work, self.buf, self.dst = work, buf, dst

    def wait(self, *args, **kwargs):
        ok = self.work.wait(*args, **kwargs)
        if self.dst is not None:
            with torch.no_grad():  # a receive buffer may be a leaf that requires grad
                self.dst.copy_(self.buf)
            self.dst = None  # once, however often it is waited on
        return ok

    def __getattr__(self, name):
        return getattr(self.work, name)


STAGED = {"send": 0, "recv": 0}  # tensors staged in this process (the report's proof that the wrappers ran)
# tensors that crossed ranks some other way (counted by name; the dry-run test expects none)
COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter",
               "reduce_scatter_tensor", "reduce", "gather", "scatter", "all_to_all", "all_to_all_single")
UNSTAGED: dict[str, int] = {}


def _counted(name, fn):
    def call(*args, **kwargs):
        UNSTAGED[name] = UNSTAGED.get(name, 0) + 1
        return fn(*args, **kwargs)
    return call


def _stage_p2p_through_cpu() -> None:
    """The point-to-point calls go through CPU copies: sends send a CPU copy, receives land in a CPU buffer
    that is copied to the device tensor when the work is waited on. Both names are replaced (the package's,
    which the engine and its P2POps call, and distributed_c10d's, which P2POp checks its op against); the
    batch call runs the ops one by one, as gloo does without coalescing. On CPU (the dry run) the copies are
    real copies too, so the copy-back is exercised."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    if getattr(dist.isend, "_staged", False):
        return
    send, recv, isend, irecv = c10d.send, c10d.recv, c10d.isend, c10d.irecv

    def cpu(t):
        STAGED["send"] += 1
        return t.detach().to("cpu", copy=True)

    def s_send(tensor, *args, **kwargs):
        return send(cpu(tensor), *args, **kwargs)

    def s_recv(tensor, *args, **kwargs):
        STAGED["recv"] += 1
        buf = torch.empty_like(tensor, device="cpu")
        src = recv(buf, *args, **kwargs)
        with torch.no_grad():
            tensor.copy_(buf)
        return src

    def s_isend(tensor, *args, **kwargs):
        buf = cpu(tensor)
        work = isend(buf, *args, **kwargs)
        return None if work is None else _Staged(work, buf, None)

    def s_irecv(tensor, *args, **kwargs):
        STAGED["recv"] += 1
        buf = torch.empty_like(tensor, device="cpu")
        work = irecv(buf, *args, **kwargs)
        return None if work is None else _Staged(work, buf, tensor)

    def s_batch(ops):
        works = []
        for op in ops:
            if op.op in (s_isend, isend):
                works.append(s_isend(op.tensor, dst=op.peer, group=op.group, tag=op.tag))
            else:
                works.append(s_irecv(op.tensor, src=op.peer, group=op.group, tag=op.tag))
        return [w for w in works if w is not None]

    s_isend._staged = True
    counted = {n: _counted(n, getattr(c10d, n)) for n in COLLECTIVES if hasattr(c10d, n)}
    for mod in (dist, c10d):
        mod.send, mod.recv, mod.isend, mod.irecv, mod.batch_isend_irecv = s_send, s_recv, s_isend, s_irecv, s_batch
        for n, fn in counted.items():
            setattr(mod, n, fn)


# ------------------------------------------------------------------------------------------------ the ranks


def _pp_rank(rank, world, device, dtype, backend, cases, dims):
    """This pipeline rank's stages of each case: one step of PLAN; its parameters' gradients and, on the last
    stage, the step's loss (numpy, so nothing crosses the process boundary as shared memory)."""
    import torch.distributed as dist
    from helpers.pipeline_model import micro_batch_inputs  # tests/ is on the path (part_runtime), in ranks too

    from packloader.runtime.pipeline import PlanPipelineSchedule, SlicedPipelineStage
    from packloader.runtime.pipeline_actions import rank_stages

    _stage_p2p_through_cpu()
    dev, dt = torch.device(device), getattr(torch, dtype)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    p, docs = params(dims), documents(dims)
    n_loss = loss_tokens(docs)
    mbs = [micro_batch_inputs(mb, docs) for mb in PLAN.micro_batches]
    out = []
    for pp, schedule, vpp in cases:
        n = pp * vpp
        cuts = [round(LAYERS * i / n) for i in range(n + 1)]
        stages, mods = [], []
        for si in rank_stages(rank, pp, vpp, schedule == "zb-v"):
            first, last = si == 0, si == n - 1
            mods.append(Stage(p, cuts[si], cuts[si + 1], first, last, dims, dev, dt))
            stages.append(SlicedPipelineStage(
                mods[-1], si, n, dev, backend=backend,
                input_example=torch.zeros(1, dtype=torch.long, device=dev) if first
                else torch.zeros(1, dims.hidden, dtype=dt, device=dev),
                output_example=torch.zeros(1, dims.vocab if last else dims.hidden, dtype=dt, device=dev)))
        sched = PlanPipelineSchedule(stages, loss_fn, schedule=schedule)
        losses: list = []
        sched.step_plan(PLAN, arg_mbs=[(i.to(dev),) for i, _, _ in mbs],
                        kwarg_mbs=[{"positions": q.to(dev)} for _, q, _ in mbs],
                        target_mbs=[(lab.to(dev), n_loss) for _, _, lab in mbs], losses=losses)
        grads = {k: t.grad.double().cpu().numpy() for m in mods for k, t in m.p.items() if t.grad is not None}
        last = any(st.is_last for st in stages)
        out.append({"grads": grads, "loss": sum(float(x.detach()) for x in losses) if last else None,
                    "kv_left": sum(len(st.cache) for st in stages)})
        dist.barrier()
    return {"cases": out, "staged": dict(STAGED), "unstaged": dict(UNSTAGED)}


def _errors(per_rank: list[dict], cases, ref_loss: float, ref_grads: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per case: the loss's relative error, and the largest of every parameter's gradient error (relative to
    its largest reference magnitude); a gradient missing, or held by two ranks, is an error, not a figure."""
    errs = {}
    for ci, (pp, schedule, vpp) in enumerate(cases):
        got: dict[str, torch.Tensor] = {}
        for r in range(pp):
            res = per_rank[r]["cases"][ci]
            if res["kv_left"]:
                raise RuntimeError(f"pp {pp} {schedule}: rank {r} kept {res['kv_left']} carried KV entries")
            for k, g in res["grads"].items():
                if k in got:
                    raise RuntimeError(f"pp {pp} {schedule}: parameter {k} has gradients on two pipeline ranks")
                got[k] = torch.from_numpy(g)
        if set(got) != set(ref_grads):
            raise RuntimeError(f"pp {pp} {schedule}: gradients of {sorted(got)}, expected {sorted(ref_grads)}")
        name = f"pipeline/pp{pp}/{schedule}" + (f"/vpp{vpp}" if vpp > 1 else "")
        loss = next(r["cases"][ci]["loss"] for r in per_rank if r["cases"][ci]["loss"] is not None)  # ZB-V: rank 0
        errs[f"{name}/loss"] = abs(loss - ref_loss) / abs(ref_loss)
        per_param = torch.stack([(got[k] - g).abs().max() / g.abs().max().clamp_min(1e-30) for k, g in ref_grads.items()])
        errs[f"{name}/grads"] = float(per_param.max())  # torch's max keeps a NaN (Python's may not)
    return errs


def run(ctx, budget, run_ranks) -> dict:
    """PP 2 (four schedules) and, while the part's budget lasts, PP 4: loss and gradient errors against the
    float64 CPU reference. `run_ranks`: the gloo harness (tests/helpers/distributed.py)."""
    dims = DRY if ctx.dry_run else DEVICE
    ref_loss, ref_grads = reference(dims)
    args = (str(ctx.device), str(ctx.dtype).removeprefix("torch."), ctx.backend)
    res: dict = {"pipeline_max_rel_err": {}, "pipeline_staged_p2p": {}}
    for pp, cases in ((2, PP2), (4, PP4)):
        if pp == 4 and budget.left() < 20:
            res["pipeline_skipped"] = f"PP 4: {max(0.0, budget.left()):.0f} s of the part's budget left"
            break
        try:  # one world's failure keeps the other's figures
            per_rank = run_ranks(_pp_rank, pp, *args, cases, dims, timeout=max(90.0, budget.left()))
            res["pipeline_max_rel_err"].update(_errors(per_rank, cases, ref_loss, ref_grads))
            res["pipeline_staged_p2p"][f"pp{pp}"] = {k: sum(r["staged"][k] for r in per_rank) for k in ("send", "recv")}
            other = {k: sum(r["unstaged"].get(k, 0) for r in per_rank) for r0 in per_rank for k in r0["unstaged"]}
            res["pipeline_staged_p2p"][f"pp{pp}"]["other collectives"] = other
        except Exception as e:  # noqa: BLE001 - the ranks' tracebacks (run_ranks) or a missing gradient
            res[f"pipeline_pp{pp}_error"] = f"{type(e).__name__}: {e}"[-2000:]
    moved = ", ".join(f"{k}: {v['send']} sends, {v['recv']} receives" for k, v in res["pipeline_staged_p2p"].items())
    res["pipeline"] = (f"stage processes on one device over gloo, point to point through the CPU ({moved or 'none'}); "
                       "loss and gradients in the table above"
                       + (f"; skipped {res['pipeline_skipped']}" if "pipeline_skipped" in res else "")
                       + "".join(f"; failed: see {k} in the JSON" for k in res if k.endswith("_error")))
    return res
