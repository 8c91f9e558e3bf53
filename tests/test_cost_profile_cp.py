"""A calibrated cost profile JSON (one GPU's stage at CP 1) is priced per GPU at fixed CP, as the presets are
(`cp_shard.scale_profile_to_cp` through `load_cost_model`): hand-worked prices of a hand-written profile, the two
CP code paths (fixed CP and per-document CP) against each other, cp_mode "auto" and the plan/report CLIs."""

from __future__ import annotations

import json

import msgspec
import numpy as np
import pytest

from packloader.balancers.cost import devices, presets
from packloader.balancers.cost.devices import CPShardOverhead, load_device
from packloader.balancers.cost.measured import measured_profile
from packloader.balancers.cost.resolve import load_cost_model
from packloader.balancers.factory import make_planner
from packloader.balancers.planners.doc_cp.choice import CPModeChoice, fixed_with_comm, seconds_per_work
from packloader.balancers.planners.doc_cp.price import DynamicCPCost, Placed
from packloader.balancers.planners.registry import Window
from packloader.contracts import ParallelConfig, PlanConfig, PlannerState

# round coefficients: attention a, b, c and linear a, b, c, forward and backward; 8192 tokens fit one GPU
HAND = {"name": "hand", "tile": 1, "attn_fwd": [1e-10, 2e-8, 3e-6], "attn_bwd": [2e-10, 4e-8, 5e-6],
        "lin_fwd": [1e-14, 1e-6, 1e-4], "lin_bwd": [2e-14, 2e-6, 2e-4], "device": "hand", "max_tokens": 8192}
SHARD = CPShardOverhead(fwd={2: 1.5, 4: 1.25}, bwd={2: 1.4, 4: 1.2})


def write(tmp_path, name: str, **changes) -> str:
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({**HAND, **changes}))
    return str(path)


# fixed CP's K/V all-gather, worked out by hand for a profile JSON (no model shape: llama3-8b's, 32 layers, kv_dim
# 1024 in bf16, K and V: 131072 bytes a token at TP 1) on h100's cp_link (360 GB/s and 8 us a step inside a node of
# 8 GPUs, 45 GB/s and 15 us across): (cp - 1) / cp x n x bytes / rate + (cp - 1) x 32 steps x latency, each way
def traffic(n: float, cp: int, tp: int = 1) -> float:
    if cp <= 1:
        return 0.0
    rate, lat = (360e9, 8e-6) if tp * cp <= 8 else (45e9, 15e-6)
    return (cp - 1) / cp * n * 131072 / tp / rate + (cp - 1) * 32 * lat


def by_hand(lengths, cp: int, bwd: bool, factor: float = 1.0, tp: int = 1) -> float:
    """One CP rank's time of a fixed-CP micro-batch of whole documents under HAND: each document's (a L^2 + b L)
    / cp x factor + c, plus the linear part of n / cp tokens, plus the group's all-gather (`traffic`)."""
    a, b, c = HAND["attn_bwd" if bwd else "attn_fwd"]
    la, lb, lc = HAND["lin_bwd" if bwd else "lin_fwd"]
    attn = sum((a * L * L + b * L) / cp * factor + c for L in lengths)
    n = sum(lengths) / cp
    return attn + la * n * n + lb * n + lc + traffic(sum(lengths), cp, tp)


@pytest.fixture
def shard_device(tmp_path, monkeypatch):
    """h100 under another name with a measured CP-shard overhead (SHARD)."""
    from packloader.runtime.calibrate_cp import write_device

    folder = tmp_path / "devices"
    write_device(msgspec.structs.replace(load_device("h100"), name="h100shard", cp_shard=SHARD), folder / "h100shard.json")
    monkeypatch.setenv(devices.ENV_PATH, str(folder))
    monkeypatch.setattr(devices, "_REGISTERED", [])
    return "h100shard"


def test_profile_json_fixed_cp_micro_batch_by_hand(tmp_path):
    path = write(tmp_path, "hand")
    docs = [3000, 1000, 500]
    # CP 2 forward, worked out: 3000: (9e-4 + 6e-5) / 2 + 3e-6 = 4.83e-4; 1000: (1e-4 + 2e-5) / 2 + 3e-6 = 6.3e-5;
    # 500: (2.5e-5 + 1e-5) / 2 + 3e-6 = 2.05e-5; linear of 2250 tokens: 5.0625e-8 + 2.25e-3 + 1e-4; all-gather of
    # 4500 tokens: 0.5 x 4500 x 131072 / 360e9 + 32 x 8e-6 = 8.192e-4 + 2.56e-4
    assert load_cost_model(path, ParallelConfig(cp=2)).microbatch_time_of(docs)[0] == pytest.approx(
        4.83e-4 + 6.3e-5 + 2.05e-5 + 5.0625e-8 + 2.25e-3 + 1e-4 + 8.192e-4 + 2.56e-4, rel=1e-12)
    for cp in (1, 2, 4):
        f, b = load_cost_model(path, ParallelConfig(dp=2, cp=cp, tp=2)).microbatch_time_of(docs)
        assert (f, b) == pytest.approx((by_hand(docs, cp, False, tp=2), by_hand(docs, cp, True, tp=2)), rel=1e-12), cp
    one = load_cost_model(path).profile
    assert load_cost_model(path, ParallelConfig(dp=4, tp=2)).profile == one  # only CP changes a JSON profile
    four = load_cost_model(path, ParallelConfig(cp=4)).profile
    assert four.memory_cap == 4 * 8192 and "scaled to CP 4" in four.source
    assert load_cost_model(write(tmp_path, "nocap", max_tokens=None), ParallelConfig(cp=4)).profile.memory_cap is None


def test_profile_json_lin_table_runs_n_over_cp_tokens(tmp_path):
    path = write(tmp_path, "table", lin_table={"tokens": [1000, 2000, 4000], "fwd": [1e-3, 1.5e-3, 4e-3],
                                               "bwd": [2e-3, 3e-3, 8e-3]})
    docs = [3000, 2000, 1000]
    attn = [sum((a * L * L + b * L) / cp + c for L in docs) for cp in (2, 4) for a, b, c in (HAND["attn_fwd"], HAND["attn_bwd"])]
    # 6000 tokens: 3000 a GPU at CP 2, halfway from 2000 to 4000 (1.5e-3 + 2.5e-3 / 2; 3e-3 + 5e-3 / 2); 1500
    # at CP 4, halfway from 1000 to 2000 (1e-3 + 0.5e-3 / 2; 2e-3 + 1e-3 / 2); each plus the all-gather of 6000
    # tokens (linear in n, so the table's interpolation carries it exactly)
    lin = [2.75e-3 + traffic(6000, 2), 5.5e-3 + traffic(6000, 2), 1.25e-3 + traffic(6000, 4), 2.5e-3 + traffic(6000, 4)]
    got = [t for cp in (2, 4) for t in load_cost_model(path, ParallelConfig(cp=cp)).microbatch_time_of(docs)]
    assert got == pytest.approx([x + y for x, y in zip(attn, lin)], rel=1e-12)


def test_profile_json_slices_at_cp4_by_hand(tmp_path):
    q, p = np.array([1000]), np.array([2000])  # 1000 query tokens after 2000 earlier keys
    rule = load_cost_model(write(tmp_path, "rule"), ParallelConfig(cp=4))
    # the rule: (a (q^2 + 2 q p) + b q) / 4 + c = (1e-10 x 5e6 + 2e-8 x 1000) / 4 + 3e-6; backward 2e-10, 4e-8, 5e-6
    assert [float(t[0]) for t in rule.segment_times(q, p)] == pytest.approx([1.33e-4, 2.65e-4], rel=1e-12)
    term = {"tile": 1, "x_fwd": 1e-11, "y_fwd": 1e-9, "x_bwd": 2e-11, "y_bwd": 2e-9}
    termed = load_cost_model(write(tmp_path, "termed", slice_term=term), ParallelConfig(cp=4))
    # a measured slice term: (a q^2 + b q) / 4 + c + (x 2 q p + y p) / 4
    # forward 1.2e-4 / 4 + 3e-6 + (4e-5 + 2e-6) / 4 = 4.35e-5; backward 2.4e-4 / 4 + 5e-6 + (8e-5 + 4e-6) / 4 = 8.6e-5
    assert [float(t[0]) for t in termed.segment_times(q, p)] == pytest.approx([4.35e-5, 8.6e-5], rel=1e-12)


def test_profile_json_takes_the_devices_cp_shard_factor(tmp_path, shard_device):
    path, docs = write(tmp_path, "hand"), [3000, 1000, 500]
    for cp in (2, 4):
        f, b = load_cost_model(path, ParallelConfig(cp=cp), device=shard_device).microbatch_time_of(docs)
        assert (f, b) == pytest.approx((by_hand(docs, cp, False, SHARD.fwd[cp]), by_hand(docs, cp, True, SHARD.bwd[cp])),
                                       rel=1e-12)


def test_bundled_profile_is_scaled_by_name_too():
    one = load_cost_model("h100-llama2-7b-layer").profile
    four = load_cost_model("h100-llama2-7b-layer", ParallelConfig(cp=4)).profile
    assert four.attn_fwd.a == pytest.approx(one.attn_fwd.a / 4) and four.attn_bwd.c == one.attn_bwd.c
    assert four.lin_table.tokens == [4 * n for n in one.lin_table.tokens] and four.lin_table.fwd == pytest.approx(
        [v + traffic(n, 4) for v, n in zip(one.lin_table.fwd, four.lin_table.tokens)], rel=1e-12)


@pytest.mark.parametrize("device", ["h100", "shard"])
def test_fixed_cp_and_per_document_cp_agree_per_gpu(tmp_path, request, device):
    """The same documents as one fixed-CP micro-batch at CP 4, and as one per-document CP slot with every
    document on GPUs 0-3: each GPU spends the same time, the all-gather included (`cost.cp_price` prices both)."""
    if device == "shard":
        device = request.getfixturevalue("shard_device")
    docs = np.array([6000, 3000, 1200, 700, 100])
    for model in (write(tmp_path, "hand", lin_table={"tokens": [512, 2048, 8192], "fwd": [1e-3, 2e-3, 7e-3],
                                                     "bwd": [2e-3, 4e-3, 14e-3]}), "llama3-8b"):
        config = PlanConfig(model=model, device=device, parallel=ParallelConfig(dp=1, cp=4, tp=8), max_tokens=16384,
                            context=16384, tokens_per_step=1 << 16)
        fixed = load_cost_model(model, config.parallel, device=device).microbatch_time_of(docs)
        cost = DynamicCPCost.for_config(config)
        k = len(docs)
        placed = Placed(q=docs, p=np.zeros(k, np.int64), m=np.zeros(k, np.int64), first=np.zeros(k, np.int64),
                        size=np.full(k, 4, np.int64))
        t = cost.slot_times(placed, 1)
        af, ab = cost.attention_share(docs, np.zeros(k, np.int64), np.full(k, 4))
        cf, cb = cost.comm.times(float(docs.sum()), 4, float(af.sum()), float(ab.sum()))
        assert cf > 0
        assert t.own_fwd[0] == pytest.approx([fixed[0]] * 4, rel=1e-12), model
        assert t.own_bwd[0] == pytest.approx([fixed[1]] * 4, rel=1e-12), model
        assert (cf, cb) == pytest.approx((traffic(docs.sum(), 4, 8),) * 2, rel=1e-12)  # across nodes: 32 GPUs


def test_cp_mode_auto_with_a_profile_json_picks_fixed_cp_where_the_preset_does(tmp_path):
    # documents of similar length at TP 2 (a CP 4 group inside a node): fixed CP 4 beats per-document CP under the
    # preset; the JSON is the preset's own stage at CP 1, so it must price and pick the same (before the fix its
    # fixed-CP price was about 4x too high and auto always took per-document CP)
    path = tmp_path / "llama3-8b-tp2.json"
    path.write_bytes(msgspec.json.encode(measured_profile(presets.get_shape("llama3-8b"), ParallelConfig(dp=2, tp=2))))
    lengths = np.random.default_rng(3).integers(1000, 1200, 200)
    window, picked, fixed_price = Window.from_lengths(lengths), {}, {}
    for model in ("llama3-8b", str(path)):
        config = PlanConfig(strategy="auto", cp_mode="auto", parallel=ParallelConfig(dp=2, cp=4, tp=2), max_tokens=32768,
                            context=32768, tokens_per_step=int(lengths.sum()), model=model, allow_slicing=False)
        planner = make_planner(config)
        assert isinstance(planner, CPModeChoice)
        plan, _ = planner.plan(window, PlannerState(), 0)
        fplan, _ = planner.fixed.plan(window, PlannerState(), 0)
        fplan = fixed_with_comm(fplan, planner.dynamic.cost.comm, 4, planner.model.profile.cp_traffic)
        picked[model] = plan.cp_mode
        fixed_price[model] = seconds_per_work(fplan, config, planner.model, planner.dynamic.cost)
    assert picked["llama3-8b"] == "fixed"  # the premise: fixed CP wins here under the preset
    assert picked[str(path)] == "fixed"
    assert fixed_price[str(path)] == pytest.approx(fixed_price["llama3-8b"], rel=1e-9)


def test_plan_cli_prices_fixed_cp_micro_batches_per_gpu(tmp_path):
    from packloader.cli.main import main

    lengths = np.random.default_rng(2).integers(100, 3000, 60)
    np.save(tmp_path / "l.npy", lengths)
    out = tmp_path / "p.jsonl"
    assert main(["plan", "--lengths", str(tmp_path / "l.npy"), "--model", write(tmp_path, "hand"), "--cp", "2",
                 "--dp", "2", "--tp", "1", "--max-tokens", "8192", "--context", "8192", "--tokens-per-step", "32768",
                 "--strategy", "wlb", "--quiet", "--out", str(out)]) == 0
    checked = 0
    for line in out.read_text().splitlines():
        step = json.loads(line)
        for mbs, costs in zip(step["ranks"], step["costs"]):
            for mb, (f, b) in zip(mbs, costs):
                assert all(start == attend for _, start, _, attend in mb)  # whole pieces: the hand formula holds
                pieces = [end - start for _, start, end, _ in mb]
                assert (f, b) == pytest.approx((by_hand(pieces, 2, False), by_hand(pieces, 2, True)), rel=1e-9)
                checked += 1
    assert checked >= 4


def test_report_cli_fixed_cp_time_is_per_gpu(tmp_path):
    from packloader.cli.main import main

    lengths = np.random.default_rng(4).integers(100, 3000, 40)
    np.save(tmp_path / "l.npy", lengths)
    # no quadratic linear term: the run's time is every document's attention plus b x tokens / cp plus one floor
    # per micro-batch, whatever the packing
    path = write(tmp_path, "flat", lin_fwd=[0.0, 1e-6, 1e-4], lin_bwd=[0.0, 2e-6, 2e-4])
    assert main(["report", "--lengths", str(tmp_path / "l.npy"), "--model", path, "--cp", "2", "--dp", "1", "--tp", "1",
                 "--pp", "1", "--max-tokens", "8192", "--context", "8192", "--tokens-per-step", str(int(lengths.sum())),
                 "--steps", "1", "--strategies", "wlb", "--out", str(tmp_path / "r"), "--no-plots", "--no-advice",
                 "--no-progress"]) == 0
    rep = json.loads((tmp_path / "r" / "report.json").read_text())
    wlb = next(s for s in rep["strategies"] if s["name"] == "wlb")
    assert wlb["steps"] == 1 and wlb["drain_steps"] == 0
    m = wlb["micro_batches_mean"]
    attn = sum((a * L * L + b * L) / 2 + c for L in lengths.tolist() for a, b, c in (HAND["attn_fwd"], HAND["attn_bwd"]))
    # and each micro-batch's all-gather, both ways: 0.5 x its tokens x 131072 / 360e9 + 32 x 8e-6
    want = attn + 3e-6 * lengths.sum() / 2 + 3e-4 * m + 2 * (0.5 * lengths.sum() * 131072 / 360e9 + 32 * 8e-6 * m)
    assert wlb["step_time_total"] == pytest.approx(want, rel=1e-9)
