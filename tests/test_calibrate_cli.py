"""`packloader calibrate` on CPU at tiny sizes: it times the reference backend and writes a CostProfile that the
balancers load, with the held-out fit error in the profile and on stdout."""

import math

import msgspec

from packloader.cli.main import main
from packloader.contracts import CostProfile

FAST = ["--device", "cpu", "--max-len", "256", "--lengths", "5", "--sizes", "4", "--repeats", "1", "--warmup", "0"]


def test_cli_writes_a_profile_the_balancers_load(tmp_path, capsys):
    out = tmp_path / "cpu.json"
    rc = main(["calibrate", *FAST, "--hidden", "32", "--heads", "4", "--kv-heads", "2", "--head-dim", "8",
               "--ffn", "64", "--out", str(out)])
    assert rc == 0
    prof = msgspec.json.decode(out.read_bytes(), type=CostProfile)
    assert prof.device == "cpu:cpu/reference/float32"
    for part in ("attn_fwd", "attn_bwd", "lin_fwd", "lin_bwd"):
        p = getattr(prof, part)
        assert min(p.a, p.b, p.c) >= 0.0 and p.a + p.b + p.c > 0.0
        assert math.isfinite(prof.fit_error[f"{part}_heldout_mape_pct"])
    text = capsys.readouterr().out
    assert "held-out MAPE" in text and "attention l=" in text and str(out) in text

    from packloader.balancers.cost.resolve import load_cost_model

    model = load_cost_model(str(out))
    assert model.profile == prof


def test_cli_with_a_preset_scales_to_the_stage(tmp_path, capsys):
    out = tmp_path / "tiny.json"
    assert main(["calibrate", *FAST, "--model", "tiny", "--pp", "2", "--quiet", "--out", str(out)]) == 0
    prof = msgspec.json.decode(out.read_bytes(), type=CostProfile)
    assert prof.name.startswith("tiny@cpu") and prof.name.endswith("layers2")  # 4 layers over 2 stages
    assert "attention l=" not in capsys.readouterr().out


def test_cli_needs_a_shape(tmp_path, capsys):
    assert main(["calibrate", *FAST, "--heads", "4", "--ffn", "64", "--out", str(tmp_path / "x.json")]) == 2
    assert "--hidden" in capsys.readouterr().err
