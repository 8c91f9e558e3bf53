"""Compile the planners' numba kernels before the first real plan (`packloader warmup` calls this).

Every kernel is jitted with cache=True, so what this compiles is kept on disk and a later process loads it in
milliseconds. Without it the first `report --demo` or the first training step spends about 40 s of CPU compiling
(scripts/setup.sh runs `packloader warmup` once). Numba compiles per argument type, not per size, so small synthetic windows
planned by every registered strategy, with and without slices, pipeline stages and CP, reach the same kernels.
"""

from __future__ import annotations

import time

import msgspec
import numpy as np

from packloader.balancers.offline import plan_run
from packloader.balancers.planners.registry import available_strategies
from packloader.contracts import ParallelConfig, PlanConfig


def _layouts() -> list[PlanConfig]:
    base = PlanConfig(max_tokens=4096, context=8192, tokens_per_step=32768, allow_slicing=True)
    return [
        base,
        msgspec.structs.replace(base, context=4096, allow_slicing=False),
        msgspec.structs.replace(base, parallel=ParallelConfig(dp=2, pp=4)),
        msgspec.structs.replace(base, parallel=ParallelConfig(dp=2, pp=4, vpp=2), schedule="interleaved"),
        msgspec.structs.replace(base, parallel=ParallelConfig(dp=2, pp=4, vpp=2), schedule="zb-v"),
        msgspec.structs.replace(base, parallel=ParallelConfig(dp=2, pp=4), schedule="auto"),
        msgspec.structs.replace(base, parallel=ParallelConfig(dp=2, cp=2), cp_mode="auto"),
    ]


def warm_up(steps: int = 2) -> dict[str, float]:
    """Plan a few synthetic long-tail steps with each strategy on each layout; returns seconds per strategy. A
    strategy or layout a planner refuses is skipped: warming up must never stop a setup."""
    rng = np.random.default_rng(0)
    lengths = np.concatenate([rng.integers(16, 2048, 120), [20000, 9000, 5000]]).astype(np.int64)
    took: dict[str, float] = {}
    for name in available_strategies():
        t = time.perf_counter()
        for layout in _layouts():
            try:
                plan_run(lengths, msgspec.structs.replace(layout, strategy=name), steps)
            except Exception:  # noqa: BLE001 - a refused combination compiles nothing we need
                continue
        took[name] = time.perf_counter() - t
    return took

