"""Part 2, calibration: what `packloader calibrate` runs (`time_attention`, `time_linear`, `fit_profile` of
packloader.runtime.calibrate), for the 7B layer and a smaller GQA one, at the shipped profile's own rows (the
attention lengths of packloader/profiles/measured/h100-attention.csv in 32K-token packs, the token counts of
h100-linear.csv), compared row by row with the shipped measurement and with the shipped profile's prediction
(scaled to the shape as `measured_profile` scales it). Then `packloader calibrate --slices` itself, on the
7B layer, when the budget allows."""

from __future__ import annotations

import numpy as np
from gpu_common import Budget, Ctx

from packloader.balancers.cost import presets
from packloader.balancers.cost.fit import Timings, fit_profile
from packloader.balancers.cost.measured import ATTENTION_CSV, LINEAR_CSV, base_profile, measured_profile, read_csv
from packloader.balancers.cost.model import CostModel
from packloader.contracts import ParallelConfig
from packloader.runtime.calibrate import LayerShape, time_attention, time_linear


def shipped_model(shape: LayerShape) -> CostModel:
    """The shipped H100 layer profile for `shape` (one layer, no LM head): as shipped for the 7B layer it was
    measured on, scaled otherwise."""
    if shape.name == "llama2-7b":
        return CostModel(base_profile())
    ms = presets.ModelShape(name=shape.name, hidden=shape.hidden, layers=shape.layers or 1, heads=shape.heads,
                            kv_heads=shape.kv_heads, ffn=shape.ffn, vocab=shape.vocab or 32000)
    return CostModel(measured_profile(ms, ParallelConfig(), layers=1, include_head=False))


def rows_to_time(dry: bool) -> tuple[np.ndarray, np.ndarray, int, np.ndarray, np.ndarray]:
    """(attention lengths, their shipped per-pack ms rows, pack tokens, linear token counts, their shipped rows)."""
    if dry:
        return np.array([8, 16, 32, 64]), np.zeros((4, 4)), 64, np.array([16, 32, 64, 128]), np.zeros((4, 3))
    att = read_csv(ATTENTION_CSV, ("docs", "doc_len", "fwd_ms", "bwd_ms"))
    lin = read_csv(LINEAR_CSV, ("tokens", "fwd_ms", "bwd_ms"))
    return att[:, 1].astype(np.int64), att, 32768, lin[:, 0].astype(np.int64), lin


def _one_shape(ctx: Ctx, shape: LayerShape, budget: Budget) -> tuple[dict, object]:
    lengths, att, pack, sizes, lin = rows_to_time(ctx.dry_run)
    af, ab = time_attention(shape, lengths, device=ctx.device, dtype=ctx.dtype, backend=ctx.backend,
                            token_budget=pack, repeats=ctx.repeats, warmup=ctx.warmup, progress=print)
    budget.check(f"{shape.name} attention")
    lf, lb, _, _ = time_linear(shape, sizes, device=ctx.device, dtype=ctx.dtype, repeats=ctx.repeats,
                               warmup=ctx.warmup, progress=print)
    timings = Timings(lengths, af, ab, sizes, lf, lb)
    prof = fit_profile(f"{shape.name}@{ctx.device.type}", timings, device=str(ctx.device))
    ship = shipped_model(shape)
    sf, sb = ship.segment_times(lengths, np.zeros_like(lengths))
    is_7b = shape.name == "llama2-7b"
    rows = []
    for i, l in enumerate(lengths.tolist()):
        docs = max(1, pack // l)
        rows.append({"part": "attention", "n": l, "docs": docs, "fwd_ms": af[i] * docs * 1e3, "bwd_ms": ab[i] * docs * 1e3,
                     "shipped_fwd_ms": float(att[i, 2]) if is_7b else None, "shipped_bwd_ms": float(att[i, 3]) if is_7b else None,
                     "profile_fwd_ms": sf[i] * docs * 1e3, "profile_bwd_ms": sb[i] * docs * 1e3})
    for i, n in enumerate(sizes.tolist()):
        rows.append({"part": "linear", "n": n, "docs": None, "fwd_ms": lf[i] * 1e3, "bwd_ms": lb[i] * 1e3,
                     "shipped_fwd_ms": float(lin[i, 1]) if is_7b else None, "shipped_bwd_ms": float(lin[i, 2]) if is_7b else None,
                     "profile_fwd_ms": ship.lin_time(n, False) * 1e3, "profile_bwd_ms": ship.lin_time(n, True) * 1e3})
    for r in rows:
        for k in ("fwd", "bwd"):
            r[f"vs_profile_{k}"] = r[f"{k}_ms"] / r[f"profile_{k}_ms"] - 1 if r[f"profile_{k}_ms"] else None
            r[f"vs_shipped_{k}"] = r[f"{k}_ms"] / r[f"shipped_{k}_ms"] - 1 if r[f"shipped_{k}_ms"] else None
    fit = {"tile": prof.tile, "fit_error": dict(prof.fit_error),
           **{p: [getattr(prof, p).a, getattr(prof, p).b, getattr(prof, p).c] for p in ("attn_fwd", "attn_bwd")}}
    return {"shape": shape.name, "rows": rows, "fit": fit}, prof


def cli_run(ctx: Ctx, out_dir) -> dict:
    """`packloader calibrate` itself on the main shape (its default lengths and sizes, one layer, with
    `--slices`), so the command users run is proven on the device too; its printed fit is kept."""
    import contextlib
    import io

    from packloader.cli.main import main

    s = ctx.main_shape()
    argv = ["calibrate", "--device", ctx.device.type, "--hidden", str(s.hidden), "--heads", str(s.heads),
            "--kv-heads", str(s.kv_heads), "--head-dim", str(s.head_dim), "--ffn", str(s.ffn), "--layers", "1",
            "--dtype", {"bfloat16": "bf16", "float16": "fp16"}.get(str(ctx.dtype).removeprefix("torch."), "fp32"),
            "--out", str(out_dir / "cli-profile.json"), "--slices", str(out_dir / "cli-slices.csv"), "--quiet"]
    argv += ["--max-len", "128", "--lengths", "4", "--sizes", "3", "--repeats", "1", "--warmup", "0"] if ctx.dry_run \
        else ["--max-len", "32768"]
    if ctx.backend:
        argv += ["--backend", ctx.backend]
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        code = main(argv)
    return {"command": "packloader " + " ".join(argv), "exit": code, "output": text.getvalue()[-4000:]}


def run(ctx: Ctx, budget: Budget, out_dir) -> dict:
    from packloader.balancers.cost.profile_io import save_profile

    out, profiles = {"shapes": []}, {}
    for shape in ctx.shapes():
        budget.check(shape.name)
        res, prof = _one_shape(ctx, shape, budget)
        save_profile(prof, out_dir / f"profile-{shape.name}.json")
        res["profile_json"] = f"profile-{shape.name}.json"
        out["shapes"].append(res)
        profiles[shape.name] = prof
        ctx.free()
    ctx.results["calibration_profiles"] = profiles
    if ctx.quick:
        out["cli"] = {"skipped": "--quick"}
    elif budget.left() > 0.3 * budget.seconds:  # about a minute on an H100; skipped rather than cut
        out["cli"] = cli_run(ctx, out_dir)
    else:
        out["cli"] = {"skipped": f"{budget.left():.0f} s of the budget left"}
    return out

