"""Part 8, CP shards: how much slower than 1/s of a document one GPU's CP shard of it runs, on this one GPU
(`packloader.runtime.calibrate_cp_shards`, what `packloader calibrate --cp-shards` runs). For documents of 128K,
64K, 32K and 16K tokens (longest first: a budget cut keeps the ones that weigh most) and CP sizes 2, 4, 8 and 16,
one layer's attention (the main shape, forward and backward) on the whole document and on every rank's zigzag
shard against its prefix keys; the slowest rank's time x s over the whole document's is the factor the cost model
needs (`Device.cp_shard`: fixed and per-document CP both price shards with it). Writes OUT/device-cp-shards.json,
the h100 file with the fitted `cp_shard`, for `benchmarks/dynamic_cp.py` and `dynamic_cp_breakeven.py` to price
with (issue 26's 1.15x hangs on it: docs/dynamic-cp.md). The dry run: tiny shapes, documents of 128 and 64
tokens, CP 2 and 4."""

from __future__ import annotations

from pathlib import Path

from gpu_common import Budget, BudgetExceeded, Ctx

from packloader.balancers.cost.devices import load_device
from packloader.runtime.calibrate_cp import write_device
from packloader.runtime.calibrate_cp_shards import (
    GPU_LENGTHS,
    GPU_SIZES,
    device_with_cp_shard,
    fit_overhead,
    time_cp_shards,
)

DRY_LENGTHS = (128, 64)
DRY_SIZES = (2, 4)


def run(ctx: Ctx, budget: Budget, out_dir: Path) -> dict:
    shape = ctx.main_shape()
    lengths, sizes = (DRY_LENGTHS, DRY_SIZES) if ctx.dry_run else (GPU_LENGTHS, GPU_SIZES)
    rows = time_cp_shards(shape, lengths, sizes, device=ctx.device, dtype=ctx.dtype, backend=ctx.backend,
                          repeats=ctx.repeats, warmup=ctx.warmup, progress=print, stop=lambda: budget.left() <= 0)
    if not rows:
        raise BudgetExceeded(f"time budget of {budget.seconds:.0f} s spent before the first shard was timed")
    source = (f"benchmarks/gpu/part_cp_shards.py on {ctx.device.type}, {str(ctx.dtype).removeprefix('torch.')}, "
              f"{shape.name}, documents of {', '.join(str(n) for n in sorted({r.length for r in rows}))} tokens")
    overhead, raw = fit_overhead(rows, source)
    out = Path(out_dir) / "device-cp-shards.json"
    write_device(device_with_cp_shard(load_device("h100"), overhead, name=out.stem), out)
    return {"shape": shape.name, "device_file": out.name, "sizes_planned": list(sizes), "lengths_planned": list(lengths),
            "factors": {str(s): f for s, f in raw.items()},
            "rows": [{"length": r.length, "size": r.size, "whole_fwd_ms": r.whole_fwd * 1e3,
                      "whole_bwd_ms": r.whole_bwd * 1e3, **r.factors()} for r in rows]}
