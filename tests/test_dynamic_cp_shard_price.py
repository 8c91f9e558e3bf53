"""A measured CP-shard overhead (`Device.cp_shard`) prices fixed and per-document CP alike: a hand-worked example
of both prices, a fixed CP 4 plan's attention rising by exactly the factor, a device without it (or with every
factor 1) pricing exactly as before, and a CP size the file lacks naming the file and the field."""

from __future__ import annotations

import json

import msgspec
import numpy as np
import pytest

from packloader.balancers.cost import devices, presets
from packloader.balancers.cost.cp_comm import cp_comm_for
from packloader.balancers.cost.cp_shard_attention import cp_shard_factors, uniform_overhead
from packloader.balancers.cost.devices import CPShardOverhead, load_device, read_device
from packloader.balancers.cost.measured import base_profile, measured_profile
from packloader.balancers.cost.model import CostModel
from packloader.balancers.cost.resolve import load_cost_model
from packloader.balancers.offline import plan_run
from packloader.balancers.planners.doc_cp.price import DynamicCPCost
from packloader.contracts import CostProfile, ParallelConfig, PlanConfig, Poly

SHARD = CPShardOverhead(fwd={2: 1.5, 4: 1.25, 8: 1.1, 16: 1.05}, bwd={2: 1.4, 4: 1.2, 8: 1.1, 16: 1.05})


def _device_file(folder, name: str, cp_shard: CPShardOverhead | None, base: str = "h100"):
    """A copy of a shipped device file under another name, with `cp_shard` set (the measured profile re-pointed)."""
    from packloader.runtime.calibrate_cp import write_device

    dev = msgspec.structs.replace(load_device(base), name=name, cp_shard=cp_shard)
    path = folder / f"{name}.json"
    write_device(dev, path)
    return path


@pytest.fixture
def shard_devices(tmp_path, monkeypatch):
    folder = tmp_path / "devices"
    _device_file(folder, "h100shard", SHARD)
    _device_file(folder, "h100ones", uniform_overhead(1.0))
    _device_file(folder, "h200shard", SHARD, base="h200")  # analytic: no measured kernels
    _device_file(folder, "h100half", CPShardOverhead(fwd={2: 1.5}, bwd={2: 1.4}))
    monkeypatch.setenv(devices.ENV_PATH, str(folder))
    monkeypatch.setattr(devices, "_REGISTERED", [])
    return folder


def _toy_model() -> CostModel:
    return CostModel(CostProfile(name="toy", tile=128, attn_fwd=Poly(1e-9, 1e-6, 1e-4), attn_bwd=Poly(2e-9, 3e-6, 2e-4),
                                 lin_fwd=Poly(0.0, 1e-7, 1e-5), lin_bwd=Poly(0.0, 2e-7, 2e-5), device="toy"))


def test_dynamic_cp_shard_hand_worked_prices(shard_devices):
    dev = load_device("h100shard")
    cost = DynamicCPCost(_toy_model(), cp_comm_for("llama3-8b"), 8192, 16, dev)
    q, p, s = np.array([1024, 1024, 1024, 256]), np.array([0, 0, 2048, 0]), np.array([1, 4, 4, 2])
    f, b = cost.attention_share(q, p, s)
    # forward, by hand: a = 1e-9, b = 1e-6, c = 1e-4
    # q 1024 at CP 1: 1e-9 x 1024^2 + 1e-6 x 1024 + 1e-4 = 1.048576e-3 + 1.024e-3 + 1e-4, no factor
    # q 1024 at CP 4: (2.072576e-3 / 4) x 1.25 + 1e-4 = 7.4768e-4
    # q 1024 after 2048 keys at CP 4: pairs term 1e-9 x (1024^2 + 2 x 1024 x 2048) = 5.24288e-3, + 1.024e-3 = 6.266880e-3;
    #   / 4 x 1.25 + 1e-4 = 2.0584e-3
    # q 256 at CP 2: 1e-9 x 65536 + 1e-6 x 256 = 3.21536e-4; / 2 x 1.5 + 1e-4 = 3.41152e-4
    assert f == pytest.approx([2.172576e-3, 7.4768e-4, 2.0584e-3, 3.41152e-4], rel=1e-12)
    # backward: a = 2e-9, b = 3e-6, c = 2e-4, factors 1.2 (CP 4), 1.4 (CP 2)
    # CP 4: (2.097152e-3 + 3.072e-3) / 4 x 1.2 + 2e-4 = 1.7507456e-3; after 2048 keys: (1.048576e-2 + 3.072e-3) / 4
    # x 1.2 + 2e-4 = 4.267328e-3; CP 2: (1.31072e-4 + 7.68e-4) / 2 x 1.4 + 2e-4 = 8.293504e-4
    assert b == pytest.approx([2.097152e-3 + 3.072e-3 + 2e-4, 1.7507456e-3, 4.267328e-3, 8.293504e-4], rel=1e-12)
    # the fixed-CP profile of the same device: (query, key) and per-token terms x factor / cp, c unchanged
    shape = presets.get_shape("llama3-8b")
    par = ParallelConfig(cp=4, tp=8)
    base, ideal = base_profile(), measured_profile(shape, par)  # h100: no cp_shard
    got = measured_profile(shape, par, device=dev)
    fa = shape.heads * shape.head_dim / (32 * 128) * presets.layers_per_stage(shape, par) / 8
    assert got.attn_fwd.a == pytest.approx(base.attn_fwd.a * fa / 4 * 1.25, rel=1e-12)
    assert got.attn_fwd.b == pytest.approx(base.attn_fwd.b * fa / 4 * 1.25, rel=1e-12)
    assert got.attn_bwd.a == pytest.approx(base.attn_bwd.a * fa / 4 * 1.2, rel=1e-12)
    assert got.attn_fwd.c == ideal.attn_fwd.c == pytest.approx(base.attn_fwd.c * fa, rel=1e-12)
    assert (got.lin_fwd, got.lin_bwd, got.lin_table) == (ideal.lin_fwd, ideal.lin_bwd, ideal.lin_table)


def test_dynamic_cp_shard_fixed_cp4_plan_attention_rises_by_the_factor(shard_devices):
    rng = np.random.default_rng(4)
    lengths = np.minimum(rng.pareto(1.0, 300) * 3000 + 64, 65536).astype(np.int64)
    config = PlanConfig(strategy="fixed", parallel=ParallelConfig(dp=2, cp=4, tp=8), max_tokens=65536, context=65536,
                        tokens_per_step=1 << 18, model="llama3-8b", allow_slicing=False)
    plan = plan_run(lengths, config, 1).plans[0]
    q = np.array([s.end - s.start for r in plan.ranks for mb in r.micro_batches for s in mb.segments])
    p = np.array([s.start - s.attend_from for r in plan.ranks for mb in r.micro_batches for s in mb.segments])
    assert len(q) > 10
    for cost in ("measured", "analytic"):
        base = "h100" if cost == "measured" else "h200"
        ideal = load_cost_model("llama3-8b", config.parallel, device=base, cost=cost)
        slow = load_cost_model("llama3-8b", config.parallel, device=f"{base}shard", cost=cost)
        for k, (f0, f1) in enumerate(zip(ideal.segment_times(q, p), slow.segment_times(q, p))):
            c = ideal.profile.attn_fwd.c if k == 0 else ideal.profile.attn_bwd.c
            factor = 1.25 if k == 0 else 1.2
            assert float((f1 - c).sum()) == pytest.approx(factor * float((f0 - c).sum()), rel=1e-12), (cost, k)
        assert ideal.microbatch_time_of([4096]) != slow.microbatch_time_of([4096])


def test_dynamic_cp_shard_none_or_ones_price_exactly_as_before(shard_devices):
    shape = presets.get_shape("llama3-8b")
    for cp in (1, 2, 4):
        par = ParallelConfig(cp=cp, tp=8)
        ideal = measured_profile(shape, par)
        ones = measured_profile(shape, par, device=load_device("h100ones"))
        fa = shape.heads * shape.head_dim / (32 * 128) * presets.layers_per_stage(shape, par) / 8
        base = base_profile()
        assert ideal.attn_fwd == Poly(base.attn_fwd.a * fa / cp, base.attn_fwd.b * fa / cp, base.attn_fwd.c * fa)
        assert (ones.attn_fwd, ones.attn_bwd, ones.slice_term) == (ideal.attn_fwd, ideal.attn_bwd, ideal.slice_term)
    config = PlanConfig(parallel=ParallelConfig(dp=4, cp=4, tp=8), max_tokens=131072, context=131072, cp_mode="dynamic")
    q = np.array([100, 4096, 32768, 131072, 5000]), np.array([0, 0, 0, 0, 60000])
    s = np.array([1, 2, 4, 16, 8])
    today = DynamicCPCost.for_config(config)
    fa, ba = today.model.segment_times(*q)
    cf, cb = today.model.profile.attn_fwd.c, today.model.profile.attn_bwd.c
    f, b = today.attention_share(*q, s)
    assert today.device.cp_shard is None
    assert np.array_equal(f, (fa - cf) / s + cf) and np.array_equal(b, (ba - cb) / s + cb)
    ones = DynamicCPCost.for_config(msgspec.structs.replace(config, device="h100ones"))
    assert all(np.array_equal(x, y) for x, y in zip(ones.attention_share(*q, s), (f, b)))


def test_dynamic_cp_shard_unknown_size_names_the_file_and_field(shard_devices, tmp_path):
    half = load_device("h100half")
    assert cp_shard_factors(half, 2) == (1.5, 1.4) and cp_shard_factors(half, 1) == (1.0, 1.0)
    with pytest.raises(ValueError, match=r"h100half\.json: cp_shard\.fwd has no factor for CP size 4"):
        cp_shard_factors(half, 4)
    with pytest.raises(ValueError, match=r"h100half\.json: cp_shard\.fwd has no factor for CP size 4"):
        measured_profile(presets.get_shape("llama3-8b"), ParallelConfig(cp=4, tp=8), device=half)
    config = PlanConfig(parallel=ParallelConfig(dp=4, cp=4, tp=8), max_tokens=131072, context=131072,
                        cp_mode="dynamic", device="h100half")
    with pytest.raises(ValueError, match=r"h100half\.json: cp_shard\.fwd has no factor for CP size 4"):
        DynamicCPCost.for_config(config)  # the pool's sizes are checked before planning
    bad = json.loads((shard_devices / "h100half.json").read_text())
    for cp_shard, fragment in (({"fwd": {"2": 0.9}, "bwd": {"2": 1.0}}, "cp_shard.fwd"),
                               ({"fwd": {"3": 1.1}, "bwd": {"3": 1.1}}, "powers of two")):
        path = tmp_path / "bad" / "h100half.json"
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps({**bad, "cp_shard": cp_shard, "measured": None}))
        with pytest.raises(ValueError, match=fragment):
            read_device(path)
