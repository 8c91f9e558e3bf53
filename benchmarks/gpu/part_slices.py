"""Part 3, slices: a slice of q query tokens after p earlier keys, timed in one varlen launch beside short
documents (`packloader.runtime.calibrate_slices`), against two prices:

* the cost model's rule: the whole-document time of q tokens plus q*p extra pairs at the document's own per-pair
  rate (`CostModel.segment_times(q, p)`);
* the alternative an independent re-scoring used: every (query, key) pair of the slice at the per-pair rate of
  a short document of q tokens, ``attn(q, 0) / (q(q+1)/2) * (q(q+1)/2 + q*p)``.

Then `fit_slice_term` fits the measured term, and the table is written as CSV for `packloader calibrate`'s fit.
The slices are timed as the runtime runs them (`SliceContext`, prefix keys/values assembled in the key buffer).
When part 2 calibrated the profile here, the fitted term goes into it (`with_slice_term`): part 4's "calibrated"
row then prices slices by the term, and profile-<shape>.json is written again with it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gpu_common import Budget, Ctx, mape

from packloader.balancers.cost.measured import base_profile
from packloader.balancers.cost.model import CostModel
from packloader.balancers.cost.profile_io import save_profile
from packloader.balancers.cost.slice_fit import fit_slice_term, with_slice_term, write_slice_csv
from packloader.runtime.calibrate_slices import time_slices

GPU_Q = (128, 144, 256, 512, 1024, 2048, 4096, 8192, 16384)
GPU_P = (0, 1024, 4096, 16384, 65536, 131072)
DRY_Q = (8, 12, 32)
DRY_P = (0, 16, 64)


def grid(dry: bool) -> tuple[list[int], list[int]]:
    qs, ps = (DRY_Q, DRY_P) if dry else (GPU_Q, GPU_P)
    # short slices first at every p, then longer ones: a budget cut keeps the rows that settle the question
    pairs = sorted(((q, p) for q in qs for p in ps), key=lambda qp: (qp[0] > 1024, qp[1], qp[0]))
    return [q for q, _ in pairs], [p for _, p in pairs]


def profile_for(ctx: Ctx):
    """The calibrated profile of the main shape from part 2 when it ran, else the shipped H100 layer profile."""
    cal = ctx.results.get("calibration_profiles", {}).get(ctx.main_shape().name)
    return (cal, "calibrated here") if cal is not None else (base_profile(), "shipped H100 profile")


def alternative(model: CostModel, q: np.ndarray, p: np.ndarray) -> np.ndarray:
    f, b = model.segment_times(q, np.zeros_like(q))
    pairs0 = q * (q + 1) / 2.0
    return (f + b) / pairs0 * (pairs0 + q * p)


def _into_profile(ctx: Ctx, name: str, prof, term, which: str, out_dir: Path) -> str | None:
    """Put the term into part 2's calibrated profile (what part 4 prices by); the shipped profile is left as it
    is (the term was measured here, on another device). Returns the profile file written, or None."""
    if which != "calibrated here":
        return None
    termed = with_slice_term(prof, term)
    ctx.results["calibration_profiles"][name] = termed
    save_profile(termed, out_dir / f"profile-{name}.json")
    return f"profile-{name}.json"


def run(ctx: Ctx, budget: Budget, out_dir: Path) -> dict:
    shape = ctx.main_shape()
    qs, ps = grid(ctx.dry_run)
    filler = (8, 64) if ctx.dry_run else (512, 16384)
    t = time_slices(shape, qs, ps, device=ctx.device, dtype=ctx.dtype, backend=ctx.backend, filler_len=filler[0],
                    filler_tokens=filler[1], repeats=ctx.repeats, warmup=ctx.warmup, progress=print,
                    stop=lambda: budget.left() <= 0)
    write_slice_csv(t, out_dir / "slices.csv")
    prof, which = profile_for(ctx)
    model = CostModel(prof)
    q, p = np.asarray(t.q, dtype=np.int64), np.asarray(t.p, dtype=np.int64)
    meas = np.asarray(t.fwd) + np.asarray(t.bwd)
    rf, rb = model.segment_times(q, p)
    rule, alt = rf + rb, alternative(model, q, p)
    rows = [{"q": int(a), "p": int(b), "measured_ms": float(m * 1e3), "rule_ms": float(r * 1e3), "alt_ms": float(x * 1e3),
             "measured_over_rule": float(m / r), "measured_over_alt": float(m / x)}
            for a, b, m, r, x in zip(q, p, meas, rule, alt)]
    sliced = p > 0
    res = {"profile": which, "filler": {"doc_len": filler[0], "tokens": filler[1]}, "rows": rows,
           "rows_planned": len(qs), "csv": "slices.csv",
           "rule_mape_pct": mape(rule[sliced], meas[sliced]), "alt_mape_pct": mape(alt[sliced], meas[sliced])}
    try:
        term = fit_slice_term(prof, t) if sliced.sum() >= 2 else None
    except ValueError as e:  # too few slices over the timer's resolution (a dry run's tiny shapes)
        term, res["fit_skipped"] = None, str(e)
    if term is not None:
        res["fit"] = {"tile": term.tile, "rows": term.rows, "dropped": term.dropped,
                      **{f"{k}_{part}": getattr(getattr(term, part), k) for part in ("fwd", "bwd")
                         for k in ("x", "y", "pair_ratio", "mape_pct", "rule_mape_pct")}}
        res["fit"]["in_profile"] = _into_profile(ctx, shape.name, prof, term, which, out_dir)
    closer = "rule" if res["rule_mape_pct"] <= res["alt_mape_pct"] else "alternative"
    res["verdict"] = (f"the {closer} is closer on the {int(sliced.sum())} slices (p > 0): MAPE rule "
                      f"{res['rule_mape_pct']:.1f} %, alternative {res['alt_mape_pct']:.1f} %")
    return res
