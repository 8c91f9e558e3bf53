"""Time of a micro-batch: attention per segment (quadratic, tile floor) plus linear work per token (with a
per-micro-batch floor), forward and backward separately.

The formula is the one `contracts.CostProfile` documents. With ``qt = ceil(q / tile) * tile``::

    attn(q, p) = a * (qt^2 + 2*qt*p) + b * qt + c        # a segment of q query tokens after p earlier keys
    lin(n)     = a * n^2 + b * n + c                      # a micro-batch of n tokens; c is its floor
    time(mb)   = sum over segments of attn(q_i, p_i) + lin(sum q_i)

``p = start - attend_from`` (0 for a whole document or an independent piece). Where the profile carries a
measured `LinTable`, lin(n) interpolates it instead (floor below its first count, the last per-token rate past
its last). The coefficients travel as a flat float64[NUM_COEFFS] array in `contracts.COEFF_LAYOUT` order so the
numba kernels (here and in the planners) take them without Python objects.

Three sources of profiles: the measured H100 profile shipped in packloader/profiles/ scaled to a preset's
shape and layout (`measured.measured_profile`, the default for a preset), the analytic one from device
constants (`presets.analytic_profile`, ``cost="analytic"``), and a calibration JSON (a msgspec `CostProfile`,
written by `packloader calibrate`). `load_cost_model` takes any of them.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Literal, Sequence

import msgspec
import numpy as np
from numba import njit

from packloader.contracts import COEFF_LAYOUT, MAX_LIN_KNOTS, CostProfile, LinTable, MicroBatch, ParallelConfig, Poly, StepPlan

# Offsets into the coefficient array (COEFF_LAYOUT).
TILE = 0
ATTN_FWD = 1
ATTN_BWD = 4
LIN_FWD = 7
LIN_BWD = 10
LIN_KNOTS = 13  # number of LinTable knots (0: the lin polynomials are the linear part)
LIN_TOK = 14
LIN_TFWD = LIN_TOK + MAX_LIN_KNOTS
LIN_TBWD = LIN_TOK + 2 * MAX_LIN_KNOTS
NUM_COEFFS = LIN_TOK + 3 * MAX_LIN_KNOTS

Cost = Literal["measured", "analytic"]


def profile_coeffs(profile: CostProfile) -> np.ndarray:
    """The profile as float64[NUM_COEFFS] in `COEFF_LAYOUT` order."""
    out = np.zeros(NUM_COEFFS, dtype=np.float64)
    out[TILE] = float(profile.tile)
    for off, poly in ((ATTN_FWD, profile.attn_fwd), (ATTN_BWD, profile.attn_bwd), (LIN_FWD, profile.lin_fwd), (LIN_BWD, profile.lin_bwd)):
        out[off], out[off + 1], out[off + 2] = poly.a, poly.b, poly.c
    t = profile.lin_table
    if t is not None:
        k = len(t.tokens)
        out[LIN_KNOTS] = k
        out[LIN_TOK:LIN_TOK + k] = t.tokens
        out[LIN_TFWD:LIN_TFWD + k] = t.fwd
        out[LIN_TBWD:LIN_TBWD + k] = t.bwd
    assert len(COEFF_LAYOUT) == NUM_COEFFS
    return out


# ----------------------------------------------------------------------------------------------- kernels


@njit(cache=True, inline="always")
def _round_tile(q, tile):
    if tile <= 1.0:
        return float(q)
    return math.ceil(q / tile) * tile


@njit(cache=True)
def attn_time(c, q, p, bwd):
    """Attention time of one segment: q query tokens attending causally to themselves and p earlier keys."""
    if q <= 0:
        return 0.0
    o = ATTN_BWD if bwd else ATTN_FWD
    qt = _round_tile(q, c[TILE])
    return c[o] * (qt * qt + 2.0 * qt * p) + c[o + 1] * qt + c[o + 2]


@njit(cache=True)
def lin_time(c, n, bwd):
    """Linear (GEMM + element-wise) time of a micro-batch of n tokens, including its floor."""
    x = float(n)
    k = int(c[LIN_KNOTS])
    if k > 0:
        t = LIN_TBWD if bwd else LIN_TFWD
        if x >= c[LIN_TOK + k - 1]:
            return c[t + k - 1] * x / c[LIN_TOK + k - 1]
        # from the top: planners mostly ask about micro-batches near the cap
        for i in range(k - 2, -1, -1):
            x0 = c[LIN_TOK + i]
            if x >= x0:
                x1 = c[LIN_TOK + i + 1]
                return c[t + i] + (c[t + i + 1] - c[t + i]) * (x - x0) / (x1 - x0)
        return c[t]
    o = LIN_BWD if bwd else LIN_FWD
    return c[o] * x * x + c[o + 1] * x + c[o + 2]


@njit(cache=True)
def lin_share(c, n, bwd):
    """A document's share of the linear part: the smooth polynomial without the floor (the per-token rate), so
    the shares of a micro-batch's documents add up to about its linear time less the floor."""
    o = LIN_BWD if bwd else LIN_FWD
    x = float(n)
    return c[o] * x * x + c[o + 1] * x


@njit(cache=True)
def lin_times(c, n, bwd):
    """lin_time of each of the (possibly fractional) token counts n."""
    out = np.empty(n.shape[0], dtype=np.float64)
    for i in range(n.shape[0]):
        out[i] = lin_time(c, n[i], bwd)
    return out


@njit(cache=True)
def microbatch_time(c, q, p):
    """(forward, backward) time of one micro-batch whose segments have q[i] query tokens after p[i] keys."""
    f = 0.0
    b = 0.0
    n = 0
    for i in range(q.shape[0]):
        f += attn_time(c, q[i], p[i], False)
        b += attn_time(c, q[i], p[i], True)
        n += q[i]
    return f + lin_time(c, n, False), b + lin_time(c, n, True)


@njit(cache=True)
def segment_times_kernel(c, q, p):
    """Attention-only forward and backward time of each segment."""
    m = q.shape[0]
    f = np.empty(m, dtype=np.float64)
    b = np.empty(m, dtype=np.float64)
    for i in range(m):
        f[i] = attn_time(c, q[i], p[i], False)
        b[i] = attn_time(c, q[i], p[i], True)
    return f, b


@njit(cache=True)
def doc_time_split(c, lengths):
    """Forward and backward workload of each length as a whole document: its attention plus its share of the
    linear part (`lin_share`: no floor). What a balancer sums over the documents of a micro-batch."""
    m = lengths.shape[0]
    f = np.empty(m, dtype=np.float64)
    b = np.empty(m, dtype=np.float64)
    for i in range(m):
        l = lengths[i]
        f[i] = attn_time(c, l, 0, False) + lin_share(c, l, False)
        b[i] = attn_time(c, l, 0, True) + lin_share(c, l, True)
    return f, b


@njit(cache=True)
def doc_time_kernel(c, lengths):
    """Forward + backward workload of each length (see doc_time_split)."""
    f, b = doc_time_split(c, lengths)
    return f + b


@njit(cache=True)
def microbatch_times_csr(c, q, p, offsets):
    """(forward, backward) time of many micro-batches at once: micro-batch k holds segments
    offsets[k]..offsets[k+1]-1 of the flat q, p arrays."""
    m = offsets.shape[0] - 1
    f = np.empty(m, dtype=np.float64)
    b = np.empty(m, dtype=np.float64)
    for k in range(m):
        fs = 0.0
        bs = 0.0
        n = 0
        for i in range(offsets[k], offsets[k + 1]):
            fs += attn_time(c, q[i], p[i], False)
            bs += attn_time(c, q[i], p[i], True)
            n += q[i]
        f[k] = fs + lin_time(c, n, False)
        b[k] = bs + lin_time(c, n, True)
    return f, b


@njit(cache=True)
def microbatch_times_by_id(c, q, p, mb, m):
    """`microbatch_times_csr` for segments given in any order with their micro-batch ids mb[i] (0..m-1):
    each micro-batch sums its segments in the order they come, so segments already grouped stably give the
    same sums as the CSR kernel, without the sort."""
    fs = np.zeros(m, dtype=np.float64)
    bs = np.zeros(m, dtype=np.float64)
    n = np.zeros(m, dtype=np.int64)
    for i in range(q.shape[0]):
        k = mb[i]
        fs[k] += attn_time(c, q[i], p[i], False)
        bs[k] += attn_time(c, q[i], p[i], True)
        n[k] += q[i]
    for k in range(m):
        fs[k] += lin_time(c, n[k], False)
        bs[k] += lin_time(c, n[k], True)
    return fs, bs


# ----------------------------------------------------------------------------------------------- model


def segments_arrays(mb: MicroBatch) -> tuple[np.ndarray, np.ndarray]:
    """(q, p) int64 arrays of a micro-batch's segments."""
    segs = mb.segments
    q = np.fromiter((s.end - s.start for s in segs), dtype=np.int64, count=len(segs))
    p = np.fromiter((s.start - s.attend_from for s in segs), dtype=np.int64, count=len(segs))
    return q, p


class CostModel:
    """A CostProfile with its flat coefficients and the Python-side conveniences around the kernels."""

    def __init__(self, profile: CostProfile) -> None:
        self.profile = profile
        self.coeffs = profile_coeffs(profile)

    def __repr__(self) -> str:
        return f"CostModel({self.profile.name!r}, tile={self.profile.tile}, max_tokens={self.profile.max_tokens})"

    @property
    def name(self) -> str:
        return self.profile.name

    def segment_times(self, q: np.ndarray, p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Attention-only forward and backward time of each segment (q query tokens after p earlier keys)."""
        q = np.ascontiguousarray(q, dtype=np.int64)
        p = np.ascontiguousarray(p, dtype=np.int64)
        if q.shape != p.shape:
            raise ValueError(f"q and p differ in shape: {q.shape} vs {p.shape}")
        return segment_times_kernel(self.coeffs, q, p)

    def microbatch_times(self, mb: MicroBatch) -> tuple[float, float]:
        """(forward, backward) seconds of a micro-batch on one pipeline stage of one rank.

        A DP-Merge micro-batch (dp_group of g ranks running it as context parallelism) costs each member
        1/g of the attention and the linear part of n/g tokens (ideal sharding), plus the full floor.
        """
        q, p = segments_arrays(mb)
        g = len(mb.dp_group) if mb.dp_group else 1
        if g <= 1:
            f, b = microbatch_time(self.coeffs, q, p)
            return float(f), float(b)
        fa, ba = segment_times_kernel(self.coeffs, q, p)
        n = float(q.sum()) / g
        return (
            float(fa.sum()) / g + float(lin_time(self.coeffs, n, False)),
            float(ba.sum()) / g + float(lin_time(self.coeffs, n, True)),
        )

    def microbatch_time_of(self, q: Sequence[int] | np.ndarray, p: Sequence[int] | np.ndarray | None = None) -> tuple[float, float]:
        """(forward, backward) of a micro-batch given as arrays; p defaults to zeros (whole documents)."""
        q = np.ascontiguousarray(q, dtype=np.int64)
        p = np.zeros_like(q) if p is None else np.ascontiguousarray(p, dtype=np.int64)
        f, b = microbatch_time(self.coeffs, q, p)
        return float(f), float(b)

    def doc_time(self, lengths: np.ndarray) -> np.ndarray:
        """Forward + backward of each length as its own micro-batch's attention + linear share (no floor)."""
        return doc_time_kernel(self.coeffs, np.ascontiguousarray(lengths, dtype=np.int64))

    def doc_time_split(self, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Forward and backward separately (see doc_time)."""
        return doc_time_split(self.coeffs, np.ascontiguousarray(lengths, dtype=np.int64))

    def floor(self) -> tuple[float, float]:
        """The per-micro-batch floor (forward, backward): the polynomials' c (for a measured table, the floor
        its polynomial summary puts under the per-token rate)."""
        return float(self.coeffs[LIN_FWD + 2]), float(self.coeffs[LIN_BWD + 2])

    def max_tokens(self) -> int | None:
        """Most tokens a micro-batch may hold on one rank given memory (None: no memory cap known)."""
        return self.profile.max_tokens

    def with_max_tokens(self, max_tokens: int | None) -> "CostModel":
        return CostModel(msgspec.structs.replace(self.profile, max_tokens=max_tokens))

    def scaled(self, factor: float) -> "CostModel":
        """The same model on a device `factor` times slower (heterogeneous ranks); floors scale too."""
        def s(poly: Poly) -> Poly:
            return Poly(poly.a * factor, poly.b * factor, poly.c * factor)

        pr = self.profile
        t = pr.lin_table
        table = None if t is None else LinTable(tokens=t.tokens, fwd=[x * factor for x in t.fwd], bwd=[x * factor for x in t.bwd])
        return CostModel(
            msgspec.structs.replace(
                pr, name=f"{pr.name}x{factor:g}", attn_fwd=s(pr.attn_fwd), attn_bwd=s(pr.attn_bwd),
                lin_fwd=s(pr.lin_fwd), lin_bwd=s(pr.lin_bwd), lin_table=table,
            )
        )

    def lin_time(self, n: float, bwd: bool = False) -> float:
        """Linear-part time of a micro-batch of n tokens (floor included)."""
        return float(lin_time(self.coeffs, float(n), bwd))


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


def profile_from_table(
    name: str,
    *,
    attn_lengths: np.ndarray,
    attn_fwd: np.ndarray,
    attn_bwd: np.ndarray,
    lin_tokens: np.ndarray,
    lin_fwd: np.ndarray,
    lin_bwd: np.ndarray,
    tile: int = 128,
    device: str = "measured",
    max_tokens: int | None = None,
    lin_table: bool = True,
    source: str = "",
) -> CostProfile:
    """A CostProfile fitted to a measured table: attention time of one causal document per length (lengths
    rounded up to the tile before fitting, as the model evaluates them; a*l^2 + b*l + c) and linear time of a
    micro-batch per token count, forward and backward. With `lin_table` (and at most MAX_LIN_KNOTS counts) the
    measured linear times become the profile's `LinTable` and the polynomials their smooth summary for the
    planners. `fit_error` records each part's largest relative error over the rows, as the model evaluates
    them (for a table: 0 at its own rows)."""
    qt = np.ceil(np.asarray(attn_lengths, dtype=np.float64) / tile) * tile
    af, ef_a = fit_poly(qt, attn_fwd)
    ab, eb_a = fit_poly(qt, attn_bwd)
    n = np.asarray(lin_tokens, dtype=np.float64)
    lf, ef_l = fit_poly(n, lin_fwd)
    lb, eb_l = fit_poly(n, lin_bwd)
    table = None
    if lin_table and 1 <= len(n) <= MAX_LIN_KNOTS:
        order = np.argsort(n, kind="stable")
        n = n[order]
        tf, tb = np.asarray(lin_fwd, np.float64)[order], np.asarray(lin_bwd, np.float64)[order]
        table = LinTable(tokens=n.tolist(), fwd=tf.tolist(), bwd=tb.tolist())
        lf, lb = _table_summary(n, tf), _table_summary(n, tb)
        ef_l = eb_l = 0.0
    return CostProfile(
        name=name, tile=tile, attn_fwd=af, attn_bwd=ab, lin_fwd=lf, lin_bwd=lb, device=device, max_tokens=max_tokens,
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


PROFILES_DIR = Path(__file__).resolve().parent.parent / "profiles"


def load_profile(path: str | os.PathLike) -> CostProfile:
    """A CostProfile from a JSON file (as `packloader calibrate` writes it); clear errors on a bad file."""
    data = Path(path).read_bytes()
    try:
        return msgspec.json.decode(data, type=CostProfile)
    except msgspec.ValidationError as e:
        raise ValueError(f"{path}: not a cost profile: {e}") from None
    except msgspec.DecodeError as e:
        raise ValueError(f"{path}: not valid JSON: {e}") from None


def save_profile(profile: CostProfile, path: str | os.PathLike) -> None:
    Path(path).write_bytes(msgspec.json.format(msgspec.json.encode(profile), indent=2) + b"\n")


def load_cost_model(
    spec: str | os.PathLike | CostProfile | CostModel,
    parallel: ParallelConfig | None = None,
    *,
    device: str = "h100",
    cost: Cost = "measured",
    memory_cap: bool = False,
    recompute: str = "selective",
) -> CostModel:
    """A CostModel from a preset name, a profile JSON path, or a profile name under packloader/profiles/.

    A preset is priced, with ``cost="measured"`` (the default) on an H100, by the measured H100 profile scaled
    to the preset's shape and `parallel` (`measured.measured_profile`); on an H200, for which no measurement
    ships, and with ``cost="analytic"``, by the analytic model (`presets.analytic_profile`); the profile's
    `source` says which. A JSON profile is taken as measured (it is already per stage for the configuration
    it was measured on; `parallel`, `device` and `cost` do not change it). With `memory_cap`, a preset's
    profile carries the memory model's token cap (Hydraulis MaxLen) for `parallel` on `device` (see
    memory.py); by default presets carry no cap and the planner's `max_tokens` is the only cap.
    """
    if isinstance(spec, CostModel):
        return spec
    if isinstance(spec, CostProfile):
        return CostModel(spec)
    from packloader.balancers import presets

    if cost not in ("measured", "analytic"):
        raise ValueError(f"unknown cost model {cost!r}; expected 'measured' or 'analytic'")
    text = os.fspath(spec)
    path = Path(text)
    if path.suffix == ".json" or path.exists():
        if not path.exists():
            raise FileNotFoundError(f"cost profile {text!r} does not exist")
        return CostModel(load_profile(path))
    bundled = PROFILES_DIR / f"{text}.json"
    if bundled.exists():
        return CostModel(load_profile(bundled))
    shape = presets.get_shape(text)
    dev = {"h100": presets.H100, "h200": presets.H200}.get(device.lower())
    if dev is None:
        raise ValueError(f"unknown device {device!r}; expected h100 or h200")
    cap = None
    if memory_cap:
        from packloader.balancers.memory import max_tokens_for_memory

        cap = max_tokens_for_memory(shape, parallel or ParallelConfig(), memory_gib=dev.memory_gib, recompute=recompute, tile=dev.tile)
        if cap < dev.tile:
            raise ValueError(
                f"{shape.name} does not fit on {dev.name} ({dev.memory_gib:g} GiB) under {parallel or ParallelConfig()}: "
                f"no room for a micro-batch of {dev.tile} tokens; use more tp/pp/dp or recompute='full'"
            )
    if cost == "measured" and device.lower() == "h100":
        from packloader.balancers.measured import measured_profile

        return CostModel(measured_profile(shape, parallel, max_tokens=cap))
    prof = presets.analytic_profile(shape, parallel, dev, max_tokens=cap)
    if cost == "measured":
        prof = msgspec.structs.replace(
            prof, source=f"analytic: no measured {device.upper()} profile ships; calibrate one with `packloader calibrate` "
                         f"and pass it as the model")
    return CostModel(prof)


def annotate_costs(plan: StepPlan, model: CostModel | Sequence[CostModel]) -> StepPlan:
    """Fill fwd_cost/bwd_cost of every micro-batch of `plan` (in place; the plan is returned).

    `model` is one CostModel for all ranks, or one per DP rank (heterogeneous ranks, e.g. `RankCosts.models`).
    """
    models = _per_rank(model, len(plan.ranks))
    for r, rank in enumerate(plan.ranks):
        m = models[r]
        for mb in rank.micro_batches:
            f, b = m.microbatch_times(mb)
            mb.fwd_cost = f
            mb.bwd_cost = b
    return plan


def _per_rank(model: object, dp: int) -> list[CostModel]:
    if isinstance(model, CostModel):
        return [model] * dp
    models = list(getattr(model, "models", model))  # RankCosts or a plain sequence
    if len(models) != dp:
        raise ValueError(f"{len(models)} cost models for {dp} DP ranks")
    return models
