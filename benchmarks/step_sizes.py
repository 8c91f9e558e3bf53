"""Step sizes with outlier delay (issue 38 part 2): one document of 150 steps' tokens among 400 short ones
(tokens_per_step 8,192, context 2,048, DP 2), planned by `packloader plan`'s library side for each strategy, with
the budget rule (what a planner held back counts against the step, a short plan draws more) and without it
(`--before`: the rule patched out, as the draw and planners were). CPU only, about a minute.

    python benchmarks/step_sizes.py
"""

from __future__ import annotations

import argparse
import sys
from contextlib import ExitStack
from pathlib import Path
from unittest import mock

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers.docs import tail_with_giant  # noqa: E402

from packloader.balancers import offline  # noqa: E402
from packloader.balancers.planners import auto, wlb  # noqa: E402
from packloader.balancers.planners.registry import StepLayout  # noqa: E402
from packloader.contracts import ParallelConfig, PlanConfig  # noqa: E402

TPS, CONTEXT = 8192, 2048


def lengths() -> np.ndarray:
    return np.array([len(d) for d in tail_with_giant(400, 40.0, 2000, 200, 150 * TPS, seed=3)], np.int64)


def without_rule() -> ExitStack:
    """The draw and the planners as before the rule: draw tokens_per_step whatever is queued, never refill,
    nothing held for the budget."""
    def plain(planner, pieces, layout, model, *, drain=False):
        return planner.solve(pieces, StepLayout(layout.step, True, layout.micro_batches) if drain else layout, model)

    stack = ExitStack()
    stack.enter_context(mock.patch.object(offline, "draw_target", lambda tps, queued: tps))
    stack.enter_context(mock.patch.object(offline, "refill", lambda tps, planned, drawn: 0))
    stack.enter_context(mock.patch.object(wlb, "over_budget", lambda lengths, held, tps: np.zeros(len(lengths), bool)))
    stack.enter_context(mock.patch.object(auto, "solve_within_budget", plain))
    return stack


def sizes(strategy: str, lens: np.ndarray) -> list[int]:
    cfg = PlanConfig(strategy=strategy, parallel=ParallelConfig(dp=2), max_tokens=CONTEXT, context=CONTEXT,
                     tokens_per_step=TPS)
    run = offline.plan_run(lens, cfg, None)
    return [sum(mb.num_tokens for r in p.ranks for mb in r.micro_batches) for p in run.plans]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--strategies", default="auto,wlb,fixed")
    args = ap.parse_args(argv)
    lens = lengths()
    print(f"{len(lens)} documents, {int(lens.sum()):,} tokens (the longest {int(lens.max()):,})\n")
    print("| strategy | rule | steps | min tokens (all but the last) | max tokens (all but the last) | steps over "
          f"{TPS + CONTEXT - 1:,} | steps under {TPS:,} | last step |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for strategy in args.strategies.split(","):
        for label in ("before", "budget rule"):
            with without_rule() if label == "before" else ExitStack():
                s = sizes(strategy, lens)
            body = np.array(s[:-1])
            print(f"| {strategy} | {label} | {len(s)} | {body.min():,} | {body.max():,} | "
                  f"{int((body > TPS + CONTEXT - 1).sum())} | {int((body < TPS).sum())} | {s[-1]:,} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
