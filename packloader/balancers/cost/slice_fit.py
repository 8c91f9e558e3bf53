"""The slice term: what a SlimPack slice (q query tokens after p earlier keys of its document) costs beyond a
whole document of q tokens, fitted to measured times.

The cost model prices a slice as ``attn(q, 0) + 2*a*qt*p`` per pass (`coeffs.attn_time`): the q*p extra
(query, key) pairs at the per-pair rate `a` of long documents. That is an assumption; a small slice may run
nearer a short document's per-pair rate, or pay per key it reads whatever its q. The measured table (one row
per (q, p): the slice's own seconds inside a packed varlen launch, forward and backward; p = 0 rows are whole
documents) is fitted with

    slice(q, p) = attn(q, 0) + x * 2*qt*p + y * p          qt = ceil(q / tile) * tile

per pass, x and y non-negative, residuals relative to the measured time, the tile chosen from candidates as
the attention fit does. Where the table says which launch the slices were timed beside (`SliceTimings.launch_*`:
S documents, T tokens), two more non-negative terms are fitted, the p = 0 rows included:

    + f * [p > 0]  +  beta * (T + (S + 1) * q)

f is a floor per slice (its own calls); beta is what assembling the key buffer costs per (segment, token) of the
launch: indexing each segment's keys out of the micro-batch's makes backward write a zero-filled copy of all
T rows per segment, so adding a segment of q tokens costs beta * (T + (S + 1) * q). That is the floor the H200's
slice table showed (a 128-token slice after 0 keys: 0.377 ms); the runtime now splits the keys once (one
concatenation backward), so a new table fits beta near 0. f and beta are reported, not priced. The model's rule is x = a, y = 0: `SliceTerm.pair_ratio` (x / a) and the fit's error
under the rule say how far the measurement is from it. `with_slice_term` puts the fitted term into the profile
(`CostProfile.slice_term`), which the cost model, the planners and the simulator then price slices by.
"""

from __future__ import annotations

import csv
import math
import os

import msgspec
import numpy as np

from packloader.balancers.cost.model import CostModel
from packloader.contracts import CostProfile, SliceCoeffs

SLICE_CSV_COLUMNS = ("q", "p", "fwd_ms", "bwd_ms")
TILES = (1, 16, 32, 64, 128, 256)
# a slice is timed as the difference of two launches: at or under this (about a CUDA event's resolution; a
# difference that came out <= 0 is clamped far below it) it is noise
RESOLUTION_S = 1e-6


class SliceTimings(msgspec.Struct, kw_only=True, frozen=True):
    """Measured seconds of slices: row i is q[i] query tokens after p[i] earlier keys (p = 0: a whole document)."""

    q: list[int]
    p: list[int]
    fwd: list[float]
    bwd: list[float]
    # the launch each slice was added to: documents and tokens (0: not known; the fit then leaves f and beta out)
    launch_segments: int = 0
    launch_tokens: int = 0

    def __post_init__(self) -> None:
        n = len(self.q)
        if not (len(self.p) == len(self.fwd) == len(self.bwd) == n):
            raise ValueError(f"slice timings: q, p, fwd, bwd differ in length ({n}, {len(self.p)}, {len(self.fwd)}, "
                             f"{len(self.bwd)})")
        for i in range(n):
            if self.q[i] < 1 or self.p[i] < 0 or not (self.fwd[i] > 0 and self.bwd[i] > 0):
                raise ValueError(f"slice timings row {i}: expected q >= 1, p >= 0 and positive times, got "
                                 f"q={self.q[i]} p={self.p[i]} fwd={self.fwd[i]} bwd={self.bwd[i]}")


class SlicePass(msgspec.Struct, kw_only=True, frozen=True):
    x: float  # seconds per extra (query, key) pair, counted as 2*qt*p like the model's a
    y: float  # seconds per earlier key read, whatever q is
    pair_ratio: float  # x / the profile's a: 1.0 where the model's rule holds
    mape_pct: float  # of this fit over the rows with p > 0
    rule_mape_pct: float  # of the model's rule (x = a, y = 0) over the same rows
    floor: float = 0.0  # seconds per slice, whatever q and p (fitted only where the launch is known)
    assembly: float = 0.0  # seconds per (segment, token) of the launch assembling its key buffer (ditto)


class SliceTerm(msgspec.Struct, kw_only=True, frozen=True):
    tile: int
    fwd: SlicePass
    bwd: SlicePass
    rows: int  # rows with p > 0 the fit used
    dropped: int = 0  # rows with p > 0 left out: a time at or under the timer's resolution (`RESOLUTION_S`)


LAUNCH_COLUMNS = ("launch_segments", "launch_tokens")  # optional: the launch the slices were timed beside


def read_slice_csv(path: str | os.PathLike, *, launch: tuple[int, int] | None = None) -> SliceTimings:
    """A measured slice table (columns q, p, fwd_ms, bwd_ms, and the launch's documents and tokens where the
    timer wrote them); a bad cell names the file and line. `launch` (documents, tokens) stands in for columns a
    table written before them lacks."""
    q, p, f, b, seen = [], [], [], [], set()
    with open(path, newline="") as fh:
        reader = csv.DictReader(fh)
        missing = [c for c in SLICE_CSV_COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"{path}: missing column(s) {missing}; header is {reader.fieldnames}")
        has_launch = all(c in (reader.fieldnames or []) for c in LAUNCH_COLUMNS)
        for line, row in enumerate(reader, start=2):
            try:
                qi, pi, fi, bi = int(row["q"]), int(row["p"]), float(row["fwd_ms"]), float(row["bwd_ms"])
                if has_launch:
                    seen.add((int(row["launch_segments"]), int(row["launch_tokens"])))
            except (TypeError, ValueError):
                raise ValueError(f"{path}, line {line}: expected integers q, p (and launch_segments, launch_tokens) "
                                 f"and numbers fwd_ms, bwd_ms, got {row}") from None
            if qi < 1 or pi < 0 or not (fi > 0 and bi > 0):
                raise ValueError(f"{path}, line {line}: expected q >= 1, p >= 0 and positive times, got {row}")
            q.append(qi), p.append(pi), f.append(fi * 1e-3), b.append(bi * 1e-3)
    if len(seen) > 1:
        raise ValueError(f"{path}: expected one launch (launch_segments, launch_tokens) for every row, got {sorted(seen)}")
    s, t = seen.pop() if seen else (launch or (0, 0))
    return SliceTimings(q=q, p=p, fwd=f, bwd=b, launch_segments=s, launch_tokens=t)


def write_slice_csv(t: SliceTimings, path: str | os.PathLike) -> None:
    launch = t.launch_segments > 0
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(SLICE_CSV_COLUMNS + (LAUNCH_COLUMNS if launch else ()))
        for row in zip(t.q, t.p, t.fwd, t.bwd):
            extra = [t.launch_segments, t.launch_tokens] if launch else []
            w.writerow([row[0], row[1], f"{row[2] * 1e3:.6g}", f"{row[3] * 1e3:.6g}", *extra])


def _nnls(A: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with non-negative coefficients, exactly: the best of the unconstrained solutions on every
    subset of the (at most four) columns whose coefficients come out non-negative."""
    n = A.shape[1]
    best, err = np.zeros(n), float(y @ y)
    for subset in range(1, 1 << n):
        cols = [j for j in range(n) if subset >> j & 1]
        sol = np.linalg.lstsq(A[:, cols], y, rcond=None)[0]
        if (sol < 0).any():
            continue
        x = np.zeros(n)
        x[cols] = sol
        e = float(np.sum((A @ x - y) ** 2))
        if e < err - 1e-300:
            best, err = x, e
    return best


def _columns(q: np.ndarray, p: np.ndarray, tile: int, launch: tuple[int, int] | None) -> np.ndarray:
    """The fit's columns: x's pairs, y's keys, and where the launch is known f's slices and beta's (segment,
    token) count."""
    qt = np.ceil(q / tile) * tile
    cols = [2.0 * qt * p, p]
    if launch is not None:
        s, t = launch
        cols += [(p > 0).astype(np.float64), t + (s + 1) * q]
    return np.stack(cols, axis=1)


def _fit_pass(base: np.ndarray, rule: np.ndarray, meas: np.ndarray, q: np.ndarray, p: np.ndarray, tile: int,
              a: float, launch: tuple[int, int] | None = None) -> SlicePass:
    A = _columns(q, p, tile, launch)
    w = 1.0 / meas
    coef = _nnls(A * w[:, None], (meas - base) * w)
    pred = base + A @ coef
    sliced = p > 0
    mp = float(np.mean(np.abs(pred - meas)[sliced] / meas[sliced]) * 100)
    f, beta = (float(coef[2]), float(coef[3])) if launch is not None else (0.0, 0.0)
    return SlicePass(x=float(coef[0]), y=float(coef[1]), pair_ratio=float(coef[0] / a) if a > 0 else math.inf,
                     mape_pct=mp, rule_mape_pct=float(np.mean(np.abs(rule - meas)[sliced] / meas[sliced]) * 100),
                     floor=f, assembly=beta)


def fit_slice_term(profile: CostProfile, timings: SliceTimings, *, tile: int | None = None,
                   resolution_s: float = RESOLUTION_S) -> SliceTerm:
    """The slice term of `profile` fitted to `timings` (rows with p > 0; at least 2). The profile prices the
    whole-document part attn(q, 0); its tile is used unless `tile` is given or the profile's is 1, in which
    case the candidate with the smallest error is chosen. A slice's time is the difference of two launches, so
    a small slice can come out at or under `resolution_s` (noise, or clamped at 1 us): such rows would dominate a
    fit of relative errors and are left out, and counted. Where the table names its launch, the p = 0 rows join
    the fit (they settle the assembly term) and the per-slice floor and assembly are fitted too."""
    profile = msgspec.structs.replace(profile, slice_term=None)  # the rule, whatever term it carried
    q, p = np.asarray(timings.q, dtype=np.float64), np.asarray(timings.p, dtype=np.float64)
    launch = (timings.launch_segments, timings.launch_tokens) if timings.launch_segments > 0 else None
    sliced = p > 0
    timed = (np.asarray(timings.fwd) > resolution_s) & (np.asarray(timings.bwd) > resolution_s)
    rows = (sliced | (launch is not None)) & timed
    if (rows & sliced).sum() < 2:
        raise ValueError(f"the slice fit needs at least 2 rows with p > 0 and both times over {resolution_s:g} s, "
                         f"got {int((rows & sliced).sum())} of {int(sliced.sum())}")
    q, p = q[rows], p[rows]
    qi = q.astype(np.int64)
    model = CostModel(profile)
    base_f, base_b = model.segment_times(qi, np.zeros_like(qi))
    rule_f, rule_b = model.segment_times(qi, p.astype(np.int64))
    meas_f, meas_b = np.asarray(timings.fwd)[rows], np.asarray(timings.bwd)[rows]
    af, ab = profile.attn_fwd.a, profile.attn_bwd.a
    cands = [int(tile)] if tile is not None else ([profile.tile] if profile.tile > 1 else list(TILES))
    best = None
    for t in cands:
        f = _fit_pass(base_f, rule_f, meas_f, q, p, t, af, launch)
        b = _fit_pass(base_b, rule_b, meas_b, q, p, t, ab, launch)
        if best is None or f.mape_pct + b.mape_pct < best[1].mape_pct + best[2].mape_pct - 1e-12:
            best = (t, f, b)
    return SliceTerm(tile=best[0], fwd=best[1], bwd=best[2], rows=int((rows & sliced).sum()),
                     dropped=int(sliced.sum() - (rows & sliced).sum()))


def slice_coeffs(term: SliceTerm) -> SliceCoeffs:
    """The fitted term as the profile carries it."""
    return SliceCoeffs(tile=term.tile, x_fwd=term.fwd.x, y_fwd=term.fwd.y, x_bwd=term.bwd.x, y_bwd=term.bwd.y)


def with_slice_term(profile: CostProfile, term: SliceTerm) -> CostProfile:
    """`profile` pricing slices (p > 0) by the fitted term; its fit errors gain the term's MAPE and the rule's."""
    errors = dict(profile.fit_error)
    for name in ("fwd", "bwd"):
        s = getattr(term, name)
        errors[f"slice_{name}_mape_pct"] = s.mape_pct
        errors[f"slice_{name}_rule_mape_pct"] = s.rule_mape_pct
    return msgspec.structs.replace(profile, slice_term=slice_coeffs(term), fit_error=errors,
                                   source=f"{profile.source}; slice term fitted on {term.rows} slices".lstrip("; "))


def slice_times(profile: CostProfile, term: SliceTerm, q, p) -> tuple[np.ndarray, np.ndarray]:
    """(forward, backward) seconds of slices under the fitted term."""
    q = np.asarray(q, dtype=np.int64)
    p = np.asarray(p, dtype=np.int64)
    base_f, base_b = CostModel(profile).segment_times(q, np.zeros_like(q))
    qt = np.ceil(q / term.tile) * term.tile
    return (base_f + term.fwd.x * 2.0 * qt * p + term.fwd.y * p,
            base_b + term.bwd.x * 2.0 * qt * p + term.bwd.y * p)


def assembly_times(term: SliceTerm, segments: int, tokens: int) -> tuple[float, float]:
    """(forward, backward) seconds a launch of `segments` documents and `tokens` tokens that holds a slice paid
    to assemble its key buffer by per-segment indexing, as the table's runtime did (see the module docstring)."""
    n = float(segments) * float(tokens)
    return term.fwd.assembly * n, term.bwd.assembly * n


def scaled_timings(t: SliceTimings, factor: float) -> SliceTimings:
    """The table times `factor` (one layer's attention measured, a pipeline stage's layers priced)."""
    return SliceTimings(q=list(t.q), p=list(t.p), fwd=[x * factor for x in t.fwd], bwd=[x * factor for x in t.bwd],
                        launch_segments=t.launch_segments, launch_tokens=t.launch_tokens)


def format_slice_term(term: SliceTerm) -> str:
    left = f"; {term.dropped} under the timer's resolution left out" if term.dropped else ""
    lines = [f"slice term (tile {term.tile}, {term.rows} slices{left}): slice(q, p) = attn(q, 0) + x*2*qt*p + y*p"]
    for name in ("fwd", "bwd"):
        s = getattr(term, name)
        lines.append(f"  {name}: x={s.x:.4e} ({s.pair_ratio:.3g} x the model's per-pair rate) y={s.y:.4e} per key   "
                     f"MAPE {s.mape_pct:6.2f}%   the model's rule (x = a, y = 0): {s.rule_mape_pct:6.2f}%")
        if term.fwd.assembly or term.bwd.assembly or term.fwd.floor or term.bwd.floor:
            lines.append(f"        floor {s.floor * 1e3:.4f} ms per slice, key-buffer assembly {s.assembly * 1e9:.3g} ns "
                         "per (segment, token) of the launch (not priced: the runtime splits the keys once)")
    return "\n".join(lines)
