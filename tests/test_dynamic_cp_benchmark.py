"""benchmarks/dynamic_cp.py's megatron-core column and bound on one small step: megatron's plan holds every
piece once (verify_plan inside), its barrier-closed groups take at least the per-GPU sums a plan's own scoring
gives, and the bound is at or above every plan priced as per-document CP."""

from __future__ import annotations

import sys
from argparse import Namespace
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("megatron.core")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import dynamic_cp as bench  # noqa: E402

from packloader.balancers.planners.doc_cp.price import DynamicCPCost, priced_dynamic  # noqa: E402
from packloader.balancers.sim.metrics import score_plan  # noqa: E402


def _args() -> Namespace:
    return Namespace(steps=1, tokens_per_step=1 << 19, model="llama3-8b", tp=8, cost="measured")


def _lengths() -> np.ndarray:
    rng = np.random.default_rng(26)
    return np.minimum(rng.pareto(1.0, 400) * 2000 + 16, bench.CONTEXT).astype(np.int64)


def test_dynamic_cp_benchmark_megatron_column_pays_its_barriers():
    args = _args()
    config = bench.config_for(4, 4, args, cp_mode="dynamic")
    lengths = _lengths()
    plan, pad = bench.megatron_hybrid_cp_plan(lengths[:60], config)
    assert pad == plan.extra["pad_tokens_required"] > 0  # every piece to a multiple of 2 x 4 x 4 x 8 = 256
    priced = priced_dynamic(plan, DynamicCPCost.for_config(config))
    sums = score_plan(priced, DynamicCPCost.for_config(config).model, config.parallel, use_plan_costs=True)
    assert bench.megatron_step_time(priced) >= sums.step_time * (1 - 1e-12)
    row = bench.run_dynamic(lengths, args, hook=bench.megatron_hybrid_cp_plan)
    assert row.time > 0 and row.padding > 0 and 0 <= row.idle < 1


def test_dynamic_cp_benchmark_bound_is_a_ceiling():
    args, lengths = _args(), _lengths()
    bound = bench.run_bound(lengths, args)
    rows = [bench.run_dynamic(lengths, args), bench.run_dynamic(lengths, args, hook=bench.megatron_hybrid_cp_plan)]
    assert all(r.tokens == bound.tokens for r in rows)
    assert all(r.rate <= bound.rate * (1 + 1e-9) for r in rows)
