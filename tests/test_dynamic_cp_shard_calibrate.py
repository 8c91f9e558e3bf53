"""Measuring the CP-shard overhead (`packloader calibrate --cp-shards`) on CPU with the reference backend: the
zigzag shards it times cover every query of the document exactly once and give each query run exactly its prefix
keys (checked from positions, not from the layout code), the token-weighted fit by hand, and the CLI's device file
loads and prices per-document CP."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch

from packloader.balancers.cost import devices
from packloader.balancers.cost.devices import load_device, read_device
from packloader.balancers.planners.doc_cp.price import DynamicCPCost
from packloader.contracts import ParallelConfig, PlanConfig
from packloader.runtime.calibrate import LayerShape
from packloader.runtime.calibrate_cp_shards import ShardRow, fit_overhead, shard_layout, time_cp_shards

TINY = LayerShape(hidden=32, heads=4, kv_heads=2, head_dim=8, ffn=64)


@pytest.mark.parametrize("length", [64, 100, 257])
@pytest.mark.parametrize("size", [2, 4, 8])
def test_dynamic_cp_shard_layout_covers_each_query_once_with_its_prefix_keys(length, size):
    seen = np.zeros(length, dtype=np.int64)
    for rank in range(size):
        lay = shard_layout(length, size, rank)
        seen[lay.query_index] += 1
        assert len(lay.cu_q) == len(lay.cu_k) and lay.cu_q[0] == lay.cu_k[0] == 0
        for b in range(len(lay.cu_q) - 1):
            qs = lay.query_index[lay.cu_q[b]:lay.cu_q[b + 1]]
            keys = lay.key_index[lay.cu_k[b]:lay.cu_k[b + 1]]
            assert np.array_equal(qs, np.arange(qs[0], qs[0] + len(qs)))  # a run is consecutive queries
            assert np.array_equal(keys, np.arange(0, qs[-1] + 1))  # and sees the document from 0 to its last query
        assert lay.max_q == int(np.diff(lay.cu_q).max()) and lay.max_k == int(np.diff(lay.cu_k).max())
    assert np.array_equal(seen, np.ones(length, dtype=np.int64))


def test_dynamic_cp_shard_layout_is_the_zigzag_by_hand():
    # 64 tokens over CP 4: 8 chunks of 8; rank 1 takes chunks 1 and 6 (tokens 8-15 and 48-55), seeing keys 0-15, 0-55
    lay = shard_layout(64, 4, 1)
    assert lay.query_index.tolist() == list(range(8, 16)) + list(range(48, 56))
    assert lay.cu_q.tolist() == [0, 8, 16] and lay.cu_k.tolist() == [0, 16, 72]


def test_dynamic_cp_shard_fit_is_token_weighted_by_hand():
    # CP 2: a 1000-token document whose slowest shard takes 0.6 of the whole (factor 1.2) and a 3000-token one at
    # 0.55 (1.1): (1000 x 1.2 + 3000 x 1.1) / 4000 = 1.125; backward 1.0 and 0.9 -> (1000 x 1.0 + 3000 x 0.9) / 4000
    # = 0.925, recorded as 1 (raw 0.925 kept); the mean rank (0.5 + 0.6) / 2 x 2 = 1.1 and 1.0
    rows = [ShardRow(1000, 2, 1.0, 2.0, [0.5, 0.6], [1.0, 0.9]), ShardRow(3000, 2, 1.0, 2.0, [0.5, 0.55], [0.9, 0.8])]
    overhead, raw = fit_overhead(rows, "by hand")
    assert raw[2]["fwd"] == pytest.approx(1.125) and raw[2]["bwd"] == pytest.approx(0.925)
    assert raw[2]["mean_fwd"] == pytest.approx((1000 * 1.1 + 3000 * 1.05) / 4000)
    assert overhead.fwd == {2: pytest.approx(1.125)} and overhead.bwd == {2: 1.0} and overhead.source == "by hand"
    with pytest.raises(ValueError, match="no shard timings"):
        fit_overhead([])


def test_dynamic_cp_shard_timing_runs_on_cpu():
    rows = time_cp_shards(TINY, [64, 128], [2, 4, 128], device=torch.device("cpu"), dtype=torch.float32,
                          backend="reference", repeats=1, warmup=0)
    assert [(r.length, r.size) for r in rows] == [(64, 2), (64, 4), (128, 2), (128, 4)]  # 128 > 128 // 2: skipped
    assert all(len(r.rank_fwd) == len(r.rank_bwd) == r.size and min(r.rank_fwd + r.rank_bwd) > 0 for r in rows)
    stopped = time_cp_shards(TINY, [64], [2], device=torch.device("cpu"), dtype=torch.float32, backend="reference",
                             repeats=1, warmup=0, stop=lambda: True)
    assert stopped == []


def test_dynamic_cp_shard_calibrate_cli_writes_a_loadable_device_file(tmp_path, monkeypatch):
    from packloader.cli.main import main

    out = tmp_path / "devs" / "cpu-shards.json"
    assert main(["calibrate", "--cp-shards", "--device", "cpu", "--hidden", "32", "--heads", "4", "--kv-heads", "2",
                 "--ffn", "64", "--max-len", "128", "--cp-sizes", "2,4", "--repeats", "1", "--warmup", "0",
                 "--backend", "reference", "--quiet", "--out", str(out)]) == 0
    dev, h100 = read_device(out), load_device("h100")
    assert dev.name == "cpu-shards" and dev.rates == h100.rates and dev.cp_link == h100.cp_link
    assert dev.measured_profile_path() == h100.measured_profile_path()
    assert set(dev.cp_shard.fwd) == set(dev.cp_shard.bwd) == {2, 4} and min(dev.cp_shard.fwd.values()) >= 1.0
    assert "cpu" in dev.cp_shard.source
    monkeypatch.setenv(devices.ENV_PATH, str(out.parent))
    monkeypatch.setattr(devices, "_REGISTERED", [])
    config = PlanConfig(parallel=ParallelConfig(dp=1, cp=4, tp=8), max_tokens=65536, context=65536, cp_mode="dynamic",
                        device="cpu-shards")
    cost = DynamicCPCost.for_config(config)  # a pool of 4: CP sizes 2 and 4, both in the file
    q, p, s = np.array([4096, 4096]), np.array([0, 0]), np.array([1, 4])
    fa, _ = cost.model.segment_times(q, p)
    c = cost.model.profile.attn_fwd.c
    assert cost.attention_share(q, p, s)[0] == pytest.approx([fa[0], (fa[1] - c) / 4 * dev.cp_shard.fwd[4] + c])
    with pytest.raises(ValueError, match=r"cpu-shards\.json: cp_shard\.fwd has no factor for CP size 8"):
        DynamicCPCost.for_config(msgspec.structs.replace(config, parallel=ParallelConfig(dp=2, cp=4, tp=8)))
