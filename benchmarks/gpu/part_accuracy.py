"""Part 4, cost-model accuracy: predicted against measured forward + backward time of packs from long-tail data,
run through a few Llama layers with the runtime's varlen attention (benchmarks/gpu/gpu_model.py): one long
document, many short ones, mixed packs, and slices (q tokens after p earlier keys of their document). Predicted
by the shipped H100 profile scaled to the layers (`measured_profile`) and, when part 2 ran, by the profile
calibrated here: with the slice term part 3 fitted into it when that ran ("calibrated"; "calibrated_rule" is
the same profile pricing slices by the model's rule). Target: MAPE at most 5 %."""

from __future__ import annotations

import msgspec
import numpy as np
import torch
from gpu_common import Budget, Ctx, long_tail_lengths, mape, time_fwd_bwd
from gpu_model import Layers, Pack, pack_runner

from packloader.balancers.cost import presets
from packloader.balancers.cost.measured import measured_profile
from packloader.balancers.cost.model import CostModel
from packloader.contracts import ParallelConfig

TARGET_MAPE_PCT = 5.0


def packs(dry: bool, seed: int) -> list[tuple[str, list[int], list[int]]]:
    """(kind, q, p) of each pack; token counts scaled down 256x in a dry run."""
    s = 1 / 256 if dry else 1.0
    T = int(32768 * s)
    rng = np.random.default_rng(seed)
    lt = long_tail_lengths(20000, seed, scale=s)
    out = [("one long", [T], [0]), ("one long", [T // 2], [0])]
    short = lt[lt <= max(2, int(2048 * s))]
    for i in range(3):
        d = rng.permutation(short)
        q = d[: int(np.searchsorted(np.cumsum(d), T))].tolist()
        out.append(("many short", q, [0] * len(q)))
    for i in range(4):
        d = rng.permutation(np.minimum(lt, T))
        c = np.cumsum(d)
        q = d[: max(1, int(np.searchsorted(c, T)))].tolist()
        out.append(("mixed", q, [0] * len(q)))
    fill = [max(1, int(512 * s))] * max(1, int(24 * 1024 * s) // max(1, int(512 * s)))
    for q, p in ((4096, 28672), (8192, 57344), (144, 65536), (1024, 131072)):
        qq, pp = max(1, int(q * s)), int(p * s)
        out.append(("slices", [qq] + fill, [pp] + [0] * len(fill)))
    if dry:  # one pack of each kind: the code path, not the statistics
        return [next(x for x in out if x[0] == k) for k in dict.fromkeys(x[0] for x in out)]
    return out


def models(ctx: Ctx, layers: int) -> dict[str, CostModel]:
    shape = ctx.main_shape()
    out = {}
    if not ctx.dry_run:
        ms = presets.get_shape(shape.name)
        out["shipped"] = CostModel(measured_profile(ms, ParallelConfig(), layers=layers, include_head=False))
    cal = ctx.results.get("calibration_profiles", {}).get(shape.name)
    if cal is not None:
        out["calibrated"] = CostModel(cal).scaled(float(layers))
        if cal.slice_term is not None:
            out["calibrated_rule"] = CostModel(msgspec.structs.replace(cal, slice_term=None)).scaled(float(layers))
    if not out:  # a dry run without part 2: the shipped profile, only so the code path runs
        out["shipped"] = CostModel(measured_profile(presets.get_shape("llama2-7b"), ParallelConfig(), layers=layers,
                                                    include_head=False))
    return out


def run(ctx: Ctx, budget: Budget, out_dir) -> dict:
    shape = ctx.main_shape()
    layers = 2
    torch.manual_seed(ctx.seed)
    model = Layers(shape, layers).to(ctx.device, ctx.dtype)
    cms = models(ctx, layers)
    rows = []
    for kind, q, p in packs(ctx.dry_run, ctx.seed):
        budget.check(kind)
        pack = Pack(q, p, ctx.device, ctx.backend)
        f, b = time_fwd_bwd(ctx, pack_runner(model, pack, shape, ctx.dtype))
        row = {"kind": kind, "docs": len(q), "tokens": pack.tokens, "max_q": int(max(q)), "max_p": int(max(p)),
               "measured_ms": (f + b) * 1e3, "fwd_ms": f * 1e3, "bwd_ms": b * 1e3}
        for name, cm in cms.items():
            pf, pb = cm.microbatch_time_of(q, p)
            row[f"{name}_ms"] = (pf + pb) * 1e3
        rows.append(row)
        print(f"  {kind:10s} {len(q):5d} docs {pack.tokens:7d} tokens  measured {row['measured_ms']:9.3f} ms  "
              + "  ".join(f"{n} {row[f'{n}_ms']:9.3f}" for n in cms))
        ctx.free()
    res = {"layers": layers, "shape": shape.name, "rows": rows, "target_mape_pct": TARGET_MAPE_PCT, "mape_pct": {}}
    if "calibrated" in cms:
        res["calibrated_slices"] = ("the slice term fitted in part 3" if cms["calibrated"].profile.slice_term is not None
                                    else "the model's rule (no slice term fitted)")
    meas = np.array([r["measured_ms"] for r in rows])
    for name in cms:
        pred = np.array([r[f"{name}_ms"] for r in rows])
        by = {k: mape(pred[[r["kind"] == k for r in rows]], meas[[r["kind"] == k for r in rows]])
              for k in dict.fromkeys(r["kind"] for r in rows)}
        res["mape_pct"][name] = {"all": mape(pred, meas), **by}
    return res
