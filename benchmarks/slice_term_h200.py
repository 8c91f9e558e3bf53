"""The slice term on the first GPU proof's measurements (H200, benchmarks/gpu/results/2026-11-26-h200), offline:
fit it on part 3's slice table against the calibrated one-layer profile (as part 3 does), then price part 4's
four measured slice packs (2 layers: one slice beside 48 documents of 512 tokens) with the profile under the
rule and with the term. No GPU needed; tests/test_slice_term.py checks the same figures.

    python benchmarks/slice_term_h200.py            # the first run
    python benchmarks/slice_term_h200.py run3       # the quick run after the runtime's slice path was adopted
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import msgspec
import numpy as np

from packloader.balancers.cost.model import CostModel
from packloader.balancers.cost.profile_io import load_profile
from packloader.balancers.cost.slice_fit import fit_slice_term, format_slice_term, read_slice_csv, with_slice_term

RESULTS = Path(__file__).resolve().parent / "gpu" / "results" / "2026-11-26-h200"
PACKS = ((4096, 28672), (8192, 57344), (144, 65536), (1024, 131072))  # part_accuracy.packs' slices
FILL = [512] * 48


def main(run: str = "") -> None:
    prof = msgspec.structs.replace(load_profile(RESULTS / run / "profile-llama2-7b.json"), slice_term=None)
    term = fit_slice_term(prof, read_slice_csv(RESULTS / run / "slices.csv"))
    print(format_slice_term(term))
    acc = json.loads((RESULTS / run / "gpu-proof.json").read_text())["parts"]["accuracy"]
    rows = [r for r in acc["rows"] if r["kind"] == "slices"]
    rule, termed = CostModel(prof).scaled(2.0), CostModel(with_slice_term(prof, term)).scaled(2.0)
    print("\n| slice q | after p keys | measured ms | rule ms | rule err | term ms | term err |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    er, et = [], []
    for row, (q, p) in zip(rows, PACKS):
        qs, ps = [q] + FILL, [p] + [0] * len(FILL)
        m = row["measured_ms"]
        r, t = sum(rule.microbatch_time_of(qs, ps)) * 1e3, sum(termed.microbatch_time_of(qs, ps)) * 1e3
        er.append((r - m) / m)
        et.append((t - m) / m)
        print(f"| {q} | {p} | {m:.1f} | {r:.1f} | {er[-1] * 100:+.1f} % | {t:.1f} | {et[-1] * 100:+.1f} % |")
    print(f"\nMAPE: rule {np.mean(np.abs(er)) * 100:.1f} %, term {np.mean(np.abs(et)) * 100:.1f} %")


if __name__ == "__main__":
    main(*sys.argv[1:2])
