"""`packloader warmup`: compile the planners' and the simulator's numba kernels now (a setup step), so the first
`report --demo` or training step does not spend a minute compiling. It runs a small report of the demo's layout
over synthetic long-tail lengths, every strategy and the advice, writing nothing, after every strategy has planned
a few steps on the other layouts (`balancers.warm_up`: pipeline schedules, vpp, CP); numba keeps what it compiled
in its cache (cli/kernel_cache.py says where)."""

from __future__ import annotations

import argparse
import time


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quiet", action="store_true", help="print nothing")


def run(args: argparse.Namespace) -> int:
    import numpy as np

    from packloader.balancers.warm_up import warm_up
    from packloader.cli.kernel_cache import kernels_cold
    from packloader.cli.report import DEMO
    from packloader.contracts import ParallelConfig, PlanConfig
    from packloader.report.build import ReportOptions, build_report
    from packloader.sources.lengths_file import Lengths

    start = time.perf_counter()
    cold = kernels_cold()
    rng = np.random.default_rng(0)  # a long tail, so pieces are cut, sliced and merged as in real reports
    lengths = np.minimum((rng.pareto(1.1, 3000) + 1) * 200, 40000).astype(np.int64)
    parallel = ParallelConfig(dp=DEMO["dp"], pp=DEMO["pp"], tp=DEMO["tp"])
    config = PlanConfig(parallel=parallel, max_tokens=8192, context=8192, model=DEMO["model"],
                        tokens_per_step=parallel.dp * 8192 * 4)
    build_report(Lengths(lengths, "warmup"), config, ReportOptions(steps=2, plots=False, progress=False,
                                                                    grid_steps=1))
    warm_up()
    if not args.quiet:
        state = "compiled" if cold else "already compiled; checked"
        print(f"packloader warmup: numba kernels {state} in {time.perf_counter() - start:.0f} s")
    return 0
