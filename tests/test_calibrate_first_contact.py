"""`packloader calibrate` as a first-time user meets it on a machine without a GPU: it says so and what a CPU
profile is worth, counts its progress, and warns when the fit's held-out error is large."""

from __future__ import annotations

import msgspec
import pytest
import torch

from packloader.cli.main import main
from packloader.contracts import CostProfile, Poly
from packloader.runtime.calibrate import fit_warnings

FAST = ["--max-len", "256", "--lengths", "5", "--sizes", "4", "--repeats", "1", "--warmup", "0",
        "--hidden", "32", "--heads", "4", "--kv-heads", "2", "--head-dim", "8", "--ffn", "64"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU path")
def test_without_a_gpu_it_says_so_and_counts(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(["calibrate", *FAST, "--out", str(out)]) == 0
    got = capsys.readouterr()
    assert "no GPU found" in got.err and "a CPU profile prices this CPU" in got.err
    for k in range(1, 6):
        assert f"[ {k}/5] attention l=" in got.out
    for k in range(1, 5):
        assert f"[ {k}/4] linear" in got.out
    # the fit warning follows the profile's own held-out errors (timings on a busy CPU vary run to run)
    prof = msgspec.json.decode(out.read_bytes(), type=CostProfile)
    worst = max(prof.fit_error[f"{p}_heldout_mape_pct"] for p in ("attn_fwd", "attn_bwd", "lin_fwd", "lin_bwd"))
    assert ("the fit is far from the measurements" in got.err) == (worst > 10.0)


def test_explicit_cpu_still_says_what_the_profile_is_worth(tmp_path, capsys):
    assert main(["calibrate", "--device", "cpu", *FAST, "--quiet", "--out", str(tmp_path / "p.json")]) == 0
    err = capsys.readouterr().err
    assert "a CPU profile prices this CPU" in err and "no GPU found" not in err


def test_fit_warnings_name_each_part_over_the_limit():
    p = Poly(1.0, 1.0, 0.0)
    prof = CostProfile(name="x", attn_fwd=p, attn_bwd=p, lin_fwd=p, lin_bwd=p,
                       fit_error={"attn_fwd_heldout_mape_pct": 39.0, "attn_bwd_heldout_mape_pct": 9.9,
                                  "lin_fwd_heldout_mape_pct": 78.2, "lin_bwd_heldout_mape_pct": float("nan")})
    got = fit_warnings(prof)
    assert [w.split(":")[0] for w in got] == ["attn_fwd", "lin_fwd", "lin_bwd"]  # NaN counts as unreliable
    assert "39.0%" in got[0] and "78.2%" in got[1]
