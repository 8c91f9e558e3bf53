"""The attention one GPU spends on its CP shard of a document, for fixed CP (`scale_profile_to_cp`, which prices
measured presets and calibrated profile JSONs; the analytic profile in `resolve`) and per-document CP
(`DynamicCPCost.attention_share`) alike.

A document sharded over s GPUs costs each of them (attn - c) / s x factor + c: its (query, key) and per-token
terms divided by s, the per-document term c paid in full by every GPU that runs the document, and `factor` (>= 1)
what the device file's `cp_shard` (`devices.CPShardOverhead`) measured of a zigzag shard's kernels against the
whole document's: two short query chunks against long prefixes run below the whole document's rate, and the CP
ranks wait for the slowest one every layer. Without `cp_shard` the factor is 1 (today's ideal 1/s pricing).
"""

from __future__ import annotations

import msgspec
import numpy as np

from packloader.balancers.cost.devices import CPShardOverhead, Device
from packloader.contracts import CostProfile, LinTable, Poly, SliceCoeffs


def cp_shard_factors(device: Device | None, s: int) -> tuple[float, float]:
    """(forward, backward) factor of a CP shard at size s on `device`: 1 at s = 1 or without `cp_shard`; a size the
    file does not list is an error naming the file and the field."""
    s = int(s)
    if s <= 1 or device is None or device.cp_shard is None:
        return 1.0, 1.0
    ov = device.cp_shard
    missing = [name for name in ("fwd", "bwd") if s not in getattr(ov, name)]
    if missing:
        where = device.file or device.name
        raise ValueError(f"device profile {where}: cp_shard.{missing[0]} has no factor for CP size {s} (it lists "
                         f"{sorted(getattr(ov, missing[0]))}); measure it with `packloader calibrate --cp-shards` or "
                         f"add \"{s}\" to cp_shard.fwd and cp_shard.bwd")
    return float(ov.fwd[s]), float(ov.bwd[s])


def shard_attention(whole, per_doc, s, factor):
    """One GPU's attention of a document (or segment) whose whole attention is `whole` seconds, `per_doc` of it the
    per-document term every GPU of the shard pays, over s GPUs, at the measured `factor`."""
    return (whole - per_doc) / s * factor + per_doc


def size_factors(device: Device | None, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`cp_shard_factors` of every entry of `sizes` (arrays, for the per-document CP planner's segments)."""
    sizes = np.asarray(sizes, dtype=np.int64)
    f, b = np.ones(sizes.shape), np.ones(sizes.shape)
    if device is None or device.cp_shard is None:
        return f, b
    for s in np.unique(sizes[sizes > 1]).tolist():
        k = sizes == s
        f[k], b[k] = cp_shard_factors(device, s)
    return f, b


def scale_profile_to_cp(profile: CostProfile, cp: int, device: Device | None = None) -> CostProfile:
    """One GPU's stage profile at fixed CP size `cp` from `profile`, one GPU's stage at CP 1 (a calibrated JSON, or
    `measured_profile`'s before CP): a micro-batch of n tokens puts n / cp of every document on each CP rank.

    Attention a, b (and the slice term) are shared by the CP ranks, times the device's shard factor at `cp`; c is
    paid in full by every rank (`shard_attention`); the linear part runs on n / cp tokens, lin(n / cp): a / cp^2,
    b / cp, c as is, `lin_table` token counts times cp; a memory cap (tokens one GPU holds) times cp, the tokens
    a CP micro-batch may hold. At cp 1 the profile comes back unchanged."""
    cp = int(cp)
    if cp < 1:
        raise ValueError(f"CP size must be >= 1, got {cp}")
    if cp == 1:
        return profile
    ff, fb = cp_shard_factors(device, cp)

    def attn(p: Poly, f: float) -> Poly:
        return Poly(shard_attention(p.a, 0.0, cp, f), shard_attention(p.b, 0.0, cp, f), p.c)

    def lin(p: Poly) -> Poly:
        return Poly(p.a / (cp * cp), p.b / cp, p.c)

    t = profile.lin_table
    table = None if t is None else LinTable(tokens=[n * cp for n in t.tokens], fwd=list(t.fwd), bwd=list(t.bwd))
    term = None if profile.slice_term is None else scaled_slice_term(profile.slice_term.scaled(1.0 / cp), ff, fb)
    note = factor_note(cp, ff, fb)
    return msgspec.structs.replace(
        profile, attn_fwd=attn(profile.attn_fwd, ff), attn_bwd=attn(profile.attn_bwd, fb), lin_fwd=lin(profile.lin_fwd),
        lin_bwd=lin(profile.lin_bwd), lin_table=table, slice_term=term,
        memory_cap=None if profile.memory_cap is None else profile.memory_cap * cp,
        source=(profile.source + f"; scaled to CP {cp} per GPU" + (f" ({note})" if note else "")).lstrip("; "))


def with_cp_shard(profile: CostProfile, device: Device | None, cp: int) -> CostProfile:
    """An already CP-scaled profile (attention a, b divided by cp) with the device's shard factor at `cp` on its
    attention (a, b and the slice term; c stays: every CP rank pays it once): for profiles built without
    `shard_attention`, as the analytic one is."""
    ff, fb = cp_shard_factors(device, cp)
    if ff == 1.0 and fb == 1.0:
        return profile

    def scale(p: Poly, f: float) -> Poly:
        return Poly(p.a * f, p.b * f, p.c)

    return msgspec.structs.replace(profile, attn_fwd=scale(profile.attn_fwd, ff), attn_bwd=scale(profile.attn_bwd, fb),
                                   slice_term=scaled_slice_term(profile.slice_term, ff, fb),
                                   source=(profile.source + "; " + factor_note(cp, ff, fb)).lstrip("; "))


def scaled_slice_term(term: SliceCoeffs | None, ff: float, fb: float) -> SliceCoeffs | None:
    """A slice term with its forward terms times ff and backward terms times fb (a slice's extra keys are
    attention of the shard too)."""
    if term is None or (ff == 1.0 and fb == 1.0):
        return term
    return msgspec.structs.replace(term, x_fwd=term.x_fwd * ff, y_fwd=term.y_fwd * ff, x_bwd=term.x_bwd * fb,
                                   y_bwd=term.y_bwd * fb)


def factor_note(cp: int, ff: float, fb: float) -> str:
    """What a profile's `source` says of the shard factor it carries ("" at 1)."""
    return "" if ff == 1.0 and fb == 1.0 else f"CP {cp} shard attention x{ff:.4g} fwd, x{fb:.4g} bwd (device cp_shard)"


def uniform_overhead(factor: float, sizes: tuple[int, ...] = (2, 4, 8, 16), source: str = "") -> CPShardOverhead:
    """One factor, forward and backward, for every CP size in `sizes` (what-if pricing: a slower shard kernel)."""
    table = {int(s): float(factor) for s in sizes}
    return CPShardOverhead(fwd=table, bwd=dict(table), source=source or f"assumed: x{factor:g} at every CP size")
