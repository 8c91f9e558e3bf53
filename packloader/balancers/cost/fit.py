"""Fitting a cost profile to measured times: the shipped H100 profile and `packloader calibrate` both go
through here, so a calibrated profile is fitted exactly as the shipped one was."""

from __future__ import annotations

import math
from dataclasses import dataclass

import msgspec
import numpy as np

from packloader.balancers.cost.model import CostModel
from packloader.contracts import MAX_LIN_KNOTS, CostProfile, LinTable, Poly


def fit_poly(x: np.ndarray, y: np.ndarray, *, relative: bool = True) -> tuple[Poly, float]:
    """Least-squares a*x^2 + b*x + c through measured (x, y) (Hydraulis's latency fit), coefficients kept
    non-negative (a negative term is dropped and the rest refitted). With `relative`, residuals are weighted
    by 1/y so short and long measurements count alike. Returns the Poly and its largest relative error."""
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    if x.shape != y.shape or x.ndim != 1 or len(x) == 0:
        raise ValueError(f"fit_poly needs two equal non-empty 1-D arrays, got {x.shape} and {y.shape}")
    w = 1.0 / np.maximum(np.abs(y), 1e-30) if relative else np.ones_like(y)
    cols = [x * x, x, np.ones_like(x)]
    active = [0, 1, 2]
    coef = np.zeros(3)
    while active:
        A = np.stack([cols[i] for i in active], axis=1) * w[:, None]
        sol = np.linalg.lstsq(A, y * w, rcond=None)[0]
        if (sol >= 0).all():
            coef[:] = 0.0
            coef[active] = sol
            break
        active = [i for i, v in zip(active, sol) if v >= 0] if (sol >= 0).any() else active[:-1]
    pred = coef[0] * x * x + coef[1] * x + coef[2]
    err = float(np.max(np.abs(pred - y) / np.maximum(np.abs(y), 1e-30)))
    return Poly(float(coef[0]), float(coef[1]), float(coef[2])), err


@dataclass(frozen=True)
class Timings:
    """Measured times in seconds: attention of one causal document per length, and linear layers of one
    micro-batch per token count, forward and backward. What `calibrate` measures and the shipped profile's
    CSVs hold, in the one form both fits take."""

    attn_lengths: np.ndarray
    attn_fwd: np.ndarray
    attn_bwd: np.ndarray
    lin_tokens: np.ndarray
    lin_fwd: np.ndarray
    lin_bwd: np.ndarray

    def __post_init__(self) -> None:
        for f, dtype in (("attn_lengths", np.int64), ("lin_tokens", np.int64), ("attn_fwd", np.float64),
                         ("attn_bwd", np.float64), ("lin_fwd", np.float64), ("lin_bwd", np.float64)):
            object.__setattr__(self, f, np.asarray(getattr(self, f), dtype=dtype))

    def subset(self, attn: np.ndarray, lin: np.ndarray) -> Timings:
        """The rows selected by boolean masks over the attention lengths and the linear token counts."""
        return Timings(self.attn_lengths[attn], self.attn_fwd[attn], self.attn_bwd[attn],
                       self.lin_tokens[lin], self.lin_fwd[lin], self.lin_bwd[lin])


def profile_from_table(
    name: str,
    timings: Timings,
    *,
    tile: int = 128,
    device: str = "measured",
    memory_cap: int | None = None,
    lin_table: bool = True,
    source: str = "",
) -> CostProfile:
    """A CostProfile fitted to a measured table: attention time of one causal document per length (lengths
    rounded up to the tile before fitting, as the model evaluates them; a*l^2 + b*l + c) and linear time of a
    micro-batch per token count, forward and backward. With `lin_table` (and at most MAX_LIN_KNOTS counts) the
    measured linear times become the profile's `LinTable` and the polynomials their smooth summary for the
    planners. `fit_error` records each part's largest relative error over the rows, as the model evaluates
    them (for a table: 0 at its own rows)."""
    t = timings
    qt = _tiled(t.attn_lengths, tile)
    af, ef_a = fit_poly(qt, t.attn_fwd)
    ab, eb_a = fit_poly(qt, t.attn_bwd)
    n = t.lin_tokens.astype(np.float64)
    lf, ef_l = fit_poly(n, t.lin_fwd)
    lb, eb_l = fit_poly(n, t.lin_bwd)
    table = None
    if lin_table and 1 <= len(n) <= MAX_LIN_KNOTS:
        order = np.argsort(n, kind="stable")
        n = n[order]
        tf, tb = t.lin_fwd[order], t.lin_bwd[order]
        table = LinTable(tokens=n.tolist(), fwd=tf.tolist(), bwd=tb.tolist())
        lf, lb = _table_summary(n, tf), _table_summary(n, tb)
        ef_l = eb_l = 0.0
    return CostProfile(
        name=name, tile=tile, attn_fwd=af, attn_bwd=ab, lin_fwd=lf, lin_bwd=lb, device=device, memory_cap=memory_cap,
        fit_error={"attn_fwd": ef_a, "attn_bwd": eb_a, "lin_fwd": ef_l, "lin_bwd": eb_l}, lin_table=table, source=source,
    )


def _table_summary(n: np.ndarray, t: np.ndarray) -> Poly:
    """Per-token rate plus floor summarising a measured linear table for the planners: the median slope between
    consecutive counts of the larger half (where GEMMs run at their flat per-token rate; the median because
    single measurements jump), and the floor that matches the first count. Exact for a table of b*n + c."""
    if len(n) < 2:
        return Poly(0.0, 0.0, float(t[0]))
    slopes = np.diff(t) / np.diff(n)
    upper = slopes[len(slopes) // 2:]
    rate = float(max(0.0, np.median(upper)))
    return Poly(0.0, rate, float(max(0.0, t[0] - rate * n[0])))


TILE_CANDIDATES = (1, 16, 32, 64, 128, 256)


def held_out_mask(n: int) -> np.ndarray:
    """Every other point held out; the first and last stay in the fit (no extrapolation in the held-out error)."""
    mask = np.zeros(n, dtype=bool)
    mask[1 : n - 1 : 2] = True
    return mask


def mape_pct(pred: np.ndarray, y: np.ndarray) -> float:
    y = np.asarray(y, dtype=np.float64)
    return float(np.mean(np.abs(np.asarray(pred) - y) / np.maximum(np.abs(y), 1e-30)) * 100.0) if len(y) else float("nan")


def _poly_eval(poly, x: np.ndarray) -> np.ndarray:
    return poly.a * x * x + poly.b * x + poly.c


def _tiled(lengths: np.ndarray, tile: int) -> np.ndarray:
    return np.ceil(np.asarray(lengths, dtype=np.float64) / tile) * tile


def choose_tile(lengths: np.ndarray, fwd: np.ndarray, bwd: np.ndarray, candidates=TILE_CANDIDATES) -> int:
    """The tile whose rounded-length fit of forward and backward attention times has the smallest mean relative
    error (ties: the smaller tile)."""
    best, best_err = 1, math.inf
    for tile in sorted(candidates):
        x = _tiled(lengths, tile)
        err = 0.0
        for y in (fwd, bwd):
            poly, _ = fit_poly(x, y)
            err += mape_pct(_poly_eval(poly, x), y)
        if err < best_err * (1 - 1e-9):
            best, best_err = tile, err
    return best


def fit_profile(name: str, timings: Timings, *, tile: int | None = None, device: str = "measured") -> CostProfile:
    """Fit a CostProfile to measured times: every other point (not the ends) is held out of the fit and
    scored."""
    al, ll = timings.attn_lengths, timings.lin_tokens
    table = {part: getattr(timings, part) for part in ("attn_fwd", "attn_bwd", "lin_fwd", "lin_bwd")}
    for part, y in table.items():
        x = al if part.startswith("attn") else ll
        if y.shape != x.shape:
            raise ValueError(f"{part}: {len(y)} times for {len(x)} points")
        if len(x) < 3:
            raise ValueError(f"{part}: at least 3 measured points are needed, got {len(x)}")
    ha, hl = held_out_mask(len(al)), held_out_mask(len(ll))
    fitted = timings.subset(~ha, ~hl)
    if tile is None:
        tile = choose_tile(fitted.attn_lengths, fitted.attn_fwd, fitted.attn_bwd)
    prof = profile_from_table(name, fitted, tile=int(tile), device=device)
    model = CostModel(prof)
    errors = dict(prof.fit_error)
    for part, y in table.items():
        if part.startswith("attn"):
            pred = _poly_eval(getattr(prof, part), _tiled(al, tile)[ha])
            mask = ha
        else:  # the measured table, interpolated at the held-out counts
            pred = np.array([model.lin_time(n, part == "lin_bwd") for n in ll[hl]])
            mask = hl
        errors[f"{part}_heldout_mape_pct"] = mape_pct(pred, y[mask])
    return msgspec.structs.replace(prof, fit_error=errors)
