"""What `auto`'s imbalance degree costs in step time at DP 8 / PP 4 / TP 8 / 64K (issue 25): the simulated
1F1B step time of its plans against the time of the same ranks with every micro-batch at the rank's mean,
(m + pp - 1) x mean, the 1F1B time of equal micro-batches. The gap bounds what uneven micro-batches (and the
slice chains' first-in-last-out backward) cost; the imbalance degree (WLB-LLM: max micro-batch x count / total)
is only a stand-in for it.

    .venv/bin/python benchmarks/imbalance_cost.py

Data, draw and cost model as in `benchmarks/planner.py` (llama3-8b, the measured H100 profile, 4M tokens a
step, 20 steps)."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from planner import Setup, draw_stream, windows_for  # noqa: E402
from planning_speed import lengths_for  # noqa: E402

from packloader.balancers.cost.lookup import cost_model_for  # noqa: E402
from packloader.balancers.factory import make_planner  # noqa: E402
from packloader.balancers.sim.simulator import simulate_step  # noqa: E402
from packloader.contracts import ParallelConfig, PlanConfig, PlannerState  # noqa: E402


def run(dataset: str, steps: int, micro_batches: int | None, cache: Path) -> tuple[float, int, float, float]:
    """(mean imbalance degree, micro-batches per rank, step time / equal-micro-batch time, simulated time of
    the run's steps)."""
    pp, tokens = 4, 4 << 20
    windows = windows_for(draw_stream(lengths_for(dataset, cache), tokens * (steps + 1), seed=1),
                          Setup("dp8-pp4", 8, pp, 65536, tokens, steps), 65536)
    cfg = PlanConfig(strategy="auto", parallel=ParallelConfig(dp=8, pp=pp, tp=8), max_tokens=65536, context=65536,
                     tokens_per_step=tokens, model="llama3-8b", num_micro_batches=micro_batches)
    planner, model, state = make_planner(cfg), cost_model_for(cfg), PlannerState()
    imbalance, t_sim, t_equal = [], 0.0, 0.0
    for s, w in enumerate(windows):
        plan, state = planner.plan(w, state, s)
        sim = simulate_step(plan, model, cfg.parallel)
        costs = [np.array([mb.fwd_cost + mb.bwd_cost for mb in r.micro_batches]) for r in plan.ranks]
        m = len(costs[0])
        imbalance.append(max(c.max() * m / c.sum() for c in costs if c.sum() > 0))
        t_sim += max(r.step_time for r in sim.ranks)
        t_equal += max((m + pp - 1) * c.mean() for c in costs)
    return float(np.mean(imbalance)), m, t_sim / t_equal, t_sim


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--datasets", default="synthetic-cc,synthetic-github,synthetic-longtail,stdlib,docs")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "packloader-bench")
    args = ap.parse_args()
    print("| data set | auto's micro-batches | imbalance | step time / equal micro-batches | "
          "pinned to 32: imbalance | step time / equal | auto's step time / pinned 32's |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for ds in args.datasets.split(","):
        imb, m, ratio, t = run(ds, args.steps, None, args.cache)
        imb32, _, ratio32, t32 = run(ds, args.steps, 32, args.cache)
        print(f"| {ds} | {m} | {imb:.3f} | {ratio:.4f} | {imb32:.3f} | {ratio32:.4f} | {t / t32:.3f} |", flush=True)


if __name__ == "__main__":
    main()
