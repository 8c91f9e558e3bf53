"""Part 5's plans re-priced offline (CPU): each strategy's steps of a GPU run planned again as the run planned
them, priced with the shipped H100 profile and with the profile calibrated on the run's GPU, and set against the
run's measured (simulated) step times. The gap the calibrated profile leaves is then fitted, on one strategy's
row, as a fixed cost per micro-batch per pipeline stage (a third forward, two thirds backward), and that one
number is checked on the other strategies' rows. Why a plan of many small micro-batches ran slower than priced.

    PYTHONPATH=$PWD python benchmarks/gpu/reprice_balance.py benchmarks/gpu/results/2026-11-26-h200
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import msgspec
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_common import long_tail_lengths  # noqa: E402

from packloader.balancers.cost import presets  # noqa: E402
from packloader.balancers.cost.measured import measured_profile  # noqa: E402
from packloader.balancers.cost.model import CostModel  # noqa: E402
from packloader.balancers.cost.profile_io import load_profile  # noqa: E402
from packloader.balancers.draw import draw_windows  # noqa: E402
from packloader.balancers.factory import make_planner  # noqa: E402
from packloader.balancers.sim.simulator import simulate_step  # noqa: E402
from packloader.contracts import ParallelConfig, PlanConfig, PlannerState  # noqa: E402


def plans_of(part: dict, row: dict, windows) -> list:
    s = part["setup"]
    cfg = PlanConfig(strategy=row["strategy"], parallel=ParallelConfig(dp=s["dp"], pp=s["pp"]), max_tokens=s["cap"],
                     context=s["cap"], tokens_per_step=s["tokens_per_step"], model=part.get("plan_model", "llama2-7b"),
                     device=part.get("plan_device", "h100"))
    planner, state, out = make_planner(cfg), PlannerState(), []
    for i in range(row["steps"]):
        plan, state = planner.plan(windows[i], state, i)
        out.append(plan)
    return out


def step_time(plans: list, cm: CostModel, par: ParallelConfig, overhead: float = 0.0) -> float:
    total = 0.0
    for plan in plans:
        priced = msgspec.convert(msgspec.to_builtins(plan), type(plan))
        for rank in priced.ranks:
            for mb in rank.micro_batches:
                f, b = cm.microbatch_times(mb)
                mb.fwd_cost, mb.bwd_cost = f + overhead / 3, b + 2 * overhead / 3
        total += simulate_step(priced, cm, par, use_plan_costs=True).step_time
    return total


def fit_overhead(plans: list, cm: CostModel, par: ParallelConfig, measured: float) -> float:
    """The per-micro-batch cost (s) that brings `plans` priced by `cm` to `measured`, by bisection."""
    lo, hi = 0.0, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if step_time(plans, cm, par, mid) < measured else (lo, mid)
    return (lo + hi) / 2


def reprice(folder: Path, fit_on: str = "auto") -> tuple[float, list[dict]]:
    """(the fitted per-micro-batch cost in s, one dict per strategy: step times in s and rank-0 imbalances)."""
    part = json.loads((folder / "gpu-proof.json").read_text())["parts"]["balance"]
    if str(part.get("plan_model", "")).endswith(".json"):  # planned with the run's calibrated stage profile
        part["plan_model"] = str(folder / Path(part["plan_model"]).name)
    s = part["setup"]
    par, shape = ParallelConfig(dp=s["dp"], pp=s["pp"]), presets.get_shape("llama2-7b")
    shipped = CostModel(measured_profile(shape, par, include_head=False))
    calibrated = CostModel(measured_profile(shape, par, base=load_profile(folder / "profile-llama2-7b.json"),
                                            include_head=False))
    rows = [r for r in part["rows"] if "error" not in r]
    windows = draw_windows(long_tail_lengths(200_000, 0, scale=s["scale"]), s["tokens_per_step"], s["cap"],
                           max(r["steps"] for r in rows), incomplete=False).windows
    plans = {r["strategy"]: plans_of(part, r, windows) for r in rows}
    fit_row = next(r for r in rows if r["strategy"] == fit_on)
    d = fit_overhead(plans[fit_on], calibrated, par, fit_row["step_time_measured_s"])
    out = []
    for r in rows:
        ps = plans[r["strategy"]]
        r0 = ps[0].ranks[0].micro_batches
        res = {"strategy": r["strategy"], "steps": r["steps"], "micro_batches": len(r0),
               "measured": r["step_time_measured_s"]}
        for key, cm, extra in (("shipped", shipped, 0.0), ("calibrated", calibrated, 0.0), ("fitted", calibrated, d)):
            t = np.array([sum(cm.microbatch_times(mb)) + extra for mb in r0])
            res[key], res[f"imbalance_{key}"] = step_time(ps, cm, par, extra), float(t.max() * len(t) / t.sum())
        out.append(res)
    return d, out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("results", help="a GPU run's folder: gpu-proof.json and profile-llama2-7b.json")
    p.add_argument("--fit-on", default="auto", help="the strategy whose row fits the per-micro-batch cost")
    args = p.parse_args(argv)
    d, rows = reprice(Path(args.results), args.fit_on)
    print(f"per-micro-batch cost fitted on {args.fit_on}: {d * 1e3:.1f} ms per micro-batch per stage")
    print("| strategy | steps | micro-batches / rank | measured s | shipped s | calibrated s | calibrated + fitted s |"
          " rank-0 imbalance shipped / calibrated / + fitted |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        cells = [f"{r[k]:.2f} ({r[k] / r['measured'] - 1:+.0%})" for k in ("shipped", "calibrated", "fitted")]
        imb = " / ".join(f"{r['imbalance_' + k]:.2f}" for k in ("shipped", "calibrated", "fitted"))
        print(f"| {r['strategy']} | {r['steps']} | {r['micro_batches']} | {r['measured']:.2f} | {' | '.join(cells)} | {imb} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
