"""Digests of the plans the planners make for the benchmark's data sets (`benchmarks/planner.py`'s synthetic
length distributions), shared by `test_plan_digests.py` and the command that records them:

    PYTHONPATH=. python tests/helpers/plan_digests.py > tests/data/plan_digests.json  (then add back each "before" and "why")

A digest covers which pieces of which documents go to which micro-batch of which rank (costs left out), so a
change in what the planners balance shows up as a changed digest."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import sys
from pathlib import Path

import msgspec
import numpy as np

from packloader.balancers.draw import cut_pieces
from packloader.balancers.factory import make_planner
from packloader.contracts import ParallelConfig, PlanConfig, PlannerState

ROOT = Path(__file__).resolve().parents[2]
SYNTHETIC = ("synthetic-cc", "synthetic-github", "synthetic-longtail")
# the benchmark's two tokenized corpora (the Python 3.11.7 standard library, 1,758 files; /usr/share/doc and the man pages,
# their first 2,000 readable texts) depend on the machine, so their token lengths (benchmarks/planner.py's
# stdlib_lengths, docs_lengths) are kept in tests/data
RECORDED = ("stdlib", "docs")
DATASETS = SYNTHETIC + RECORDED
STRATEGIES = ("wlb", "hydraulis")
CPS = (1, 2, 4)
TOKENS_PER_STEP = 1 << 18


def synthetic(kind: str, n: int, seed: int):
    """The benchmark's own generator (benchmarks/planner.py), loaded by path: benchmarks/ is not a package."""
    spec = importlib.util.spec_from_file_location("_bench_planner", ROOT / "benchmarks" / "planner.py")
    mod = sys.modules.setdefault("_bench_planner", importlib.util.module_from_spec(spec))
    if hasattr(mod, "synthetic"):
        return mod.synthetic(kind, n, seed)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        spec.loader.exec_module(mod)  # type: ignore[union-attr]
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return mod.synthetic(kind, n, seed)


def digest(plan) -> str:
    layout = [[list(mb.segments) + [mb.dp_group] for mb in r.micro_batches] for r in plan.ranks]
    return hashlib.sha256(msgspec.json.encode([layout, plan.delayed])).hexdigest()[:16]


def digests() -> dict[str, str]:
    out = {}
    for ds in DATASETS:
        lengths = synthetic(ds, 2000, 0) if ds in SYNTHETIC else np.load(ROOT / "tests" / "data" / f"{ds}-lengths.npy")
        lengths = lengths[:int(np.searchsorted(np.cumsum(lengths), TOKENS_PER_STEP)) + 1]  # one step's draw
        for strategy in STRATEGIES:
            for cp in CPS:
                config = PlanConfig(strategy=strategy, parallel=ParallelConfig(dp=2, cp=cp, tp=2), max_tokens=16384 * cp,
                                    context=16384 * cp, tokens_per_step=TOKENS_PER_STEP)
                window = cut_pieces(np.arange(len(lengths)), lengths, config.context).window
                plan, _ = make_planner(config).plan(window, PlannerState(), 0)
                out[f"{ds}/{strategy}/cp{cp}"] = digest(plan)
    return out


if __name__ == "__main__":
    print(json.dumps(digests(), indent=1))
