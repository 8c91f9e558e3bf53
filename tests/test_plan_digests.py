"""Which plans changed when fixed CP's traffic entered planning (issue 34), and why: the digests of the planners'
plans for the benchmark's five data sets (`helpers/plan_digests.py`) against those recorded in
tests/data/plan_digests.json. An entry with a "before" changed in that issue, its "why" says why; the rest
(every CP 1 plan) did not change. With the CP link made free in `cost.cp_price`, every changed plan is again the
one recorded before: the traffic is the only cause."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.plan_digests import digests

from packloader.balancers.cost import cp_price, lookup

RECORDED = json.loads((Path(__file__).parent / "data" / "plan_digests.json").read_text())


@pytest.fixture(autouse=True)
def fresh_models(monkeypatch):
    monkeypatch.setattr(lookup, "_MODELS", {})  # cost models are cached per process


def test_plans_match_the_recorded_digests():
    got = digests()
    assert got.keys() == RECORDED.keys()
    assert {k: v for k, v in got.items() if v != RECORDED[k]["digest"]} == {}
    changed = {k for k, e in RECORDED.items() if "before" in e}
    assert all(RECORDED[k]["why"] for k in changed)
    assert changed == {k for k in RECORDED if not k.endswith("/cp1")}  # only CP > 1 plans carry CP traffic


def test_without_cp_traffic_the_changed_plans_are_those_before(monkeypatch):
    monkeypatch.setattr(cp_price, "link_rates", lambda comm, s: (float("inf"), 0.0))
    got = digests()
    assert got == {k: e.get("before", e["digest"]) for k, e in RECORDED.items()}
