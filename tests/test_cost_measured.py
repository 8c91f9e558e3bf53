"""The measured H100 profile: it fits every measured row within 3% (recomputed here from the CSVs with the
profile's formula written out, not with the cost kernels), it is what a fresh build of the CSVs gives, it scales
to other shapes and layouts as a hand-worked example says, it is the default model, and a profile written by
`packloader calibrate` takes its place."""

from __future__ import annotations

import csv
from pathlib import Path

import msgspec
import numpy as np
import pytest

from packloader.balancers.cost import presets
from packloader.balancers.cost.lookup import cost_model_for
from packloader.balancers.cost.measured import build_profile, measured_profile, measured_stage_profiles
from packloader.balancers.cost.model import CostModel
from packloader.balancers.cost.profile_io import load_profile
from packloader.balancers.cost.resolve import load_cost_model
from packloader.contracts import CostProfile, LinTable, ParallelConfig, PlanConfig, Poly

ROOT = Path(__file__).resolve().parents[1]
MEASURED = ROOT / "packloader" / "profiles" / "measured"
SHIPPED = ROOT / "packloader" / "profiles" / "h100-llama2-7b-layer.json"


def rows(name):
    with open(MEASURED / name, newline="") as f:
        return [{k: float(v) for k, v in r.items()} for r in csv.DictReader(f)]


def poly_doc(p, l, tile):
    lt = -(-l // tile) * tile
    return p[0] * lt * lt + p[1] * lt + p[2]


def table_at(tokens, times, n):
    if n <= tokens[0]:
        return times[0]
    for i in range(1, len(tokens)):
        if n <= tokens[i]:
            w = (n - tokens[i - 1]) / (tokens[i] - tokens[i - 1])
            return times[i - 1] + w * (times[i] - times[i - 1])
    return times[-1] * n / tokens[-1]


def test_every_measured_row_within_3_percent():
    prof = msgspec.json.decode(SHIPPED.read_bytes())  # plain JSON: no packloader code evaluates it here
    att, lin = rows("h100-attention.csv"), rows("h100-linear.csv")
    assert len(att) == 7 and len(lin) == 9
    worst = 0.0
    for r in att:
        l = int(r["doc_len"])
        for part, col in (("attn_fwd", "fwd_ms"), ("attn_bwd", "bwd_ms")):
            pred_ms = r["docs"] * poly_doc(prof[part], l, prof["tile"]) * 1e3
            err = abs(pred_ms / r[col] - 1)
            assert err <= 0.03, (part, l, pred_ms, r[col])
            worst = max(worst, err)
    t = prof["lin_table"]
    for r in lin:
        for key, col in (("fwd", "fwd_ms"), ("bwd", "bwd_ms")):
            pred_ms = table_at(t["tokens"], t[key], r["tokens"]) * 1e3
            assert abs(pred_ms / r[col] - 1) <= 0.03, (key, r["tokens"], pred_ms, r[col])
    assert 0.0 < worst <= 0.03  # a real fit, not a lookup: the attention rows are off by a little
    for part in ("attn_fwd", "attn_bwd", "lin_fwd", "lin_bwd"):
        assert prof["fit_error"][part] <= 0.03


def test_shipped_profile_is_a_fresh_build_of_the_csvs():
    shipped, fresh = load_profile(SHIPPED), build_profile()
    assert shipped.tile == fresh.tile and shipped.lin_table == fresh.lin_table and shipped.source == fresh.source
    for part in ("attn_fwd", "attn_bwd", "lin_fwd", "lin_bwd"):
        np.testing.assert_allclose(msgspec.structs.astuple(getattr(shipped, part)),
                                   msgspec.structs.astuple(getattr(fresh, part)), rtol=1e-9, atol=1e-18)


def test_short_documents_cost_what_the_measurements_say():
    """Per (query, key) pair a 256-token document costs ~3.9x a 32K one and a 1K one ~1.7x: the measured
    profile keeps that (checked against the CSV's own ratios); the analytic one, whose per-token term is only
    the HBM traffic of the rows, gives part of it."""
    att = {int(r["doc_len"]): r for r in rows("h100-attention.csv")}

    def per_pair(time_ms, docs, l):
        return time_ms / (docs * l * (l + 1) / 2)

    measured = load_cost_model("h100-llama2-7b-layer")
    analytic = load_cost_model("llama2-7b", cost="analytic")
    for l in (256, 1024):
        want = per_pair(att[l]["fwd_ms"], att[l]["docs"], l) / per_pair(att[32768]["fwd_ms"], 1, 32768)
        assert want > 1.6
        fm, _ = measured.segment_times(np.array([l, 32768]), np.zeros(2, np.int64))
        got = (fm[0] / (l * (l + 1) / 2)) / (fm[1] / (32768 * 32769 / 2))
        assert got == pytest.approx(want, rel=0.05)
        fa, _ = analytic.segment_times(np.array([l, 32768]), np.zeros(2, np.int64))
        assert 1.2 < (fa[0] / (l * (l + 1) / 2)) / (fa[1] / (32768 * 32769 / 2)) < 0.9 * want


def test_scaling_by_hand():
    """Llama-3-70B at TP 8, CP 2, PP 4 (20 layers a stage) from a made-up one-layer base, worked out by hand."""
    base = CostProfile(
        name="base", tile=1, attn_fwd=Poly(1e-11, 2e-8, 4e-6), attn_bwd=Poly(3e-11, 5e-8, 8e-6),
        lin_fwd=Poly(0.0, 6e-7, 1e-4), lin_bwd=Poly(0.0, 1.2e-6, 8e-4),
        lin_table=LinTable(tokens=[256, 1024, 4096], fwd=[2.4e-4, 6.4e-4, 2.6e-3], bwd=[1.1e-3, 1.3e-3, 5.2e-3]),
    )
    shape = presets.get_shape("llama3-70b")
    m = CostModel(measured_profile(shape, ParallelConfig(tp=8, cp=2, pp=4), base=base))
    # attention: heads x head_dim 64 x 128 over 32 x 128 = 2, x 20 layers / TP 8 = 5; pairs and tokens also / CP 2
    f, b = m.segment_times(np.array([8192]), np.array([1000]))
    assert f[0] == pytest.approx(2.5e-11 * (8192**2 + 2 * 8192 * 1000) + 5e-8 * 8192 + 2e-5, rel=1e-12)
    assert b[0] == pytest.approx(7.5e-11 * (8192**2 + 2 * 8192 * 1000) + 12.5e-8 * 8192 + 4e-5, rel=1e-12)
    # linear: GEMM weights of a 70B layer 855,638,016 over a 7B layer's 202,375,168, x 20 layers / TP 8; a
    # micro-batch of 4096 tokens is 2048 per CP rank, between the base's 1024 and 4096 counts
    fl = 855_638_016 / 202_375_168 * 20 / 8
    base_f = 6.4e-4 + (2.6e-3 - 6.4e-4) * (2048 - 1024) / (4096 - 1024)
    base_b = 1.3e-3 + (5.2e-3 - 1.3e-3) * (2048 - 1024) / (4096 - 1024)
    # per rank-token extras: norms + rotary + residual bytes of a 70B layer (65,536 + 36,864 + 98,304) x 20 / 8
    # at 2.6 TB/s (twice backward), and the LM head's 128,256 x 8192 / PP 4 / TP 8 weights at the base's rate
    ew = 200_704 * 20 / 8 / 2.6e12
    head = 128_256 * 8192 / 4 / 8
    ext_f = ew + head * 6e-7 / 202_375_168
    ext_b = 2 * ew + head * 1.2e-6 / 202_375_168
    assert m.lin_time(4096) == pytest.approx(fl * base_f + ext_f * 2048, rel=1e-12)
    assert m.lin_time(4096, bwd=True) == pytest.approx(fl * base_b + ext_b * 2048, rel=1e-12)
    # below the first count: the floor (and the extras at that count)
    assert m.lin_time(100) == pytest.approx(fl * 2.4e-4 + ext_f * 256, rel=1e-12)


def test_default_is_measured_on_h100_and_analytic_behind_a_flag():
    par = ParallelConfig(dp=8, pp=4, tp=8)
    default = cost_model_for(PlanConfig(parallel=par))
    assert default.profile.device.startswith("measured:h100") and default.profile.lin_table is not None
    assert default.profile == measured_profile(presets.get_shape("llama3-8b"), par)
    analytic = cost_model_for(PlanConfig(parallel=par, cost="analytic"))
    assert analytic.profile == presets.analytic_profile(presets.get_shape("llama3-8b"), par)
    h200 = cost_model_for(PlanConfig(parallel=par, device="h200"))
    assert h200.profile.device == "analytic:h200-bf16" and "no measured H200 profile" in h200.profile.source
    with pytest.raises(ValueError, match=r"unknown device 'a100'; known devices: .*h100, h200"):
        cost_model_for(PlanConfig(parallel=par, device="a100"))  # a device is a profile file, checked when loaded
    with pytest.raises(msgspec.ValidationError, match="cost"):
        msgspec.convert({"cost": "guess"}, PlanConfig)


def test_calibrated_profile_loads_in_place_of_the_shipped_one(tmp_path):
    from packloader.balancers.offline import plan_run
    from packloader.cli.main import main

    out = tmp_path / "cpu.json"
    assert main(["calibrate", "--device", "cpu", "--max-len", "256", "--lengths", "5", "--sizes", "4", "--repeats", "1",
                 "--warmup", "0", "--model", "tiny", "--quiet", "--out", str(out)]) == 0
    written = msgspec.json.decode(out.read_bytes(), type=CostProfile)
    assert written.lin_table is not None and len(written.lin_table.tokens) >= 2  # the same form as the H100 one
    for cost in ("measured", "analytic"):
        for device in ("h100", "h200"):
            cfg = PlanConfig(strategy="wlb", model=str(out), parallel=ParallelConfig(dp=2), max_tokens=512, context=512,
                             tokens_per_step=2048, cost=cost, device=device)
            assert cost_model_for(cfg).profile == written
    lengths = np.random.default_rng(0).integers(10, 500, 200)
    result = plan_run(lengths, cfg, 2)
    model = CostModel(written)
    for plan in result.plans:
        for rank in plan.ranks:
            for mb in rank.micro_batches:
                assert (mb.fwd_cost, mb.bwd_cost) == pytest.approx(model.microbatch_times(mb), rel=1e-9)


def test_stage_profiles_split_the_layers_and_put_the_head_last():
    shape, par = presets.get_shape("llama2-13b"), ParallelConfig(pp=3, tp=2)  # 40 layers: 14, 13, 13
    stages = measured_stage_profiles(shape, par)
    one = measured_profile(shape, ParallelConfig(tp=2), layers=1, include_head=False)
    assert [s.attn_fwd.a / one.attn_fwd.a for s in stages] == pytest.approx([14, 13, 13])
    q = np.array([4096])
    t = [sum(CostModel(s).microbatch_time_of(q)) for s in stages]
    assert t[2] > t[1] and t[0] > t[1]  # the last stage carries the LM head, the first one more layer


def test_report_on_h200_says_it_prices_with_the_analytic_model(tmp_path, capsys):
    import json

    from packloader.cli.main import main

    np.save(tmp_path / "l.npy", np.random.default_rng(1).integers(50, 4000, 400))
    args = ["report", "--lengths", str(tmp_path / "l.npy"), "--dp", "2", "--tp", "1", "--model", "tiny", "--max-tokens", "4096",
            "--steps", "2", "--strategies", "fixed,wlb", "--no-plots", "--no-advice", "--no-progress"]
    assert main([*args, "--device", "h200", "--out", str(tmp_path / "a")]) == 0
    rep = json.loads((tmp_path / "a" / "report.json").read_text())
    assert "h200" in rep["settings"]["cost_profile"]
    assert any("analytic cost model" in n and "no measured H200 profile" in n for n in rep["notes"])
    assert main([*args, "--out", str(tmp_path / "b")]) == 0  # H100: the measured profile, no such note
    rep = json.loads((tmp_path / "b" / "report.json").read_text())
    assert "h100-measured" in rep["settings"]["cost_profile"]
    assert not any("analytic cost model" in n for n in rep["notes"])
