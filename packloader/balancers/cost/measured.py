"""Measured cost profiles scaled to a model shape and a parallel layout, and the fit of the shipped H100 one.

The timings (packloader/profiles/measured/*.csv) were taken on one NVIDIA H100 80GB HBM3 (SXM), torch 2.11 with
CUDA 13.0, bf16, on 2026-11-22: `torch.nn.attention.varlen.varlen_attn` causal with 32 heads x 128 (Llama-7B,
MHA), 32K-token packs of equal documents from 64 to 32K tokens; and one Llama-7B layer's GEMMs (QKV, O, gate+up,
down; hidden 4096, FFN 11008) plus SwiGLU at 256 to 64K tokens. `scripts/build_h100_profile.py` fits them into
packloader/profiles/h100-llama2-7b-layer.json (one layer, no LM head) with `build_profile`:

* attention per document: ``a*l^2 + b*l + c``, forward and backward separately (Hydraulis' form), fitted
  with residuals relative to the time; the per-pair rate of a 256-token document is about 3.9x that of a 32K
  one, which the b and c terms carry (a tile floor alone does not);
* linear part: the measured times as a `LinTable` (floor below 256 tokens, interpolated between, per-token
  past 64K), summarised by a per-token rate plus floor for the planners.

A device profile file names its measured one-layer profile and the preset whose layer was timed
(`devices.MeasuredKernels`; h100.json names this one). `measured_profile` scales a device's to a preset's
pipeline stage: attention by heads x head_dim over 32 x 128 and the
layers per stage, the (query, key) and per-token terms by TP x CP (each CP rank holds 1/cp of every document),
the per-document term by TP only (every CP rank still runs every document), the first two times the device's
measured CP-shard factor where its file has one (`cp_shard.shard_attention`); the linear table's times by the
layer's GEMM weights over Llama-7B's (FLOPs per token, and the weight reads the small-batch floor is made of)
divided by TP, its token counts by CP; plus, per token, what the measurement left out: the norms, rotary and
residual adds at HBM bandwidth (as `presets.analytic_profile` prices them) and the LM head's GEMM spread over
the stages at the measured GEMM rate. It builds the stage at CP 1 first and hands it to
`cp_shard.scale_profile_to_cp`, the same CP scaling a calibrated profile JSON gets in `resolve.load_cost_model`.
"""

from __future__ import annotations

import csv
import functools
import os
from pathlib import Path

import msgspec
import numpy as np

from packloader.balancers.cost import presets
from packloader.balancers.cost.cp_shard_attention import cp_shard_factors, factor_note, scale_profile_to_cp
from packloader.balancers.cost.devices import DEFAULT_DEVICE, Device, load_device
from packloader.balancers.cost.fit import Timings, choose_tile, profile_from_table
from packloader.balancers.cost.model import CostModel
from packloader.balancers.cost.profile_io import PROFILES_DIR, load_profile
from packloader.contracts import CostProfile, LinTable, ParallelConfig, Poly

PROFILE_NAME = "h100-llama2-7b-layer"  # what build_profile fits (h100.json's measured profile)
MEASURED_DIR = PROFILES_DIR / "measured"
ATTENTION_CSV = MEASURED_DIR / "h100-attention.csv"
LINEAR_CSV = MEASURED_DIR / "h100-linear.csv"
SOURCE = ("one NVIDIA H100 80GB HBM3 (SXM), torch 2.11 + CUDA 13.0, bf16, 2026-11-22: varlen_attn causal 32 heads x 128 "
          "in 32K-token packs; one Llama-7B layer's GEMMs (hidden 4096, FFN 11008) + SwiGLU")
MAX_FIT_ERROR = 0.03  # the largest relative error allowed on any measured row


def read_csv(path: str | os.PathLike, columns: tuple[str, ...]) -> np.ndarray:
    """The named columns of a measurement CSV as float64 rows; a missing column or a bad cell names the file and row."""
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in columns if c not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"{path}: missing column(s) {missing}; header is {reader.fieldnames}")
        rows = []
        for i, row in enumerate(reader, start=2):
            try:
                vals = [float(row[c]) for c in columns]
            except (TypeError, ValueError):
                raise ValueError(f"{path}, line {i}: expected numbers in {columns}, got {row}") from None
            if min(vals) <= 0:
                raise ValueError(f"{path}, line {i}: every value must be positive, got {row}")
            rows.append(vals)
    if len(rows) < 3:
        raise ValueError(f"{path}: at least 3 rows are needed, got {len(rows)}")
    return np.asarray(rows, dtype=np.float64)


def build_profile(attention_csv: str | os.PathLike = ATTENTION_CSV, linear_csv: str | os.PathLike = LINEAR_CSV) -> CostProfile:
    """The one-layer profile fitted to the two CSVs (times in ms there, seconds in the profile)."""
    att = read_csv(attention_csv, ("docs", "doc_len", "fwd_ms", "bwd_ms"))
    lin = read_csv(linear_csv, ("tokens", "fwd_ms", "bwd_ms"))
    lengths = att[:, 1].astype(np.int64)
    per_doc_f, per_doc_b = att[:, 2] / att[:, 0] * 1e-3, att[:, 3] / att[:, 0] * 1e-3
    tile = choose_tile(lengths, per_doc_f, per_doc_b)
    timings = Timings(lengths, per_doc_f, per_doc_b, lin[:, 0].astype(np.int64), lin[:, 1] * 1e-3, lin[:, 2] * 1e-3)
    prof = profile_from_table(PROFILE_NAME, timings, tile=tile, device="measured:h100-sxm-80gb/bf16", source=SOURCE)
    errors = row_errors(prof, attention_csv, linear_csv)
    return msgspec.structs.replace(prof, fit_error={part: float(max(abs(e) for e in errs)) for part, errs in errors.items()})


def row_errors(profile: CostProfile, attention_csv: str | os.PathLike = ATTENTION_CSV,
               linear_csv: str | os.PathLike = LINEAR_CSV) -> dict[str, list[float]]:
    """Relative error (model / measured - 1) of `profile` on every row of the CSVs, per part."""
    m = CostModel(profile)
    att = read_csv(attention_csv, ("docs", "doc_len", "fwd_ms", "bwd_ms"))
    lin = read_csv(linear_csv, ("tokens", "fwd_ms", "bwd_ms"))
    q = att[:, 1].astype(np.int64)
    f, b = m.segment_times(q, np.zeros_like(q))
    out = {
        "attn_fwd": (f * att[:, 0] / (att[:, 2] * 1e-3) - 1).tolist(),
        "attn_bwd": (b * att[:, 0] / (att[:, 3] * 1e-3) - 1).tolist(),
        "lin_fwd": [float(m.lin_time(n, False) / (t * 1e-3) - 1) for n, t in zip(lin[:, 0], lin[:, 1])],
        "lin_bwd": [float(m.lin_time(n, True) / (t * 1e-3) - 1) for n, t in zip(lin[:, 0], lin[:, 2])],
    }
    return out


@functools.lru_cache(maxsize=16)
def _load_cached(path: str) -> CostProfile:
    return load_profile(path)


def _device_with_measurements(device: Device) -> Device:
    if device.measured is None:
        raise ValueError(f"device {device.name!r} ({device.file}) has no measured profile; price it with the analytic model")
    return device


def base_profile(path: str | None = None) -> CostProfile:
    """The default device's measured one-layer profile (the shipped H100 one), or the one at `path`."""
    return _load_cached(str(path or _device_with_measurements(load_device(DEFAULT_DEVICE)).measured_profile_path()))


def measured_profile(
    shape: presets.ModelShape,
    parallel: ParallelConfig | None = None,
    *,
    base: CostProfile | None = None,
    include_head: bool = True,
    layers: float | None = None,
    head_fraction: float | None = None,
    memory_cap: int | None = None,
    device: Device | None = None,
) -> CostProfile:
    """Per-pipeline-stage profile of `shape` under `parallel`, from `device`'s measured one-layer profile (default:
    the default device's; `base` replaces the profile, not the device's reference shape and bandwidth; see the
    module docstring for each scale factor). `layers`, `include_head` and `head_fraction` as in
    `presets.analytic_profile`."""
    parallel = parallel or ParallelConfig()
    device = _device_with_measurements(device or load_device(DEFAULT_DEVICE))
    base = base or _load_cached(str(device.measured_profile_path()))
    ref = presets.get_shape(device.measured.shape)  # type: ignore[union-attr]
    L = presets.layers_per_stage(shape, parallel) if layers is None else float(layers)
    tp, cp = parallel.tp, parallel.cp
    fa = shape.heads * shape.head_dim / (ref.heads * ref.head_dim) * L / tp

    fl = shape.linear_params_per_layer() / ref.linear_params_per_layer() * L / tp
    # per token: element-wise kernels the GEMM timing left out, and the LM head at the measured GEMM rate per weight
    dev = device.rates
    swiglu = (3 if shape.gated_mlp else 2) * shape.ffn * 2
    ew = (shape.elementwise_bytes_per_token_per_layer() - swiglu) * L / tp / (dev.hbm_tbps * 1e12)
    head_params = shape.vocab * shape.hidden * (head_fraction if head_fraction is not None else (1.0 / parallel.pp if include_head else 0.0)) / tp
    rate_f = base.lin_fwd.b / ref.linear_params_per_layer()
    rate_b = base.lin_bwd.b / ref.linear_params_per_layer()
    extra_f = ew + head_params * rate_f
    extra_b = 2.0 * ew + head_params * rate_b

    def attn(p: Poly) -> Poly:
        return Poly(p.a * fa, p.b * fa, p.c * fa)

    def lin(p: Poly, extra: float) -> Poly:
        return Poly(p.a * fl, p.b * fl + extra, p.c * fl)

    table = None
    if base.lin_table is not None:
        t = base.lin_table
        table = LinTable(tokens=list(t.tokens), fwd=[fl * x + extra_f * n for n, x in zip(t.tokens, t.fwd)],
                         bwd=[fl * x + extra_b * n for n, x in zip(t.tokens, t.bwd)])
    one_gpu = CostProfile(  # the stage on one GPU (CP 1), then each CP rank's share of it
        name=base.name, tile=base.tile, attn_fwd=attn(base.attn_fwd), attn_bwd=attn(base.attn_bwd),
        lin_fwd=lin(base.lin_fwd, extra_f), lin_bwd=lin(base.lin_bwd, extra_b), device=base.device,
        fit_error=dict(base.fit_error), lin_table=table,
        slice_term=None if base.slice_term is None else base.slice_term.scaled(fa))
    note = factor_note(cp, *cp_shard_factors(device, cp))  # "" without the device's measured CP-shard overhead
    par = f"tp{tp}-cp{cp}-pp{parallel.pp}"
    return msgspec.structs.replace(
        scale_profile_to_cp(one_gpu, cp, device), name=f"{shape.name}@{device.name}-measured/{par}", memory_cap=memory_cap,
        source=f"measured ({base.source}); scaled to {shape.name} {par}: attention x{fa:.4g}, linear x{fl:.4g}"
               + (f"; {note}" if note else ""),
    )


def measured_stage_profiles(shape: presets.ModelShape, parallel: ParallelConfig | None = None,
                            device: Device | None = None) -> list[CostProfile]:
    """One measured profile per pipeline stage (its own layer count, the LM head on the last stage), as
    `presets.analytic_stage_profiles`."""
    parallel = parallel or ParallelConfig()
    out = []
    for s, n in enumerate(presets.stage_layers(shape, parallel.pp)):
        pr = measured_profile(shape, parallel, layers=n, head_fraction=1.0 if s == parallel.pp - 1 else 0.0, device=device)
        out.append(msgspec.structs.replace(pr, name=f"{pr.name}/stage{s}"))
    return out


def profile_path() -> Path:
    """Where `build_profile`'s fit ships (the h100 device file's measured profile)."""
    return PROFILES_DIR / f"{PROFILE_NAME}.json"
