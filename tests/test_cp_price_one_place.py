"""CP is priced in one place (`cost.cp_price`): a slower link there moves fixed CP's plans, the report and the
runtime's estimate together, by the hand-worked all-gather."""

from __future__ import annotations

import json

import numpy as np
import pytest

from packloader.balancers.cost import cp_price, lookup
from packloader.balancers.cost.resolve import load_cost_model
from packloader.balancers.factory import make_planner
from packloader.balancers.planners.registry import Window
from packloader.contracts import ParallelConfig, PlanConfig, PlannerState
from packloader.runtime.cp_cost import cp_cost

SLOW = 10.0  # the link made this many times slower


def slower(monkeypatch):
    real = cp_price.link_rates

    def link_rates(comm, s):
        bw, lat = real(comm, s)
        return bw / SLOW, lat

    monkeypatch.setattr(cp_price, "link_rates", link_rates)
    monkeypatch.setattr(lookup, "_MODELS", {})  # cost models are cached per process


def allgather_bytes_time(n: float, cp: int, tp: int, bw: float) -> float:
    """By hand: llama3-8b's K/V (32 layers, kv_dim 1024, bf16, K and V) over TP, (cp - 1) / cp of n tokens."""
    return (cp - 1) / cp * n * 2 * 1024 * 2 * 32 / tp / bw


def plan_costs() -> list[float]:
    config = PlanConfig(strategy="wlb", parallel=ParallelConfig(dp=2, cp=4, tp=2), max_tokens=32768, context=32768,
                        tokens_per_step=120000, allow_slicing=False)
    lengths = np.random.default_rng(7).integers(300, 6000, 60)
    plan, _ = make_planner(config).plan(Window.from_lengths(lengths), PlannerState(), 0)
    return [mb.fwd_cost for r in plan.ranks for mb in r.micro_batches if mb.segments]


def report_time(tmp_path, name: str) -> tuple[float, float]:
    from packloader.cli.main import main

    lengths = np.random.default_rng(4).integers(100, 3000, 40)
    np.save(tmp_path / "l.npy", lengths)
    out = tmp_path / name
    assert main(["report", "--lengths", str(tmp_path / "l.npy"), "--model", "llama3-8b", "--cp", "2", "--dp", "1",
                 "--tp", "1", "--pp", "1", "--max-tokens", "8192", "--context", "8192", "--tokens-per-step",
                 str(int(lengths.sum())), "--steps", "1", "--strategies", "wlb", "--out", str(out), "--no-plots",
                 "--no-advice", "--no-progress"]) == 0
    wlb = next(s for s in json.loads((out / "report.json").read_text())["strategies"] if s["name"] == "wlb")
    return wlb["step_time_total"], wlb["micro_batches_mean"]


def test_a_slower_link_in_cp_price_moves_plans_report_and_runtime_estimate(tmp_path, monkeypatch):
    monkeypatch.setattr(lookup, "_MODELS", {})
    n = 8192.0
    est = cp_cost(load_cost_model("llama3-8b", ParallelConfig(cp=4, tp=2))).linear(n)
    costs = plan_costs()
    t_report, m = report_time(tmp_path, "before")

    slower(monkeypatch)
    est_slow = cp_cost(load_cost_model("llama3-8b", ParallelConfig(cp=4, tp=2))).linear(n)
    costs_slow = plan_costs()
    t_report_slow, m_slow = report_time(tmp_path, "after")

    # runtime estimate (forward + backward): the volume term grows by SLOW x, latency unchanged (NVLink, 360 GB/s)
    want = 2 * (allgather_bytes_time(n, 4, 2, 360e9 / SLOW) - allgather_bytes_time(n, 4, 2, 360e9))
    assert est_slow - est == pytest.approx(want, rel=1e-9)
    # the planner balances the dearer price: every micro-batch of its plan costs more
    assert len(costs) == len(costs_slow) or costs != costs_slow
    assert min(costs_slow) > min(costs) and sum(costs_slow) > sum(costs)
    # the report reads the same price: its step time grows by the extra all-gather of every token, both ways
    assert m_slow == m
    tokens = int(np.random.default_rng(4).integers(100, 3000, 40).sum())
    extra = 2 * (allgather_bytes_time(tokens, 2, 1, 360e9 / SLOW) - allgather_bytes_time(tokens, 2, 1, 360e9))
    assert t_report_slow - t_report == pytest.approx(extra, rel=1e-6)
