"""What the planner-contract check (`balancers.planners.contract.check_step_plan`, issue 35) costs next to
planning: every step's plan is checked before it reaches a batch or a file, so its time is added to each step's
planning. Planners and sizes: `fixed` (token counts only, the cheapest planner: the check's worst ratio), `wlb`,
`hydraulis`, `slimpack` and `auto` on the planner benchmark's synthetic long-tail lengths (`benchmarks/planner.py`),
llama3-8b on the measured H100 profile at TP 8, at DP 8 x PP 4 with 1M tokens a step and at DP 64 with 4M.

    .venv/bin/python benchmarks/plan_check.py --write docs/benchmarks.md

Each configuration plans `--steps` consecutive steps after one untimed warm-up plan (numba compilation) and checks
each, timing both with the process's CPU time (on a shared machine the wall time grows with the load, the CPU
time of these single-threaded calls hardly does); the ratio is check time over planning time, step by step,
in the same run."""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import platform
import shlex
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from planner import Setup, draw_stream, synthetic, windows_for  # noqa: E402
from sections import write_section  # noqa: E402

from packloader.balancers.factory import make_planner
from packloader.balancers.planners.contract import check_step_plan  # noqa: E402
from packloader.balancers.planners.registry import StepLayout  # noqa: E402
from packloader.contracts import ParallelConfig, PlanConfig, PlannerState  # noqa: E402

SECTION = "plan_check"
CAP = 65536
SETUPS = {"dp8-pp4-1M": (8, 4, 1 << 20), "dp64-4M": (64, 1, 4 << 20)}
STRATEGIES = ("fixed", "wlb", "hydraulis", "slimpack", "auto")


def run(strategy: str, setup: str, steps: int, lengths: np.ndarray) -> dict:
    dp, pp, tokens = SETUPS[setup]
    s = Setup(setup, dp, pp, CAP, tokens, steps + 1)
    windows = windows_for(draw_stream(lengths, tokens * (steps + 2), seed=1), s, CAP)
    cfg = PlanConfig(strategy=strategy, parallel=ParallelConfig(dp=dp, pp=pp, tp=8), max_tokens=CAP, context=CAP,
                     tokens_per_step=tokens, allow_slicing=strategy in ("slimpack", "auto"), model="llama3-8b")
    planner = make_planner(cfg)
    planner.plan(windows[-1], PlannerState(), 0)  # warm-up
    state, plan_ms, check_ms, segments = PlannerState(), [], [], []
    for k, w in enumerate(windows[:steps]):
        layout = StepLayout(k, flush=k == steps - 1)
        c0 = time.process_time()
        plan, after = planner.plan(w, state, layout)
        c1 = time.process_time()
        check_step_plan(plan, w, state, after, cfg, layout)
        c2 = time.process_time()
        plan_ms.append((c1 - c0) * 1e3)
        check_ms.append((c2 - c1) * 1e3)
        segments.append(sum(len(mb.segments) for r in plan.ranks for mb in r.micro_batches))
        state = after
    ratio = [c / max(p, 1e-6) for c, p in zip(check_ms, plan_ms)]
    return {"strategy": strategy, "setup": setup, "pieces": int(np.mean([len(w.doc) for w in windows[:steps]])),
            "segments": int(np.mean(segments)), "plan_ms": float(np.median(plan_ms)),
            "check_ms": float(np.median(check_ms)), "ratio": float(np.median(ratio)), "ratio_max": float(max(ratio))}


def report(rows: list[dict], argv: list[str], load: float) -> str:
    cmd = ".venv/bin/python benchmarks/plan_check.py " + " ".join(shlex.quote(a) for a in argv)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    when = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "Every step's plan is checked against the planner contract before it reaches a batch or a file "
        "(`check_step_plan`: coverage of every drawn and queued token, the cap, slice order, equal micro-batch "
        "counts). Its cost next to planning, per step, CPU time, medians over the steps (`benchmarks/plan_check.py`'s "
        "docstring says what a run does):",
        "",
        "```bash",
        cmd,
        "```",
        "",
        f"Measured {when} on {platform.machine()} with {cpus} CPUs (load average {load:.1f} at the start; shared).",
        "",
        "| strategy | layout, tokens a step | pieces a step | segments a step | planning ms | check ms | check / planning (median, max) |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(f"| {r['strategy']} | {r['setup']} | {r['pieces']:,} | {r['segments']:,} | {r['plan_ms']:.1f} | "
                     f"{r['check_ms']:.1f} | {r['ratio']:.3f}, {r['ratio_max']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--setups", default=",".join(SETUPS))
    p.add_argument("--write", default=None, help="markdown file whose plan_check section gets the results")
    args = p.parse_args(argv)
    load = os.getloadavg()[0]
    lengths = synthetic("synthetic-longtail", 200_000, seed=0)
    rows = []
    for setup in args.setups.split(","):
        for strategy in args.strategies.split(","):
            r = run(strategy, setup, args.steps, lengths)
            rows.append(r)
            print(f"{strategy} {setup}: {r['pieces']} pieces, plan {r['plan_ms']:.1f} ms, check {r['check_ms']:.1f} ms, "
                  f"ratio {r['ratio']:.3f} (max {r['ratio_max']:.3f})", flush=True)
    body = report(rows, argv if argv is not None else sys.argv[1:], load)
    print(body)
    if args.write:
        write_section(Path(args.write), SECTION, "The planner-contract check: its cost next to planning", body)


if __name__ == "__main__":
    main()
