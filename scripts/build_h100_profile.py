"""Build packloader/profiles/h100-llama2-7b-layer.json from the measured H100 timings in the repository.

    .venv/bin/python scripts/build_h100_profile.py            # writes the profile, prints the fit on every row
    .venv/bin/python scripts/build_h100_profile.py --check    # fails if the shipped file differs or a row is off

Source: packloader/profiles/measured/h100-attention.csv and h100-linear.csv, timings taken on one NVIDIA H100
80GB HBM3 (SXM), torch 2.11 with CUDA 13.0, bf16, on 2026-11-22 (median of 20 runs after 5 warm-up runs):
`torch.nn.attention.varlen.varlen_attn`, causal, 32 heads x 128 (Llama-7B, MHA), each row a 32,768-token pack
of `docs` equal documents of `doc_len` tokens; and one Llama-7B layer's GEMMs (QKV, O, gate+up, down; hidden
4096, FFN 11008) plus SwiGLU at `tokens` tokens. The fit is `packloader.balancers.cost.measured.build_profile`.
"""

from __future__ import annotations

import argparse
import math
import sys

import msgspec


def _same(a, b, rel: float = 1e-9) -> bool:
    """Equal but for floats, which may differ in their last bits between BLAS builds (the least-squares fit)."""
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, (int, float)) and isinstance(b, (int, float)) and math.isclose(a, b, rel_tol=rel, abs_tol=1e-18)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k], rel) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y, rel) for x, y in zip(a, b))
    return a == b


def main(argv: list[str] | None = None) -> int:
    from packloader.balancers.cost.fit import fit_poly
    from packloader.balancers.cost.measured import (
        ATTENTION_CSV,
        LINEAR_CSV,
        MAX_FIT_ERROR,
        build_profile,
        profile_path,
        read_csv,
        row_errors,
    )
    from packloader.balancers.cost.profile_io import save_profile

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(profile_path()), help="where to write the profile JSON")
    ap.add_argument("--check", action="store_true",
                    help="do not write; fail if --out differs from a fresh build (floats beyond a relative 1e-9)")
    args = ap.parse_args(argv)

    prof = build_profile()
    errors = row_errors(prof)
    att = read_csv(ATTENTION_CSV, ("docs", "doc_len", "fwd_ms", "bwd_ms"))
    lin = read_csv(LINEAR_CSV, ("tokens", "fwd_ms", "bwd_ms"))
    print(f"source: {ATTENTION_CSV.name}, {LINEAR_CSV.name} ({prof.source})")
    print(f"tile {prof.tile}; attention per document a*l^2 + b*l + c (s):")
    for part in ("attn_fwd", "attn_bwd"):
        p = getattr(prof, part)
        print(f"  {part}: a={p.a:.6e} b={p.b:.6e} c={p.c:.6e}")
    print("attention rows (a 32K pack of equal documents): model / measured - 1")
    for (docs, l, f, b), ef, eb in zip(att, errors["attn_fwd"], errors["attn_bwd"]):
        print(f"  {int(docs):4d} x {int(l):6d}  fwd {f:8.3f} ms {100 * ef:+6.2f}%   bwd {b:8.3f} ms {100 * eb:+6.2f}%")
    print("linear rows (one layer's GEMMs + SwiGLU; a measured table, floor below its first row):")
    for (n, f, b), ef, eb in zip(lin, errors["lin_fwd"], errors["lin_bwd"]):
        print(f"  {int(n):6d} tokens  fwd {f:8.3f} ms {100 * ef:+6.2f}%   bwd {b:8.3f} ms {100 * eb:+6.2f}%")
    for part, col in (("lin_fwd", 1), ("lin_bwd", 2)):
        _, e = fit_poly(lin[:, 0], lin[:, col] * 1e-3)
        p = getattr(prof, part)
        print(f"  {part} summary for the planners' per-document workload: {p.b * 1e6:.4f} us/token + floor "
              f"{p.c * 1e3:.4f} ms; the best a*n^2 + b*n + c alone would be off by up to {100 * e:.1f}% on these rows, "
              f"hence the table")
    worst = max(max(abs(x) for x in v) for v in errors.values())
    print(f"largest error on any measured row: {100 * worst:.2f}% (allowed {100 * MAX_FIT_ERROR:.0f}%)")
    if worst > MAX_FIT_ERROR:
        print("FAILED: a row is off by more than allowed", file=sys.stderr)
        return 1
    if args.check:
        from packloader.balancers.cost.profile_io import load_profile

        shipped = load_profile(args.out)
        if not _same(msgspec.to_builtins(shipped), msgspec.to_builtins(prof)):
            print(f"FAILED: {args.out} differs from a fresh build; rerun without --check", file=sys.stderr)
            return 1
        print(f"{args.out} matches a fresh build")
        return 0
    save_profile(prof, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
