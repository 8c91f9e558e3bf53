"""benchmarks/dynamic_cp.py's what-if devices (--cp-shard-factor, --cp-link-scale) and the break-even sweep's
crossing, by hand."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import dynamic_cp as bench  # noqa: E402
import dynamic_cp_breakeven as breakeven  # noqa: E402

from packloader.balancers.cost import devices  # noqa: E402
from packloader.balancers.cost.devices import load_device  # noqa: E402


@pytest.fixture
def isolated(monkeypatch):
    monkeypatch.setattr(devices, "_REGISTERED", [])


def test_dynamic_cp_what_if_device_scales_shards_and_links(tmp_path, isolated):
    assert bench.what_if_device(None, None, tmp_path) == "h100"
    h100 = load_device("h100")
    dev = load_device(bench.what_if_device(1.2, 4.0, tmp_path))
    assert dev.cp_shard.fwd == dev.cp_shard.bwd == {2: 1.2, 4: 1.2, 8: 1.2, 16: 1.2}
    assert dev.cp_link.inter_node_gbps == h100.cp_link.inter_node_gbps / 4 == 11.25
    assert dev.cp_link.intra_node_gbps == 90.0 and dev.cp_link.inter_node_latency_us == h100.cp_link.inter_node_latency_us
    assert (dev.rates, dev.measured_profile_path()) == (h100.rates, h100.measured_profile_path())
    links = load_device(bench.what_if_device(None, 2.0, tmp_path))
    assert links.cp_shard is None and links.cp_link.inter_node_gbps == 22.5


def _pt(factor: float, ratio: float) -> breakeven.Point:
    return breakeven.Point(4 << 20, factor, 1.0, "fixed CP 4", 100.0, 100.0 * ratio, 100.0 * ratio)


def test_dynamic_cp_breakeven_crossing_by_hand():
    # 1.10x at 1.1, 1.20x at 1.3: 1.15 is half way, at 1.2
    assert breakeven.crossing([_pt(1.3, 1.2), _pt(1.0, 1.0), _pt(1.1, 1.1)], "dynamic") == "1.200"
    assert breakeven.crossing([_pt(1.0, 1.16), _pt(1.1, 1.2)], "auto") == "<= 1.00 (already 1.160x)"
    assert breakeven.crossing([_pt(1.0, 1.0), _pt(1.3, 1.1)], "dynamic") == "> 1.30 (1.100x there)"
