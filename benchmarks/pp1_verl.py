"""PP 1 against verl (issue 38 part 3): `auto` and verl's Karmarkar-Karp (`karmarkar_karp`) on independent long-tail
corpora (benchmarks/planner.py's synthetic-longtail, one seed each) at DP 16, PP 1, TP 8, 64K cap and context,
llama3-8b under the measured H100 profile; efficiency against the no-bubble ideal (`sim.metrics`), per step and
over the run. CPU only.

    python benchmarks/pp1_verl.py --steps 3                          # 4M tokens per step
    python benchmarks/pp1_verl.py --steps 6 --tokens-per-step 1048576
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from planner import synthetic  # noqa: E402

from packloader.balancers.cost.lookup import cost_model_for
from packloader.balancers.draw import draw_windows  # noqa: E402
from packloader.balancers.factory import make_planner
from packloader.balancers.planners.registry import StepLayout  # noqa: E402
from packloader.balancers.sim.metrics import score_plans  # noqa: E402
from packloader.contracts import ParallelConfig, PlanConfig, PlannerState  # noqa: E402


def run(lengths, strategy: str, steps: int, tps: int) -> tuple[float, list[float]]:
    cfg = PlanConfig(strategy=strategy, parallel=ParallelConfig(dp=16, pp=1, tp=8), max_tokens=65536, context=65536,
                     tokens_per_step=tps, model="llama3-8b", cost="measured")
    windows = draw_windows(lengths, tps, 65536, steps, incomplete=False).windows
    planner, state, plans = make_planner(cfg), PlannerState(), []
    for i, w in enumerate(windows):
        plan, state = planner.plan(w, state, StepLayout(i, flush=i == len(windows) - 1))
        plans.append(plan)
    per, total = score_plans(plans, cost_model_for(cfg), cfg.parallel, max_tokens=65536)
    return total.efficiency, [p.efficiency for p in per]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--tokens-per-step", type=int, default=4 << 20)
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    args = ap.parse_args(argv)
    print("| corpus seed | strategy | efficiency (run) | per step |")
    print("| --- | --- | ---: | --- |")
    for seed in args.seeds:
        lengths = synthetic("synthetic-longtail", 40000, seed)
        for strategy in ("auto", "karmarkar_karp"):
            eff, per = run(lengths, strategy, args.steps, args.tokens_per_step)
            print(f"| {seed} | {strategy} | {eff:.4f} | {' / '.join(f'{x:.4f}' for x in per)} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
