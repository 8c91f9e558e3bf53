"""Simulated step time of `auto`'s plans under 1F1B, ZB-H1 and `--schedule auto`, and with two model chunks per
pipeline rank (vpp 2) under interleaved 1F1B, its zero-bubble form (ZB-H1 at vpp 2), ZB-V and `--schedule auto`
(issue 25, item 3), at the planner benchmark's dp8-pp4 setup (DP 8, PP 4, TP 8, 64K cap and context, 4M tokens
per step, the measured H100 profile):

    .venv/bin/python benchmarks/schedules.py --write docs/benchmarks.md

Each data set of `benchmarks/planner.py` (the same seeded draws and steps) is planned by `auto` once per row, with
`PlanConfig.schedule` "1f1b", "zb-h1" and "auto" at vpp 1, "interleaved", "zb-h1", "zb-v" and "auto" at vpp 2, and scored
with `metrics.score_plans` under the same schedule (`auto`: the one the planner chose per step) and with auto's
memory model. Figures: simulated efficiency against the no-bubble ideal (the work spread over every GPU with none
idle / simulated step time, over the run), the same plans simulated under the zero-bubble schedule of their vpp
(ZB-H1, ZB-V: the schedule alone, same packing), how many steps `auto` gave each schedule, the highest simulated peak
memory of one GPU against the device's usable limit, and planning time per step (wall clock, after one warm-up
plan).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import platform
import shlex
import sys
import time
from collections import Counter
from pathlib import Path

import msgspec
import numpy as np
from planner import Setup, draw_stream, synthetic, windows_for  # benchmarks/, this folder
from sections import write_section

from packloader.balancers.cost.lookup import cost_model_for
from packloader.balancers.factory import make_planner
from packloader.balancers.sim.metrics import drawn_steps, score_plans
from packloader.contracts import ParallelConfig, PlanConfig, PlannerState

SECTION = "schedules"
DATASETS = ["synthetic-cc", "synthetic-github", "synthetic-longtail"]
SCHEDULES = [(1, "1f1b"), (1, "zb-h1"), (1, "auto"), (2, "interleaved"), (2, "zb-h1"), (2, "zb-v"), (2, "auto")]
ZERO_BUBBLE = {1: "zb-h1", 2: "zb-v"}  # the zero-bubble schedule of each vpp


class Row(msgspec.Struct):
    dataset: str
    schedule: str
    vpp: int
    efficiency: float
    efficiency_zb_same_plans: float
    chosen: str  # under --schedule auto: how many steps chose each schedule
    steps: int
    peak_gib: float
    limit_gib: float
    plan_ms: float


def run(dataset: str, schedule: str, windows, setup: Setup, tp: int, vpp: int = 1) -> Row:
    cfg = PlanConfig(strategy="auto", parallel=ParallelConfig(dp=setup.dp, pp=setup.pp, tp=tp, vpp=vpp), max_tokens=setup.cap,
                     context=setup.cap, tokens_per_step=setup.tokens_per_step, schedule=schedule)
    planner = make_planner(cfg)
    planner.plan(windows[0], PlannerState(), 0)  # warm-up: numba compilation
    state, plans, times = PlannerState(), [], []
    for s, w in enumerate(windows):
        t0 = time.perf_counter()
        plan, state = planner.plan(w, state, s)
        times.append(time.perf_counter() - t0)
        plans.append(plan)
    model = cost_model_for(cfg)
    drawn = drawn_steps(windows)
    _, own = score_plans(plans, model, cfg.parallel, max_tokens=setup.cap, schedule=schedule, drawn=drawn,
                         memory=planner.memory)
    zero = ZERO_BUBBLE[vpp]
    _, zb = score_plans(plans, model, cfg.parallel, max_tokens=setup.cap, schedule=zero, drawn=drawn)
    counts = Counter(p.schedule for p in plans if p.schedule)
    chosen = ", ".join(f"{k} {n}/{len(plans)}" for k, n in sorted(counts.items())) if schedule == "auto" else "-"
    return Row(dataset, schedule, vpp, own.efficiency, zb.efficiency, chosen, len(plans),
               own.peak_bytes / 1024**3, planner.mem_limit / 1024**3, 1e3 * float(np.mean(times)))


def report(rows: list[Row], argv: list[str], setup: Setup, tp: int) -> str:
    when = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    lines = [
        f"Measured {when} on {platform.machine()} with {len(os.sched_getaffinity(0))} CPUs usable, load average "
        f"{load:.1f} at the end; `auto`, cost model `llama3-8b` measured (H100 timings), DP {setup.dp} / PP {setup.pp} / "
        f"TP {tp}, {setup.cap // 1024}K cap and context, {setup.tokens_per_step / 2**20:.0f}M tokens per step, "
        f"{setup.steps} steps; the data sets and draws of the planner benchmark:",
        "",
        "```",
        "$ " + shlex.join([".venv/bin/python", "benchmarks/schedules.py", *argv]),
        "```",
        "",
        "ZB-H1 splits each backward into the input gradient (B) and the weight gradient (W, half the linear "
        "backward) and runs the Ws in 1F1B's bubbles (`packloader/balancers/sim/kernels.py`). At vpp 2 each pipeline "
        "rank holds two model chunks: interleaved 1F1B places them as stages r and r + 4 (Megatron's and torch's "
        "order; zb-h1 there is torch's ScheduleInterleavedZeroBubble: the same placement with split backwards), "
        "ZB-V as r and 7 - r with split backwards (torch's ScheduleZBVZeroBubble order, "
        "`packloader/balancers/sim/zbv.py`). \"Zero-bubble, same plans\" simulates the steps planned for the row's "
        "schedule under the zero-bubble schedule of its vpp (ZB-H1 at vpp 1, ZB-V at vpp 2): the schedule's gain "
        "alone. \"auto chose\" counts the steps per schedule `--schedule auto` chose. Efficiency is against the "
        "no-bubble ideal. Where a sliced document's backward order runs a micro-batch before ZB-V's order has run "
        "its forward, every rank runs all its forwards there (`zbv.py`): more activations live at once, which the "
        "peak column counts (the LM head and logits on rank 0, where the V puts the last stage).",
        "",
        "| data set | vpp | schedule | efficiency | zero-bubble, same plans | auto chose | peak / limit GiB | "
        "plan ms/step |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(f"| {r.dataset} | {r.vpp} | {r.schedule} | {r.efficiency:.3f} | {r.efficiency_zb_same_plans:.3f} | "
                     f"{r.chosen} | {r.peak_gib:.1f} / {r.limit_gib:.1f} | {r.plan_ms:.1f} |")
    auto = [r for r in rows if r.schedule == "auto"]
    ok = all(r.efficiency >= 0.95 and r.peak_gib <= r.limit_gib for r in auto)
    lines += ["", f"Issue 25's target, efficiency >= 0.95 with `--schedule auto` and peak memory within the limit: "
                  f"**{'met' if ok else 'not met'}** ("
              + ", ".join(f"{r.dataset} vpp {r.vpp} {r.efficiency:.3f}" for r in auto) + ")."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--datasets", nargs="+", default=DATASETS)
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vpp", type=int, nargs="+", default=[1, 2], help="the vpp rows to run")
    ap.add_argument("--write", type=Path, default=None, help="replace the schedules section of this markdown file")
    args = ap.parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    setup = Setup("dp8-pp4", 8, 4, 65536, 4 << 20, args.steps)
    rows = []
    for ds in args.datasets:
        lengths = synthetic(ds, 200_000, args.seed)
        stream = draw_stream(lengths, setup.tokens_per_step * (setup.steps + 1), args.seed)
        windows = windows_for(stream, setup, setup.cap)
        for vpp, sched in [x for x in SCHEDULES if x[0] in args.vpp]:
            rows.append(run(ds, sched, windows, setup, args.tp, vpp))
            r = rows[-1]
            print(f"{ds} vpp {vpp} {sched}: efficiency {r.efficiency:.3f}, zero-bubble same plans "
                  f"{r.efficiency_zb_same_plans:.3f}, auto chose {r.chosen}, "
                  f"peak {r.peak_gib:.1f}/{r.limit_gib:.1f} GiB, "
                  f"{r.plan_ms:.1f} ms/step", file=sys.stderr)
    text = report(rows, argv, setup, args.tp)
    print(text)
    if args.write:
        write_section(args.write, SECTION, "Pipeline schedules: 1F1B, ZB-H1, interleaved 1F1B, interleaved zero bubble and ZB-V", text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
