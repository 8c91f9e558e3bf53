"""The slice term's fit (packloader.balancers.cost.slice_fit) on synthetic tables whose generating coefficients
are known, the measured-table CSV format, and the slice timer's output on CPU (the reference backend)."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch

from packloader.balancers.cost.measured import base_profile
from packloader.balancers.cost.slice_fit import (
    SliceTimings,
    fit_slice_term,
    read_slice_csv,
    slice_times,
    write_slice_csv,
)

Q = [128, 144, 256, 512, 1024, 4096, 16384, 128, 144, 512, 2048, 8192]
P = [1024, 65536, 4096, 16384, 131072, 8192, 65536, 0, 0, 65536, 1024, 131072]


def whole_doc(poly, q):
    """A whole document of q tokens under a profile of tile 1, by hand: a*q^2 + b*q + c."""
    q = np.asarray(q, dtype=np.float64)
    return poly.a * q * q + poly.b * q + poly.c


def synthetic(x_f, y_f, x_b, y_b, tile):
    prof = base_profile()
    q, p = np.array(Q, dtype=np.float64), np.array(P, dtype=np.float64)
    qt = np.ceil(q / tile) * tile
    f = whole_doc(prof.attn_fwd, q) + x_f * 2 * qt * p + y_f * p
    b = whole_doc(prof.attn_bwd, q) + x_b * 2 * qt * p + y_b * p
    return prof, SliceTimings(q=Q, p=P, fwd=f.tolist(), bwd=b.tolist())


def test_fit_recovers_known_coefficients_and_tile():
    prof = base_profile()
    assert prof.tile == 1  # the shipped profile: the fit chooses the slice tile itself
    x_f, y_f, x_b, y_b = 3 * prof.attn_fwd.a, 2e-9, 2.5 * prof.attn_bwd.a, 5e-9
    prof, t = synthetic(x_f, y_f, x_b, y_b, tile=128)
    term = fit_slice_term(prof, t)
    assert term.tile == 128 and term.rows == sum(p > 0 for p in P)
    assert term.fwd.x == pytest.approx(x_f, rel=1e-6) and term.fwd.y == pytest.approx(y_f, rel=1e-6)
    assert term.bwd.x == pytest.approx(x_b, rel=1e-6) and term.bwd.y == pytest.approx(y_b, rel=1e-6)
    assert term.fwd.pair_ratio == pytest.approx(3.0, rel=1e-6)
    assert term.fwd.mape_pct < 1e-6 and term.fwd.rule_mape_pct > 50  # the rule misses a 3x pair rate
    f, b = slice_times(prof, term, Q, P)
    np.testing.assert_allclose(f, t.fwd, rtol=1e-9)
    np.testing.assert_allclose(b, t.bwd, rtol=1e-9)


def test_data_that_follows_the_rule_fits_the_rule():
    """The model's rule is x = a, y = 0 at the profile's tile (1): a table made by it gives exactly that back."""
    prof = base_profile()
    _, t = synthetic(prof.attn_fwd.a, 0.0, prof.attn_bwd.a, 0.0, tile=1)
    term = fit_slice_term(prof, t, tile=1)
    assert term.fwd.pair_ratio == pytest.approx(1.0, rel=1e-6)
    assert term.bwd.pair_ratio == pytest.approx(1.0, rel=1e-6)
    assert term.fwd.y == pytest.approx(0.0, abs=1e-15) and term.bwd.y == pytest.approx(0.0, abs=1e-15)
    assert term.fwd.rule_mape_pct < 1e-6 and term.bwd.rule_mape_pct < 1e-6


def test_a_per_key_cost_alone_is_found():
    """Slices that pay per key read, not per pair: x drops out (non-negative fit), y carries it."""
    prof, t = synthetic(0.0, 4e-9, 0.0, 9e-9, tile=64)
    term = fit_slice_term(prof, t, tile=64)
    assert term.fwd.x == pytest.approx(0.0, abs=1e-18) and term.fwd.y == pytest.approx(4e-9, rel=1e-6)


def test_csv_round_trip_and_bad_rows(tmp_path):
    _, t = synthetic(1e-11, 1e-9, 2e-11, 2e-9, tile=1)
    path = tmp_path / "slices.csv"
    write_slice_csv(t, path)
    back = read_slice_csv(path)
    assert back.q == t.q and back.p == t.p
    np.testing.assert_allclose(back.fwd, t.fwd, rtol=1e-5)
    bad = tmp_path / "bad.csv"
    bad.write_text("q,p,fwd_ms,bwd_ms\n128,0,1.0,2.0\n256,-5,1.0,2.0\n")
    with pytest.raises(ValueError, match=r"bad\.csv, line 3: expected q >= 1, p >= 0"):
        read_slice_csv(bad)
    bad.write_text("q,p,fwd_ms\n128,0,1.0\n")
    with pytest.raises(ValueError, match=r"bad\.csv: missing column\(s\) \['bwd_ms'\]"):
        read_slice_csv(bad)
    bad.write_text("q,p,fwd_ms,bwd_ms\n128,x,1.0,2.0\n")
    with pytest.raises(ValueError, match=r"bad\.csv, line 2: expected integers q, p"):
        read_slice_csv(bad)


def test_bad_tables_are_refused():
    with pytest.raises(ValueError, match="differ in length"):
        SliceTimings(q=[1, 2], p=[0], fwd=[1.0], bwd=[1.0])
    with pytest.raises(ValueError, match="row 0: expected q >= 1"):
        SliceTimings(q=[0], p=[0], fwd=[1.0], bwd=[1.0])
    with pytest.raises(ValueError, match="at least 2 rows with p > 0"):
        fit_slice_term(base_profile(), SliceTimings(q=[8, 8], p=[0, 4], fwd=[1.0, 2.0], bwd=[1.0, 2.0]))


def test_time_slices_on_cpu_gives_one_positive_row_per_pair():
    from packloader.runtime.calibrate import LayerShape
    from packloader.runtime.calibrate_slices import time_slices

    shape = LayerShape(hidden=16, heads=2, kv_heads=1, head_dim=8, ffn=32)
    t = time_slices(shape, [4, 8, 8], [0, 0, 16], device=torch.device("cpu"), dtype=torch.float32,
                    backend="reference", filler_len=4, filler_tokens=16, repeats=1, warmup=0)
    assert (t.q, t.p) == ([4, 8, 8], [0, 0, 16])
    assert all(x > 0 for x in t.fwd + t.bwd)
    stopped = time_slices(shape, [4, 8], [0, 0], device=torch.device("cpu"), dtype=torch.float32,
                          backend="reference", filler_len=4, filler_tokens=16, repeats=1, warmup=0, stop=lambda: True)
    assert stopped.q == []


def test_calibrate_cli_times_and_fits_slices(tmp_path, capsys):
    from packloader.cli.main import main
    from packloader.runtime.calibrate_slices import slice_grid

    out, csv = tmp_path / "cpu.json", tmp_path / "slices.csv"
    code = main(["calibrate", "--device", "cpu", "--hidden", "16", "--heads", "2", "--kv-heads", "1", "--ffn", "32",
                 "--max-len", "256", "--dtype", "fp32", "--repeats", "1", "--warmup", "0", "--lengths", "4",
                 "--sizes", "3", "--layers", "2", "--out", str(out), "--slices", str(csv), "--quiet"])
    assert code == 0 and out.exists()
    table = read_slice_csv(csv)
    qs, ps = slice_grid(256)
    assert (table.q, table.p) == (qs, ps) and sum(p > 0 for p in ps) >= 2
    assert all(q + p <= 256 for q, p in zip(qs, ps))
    text = capsys.readouterr().out
    assert f"wrote {csv}" in text
    if "slice term not fitted" in text:  # a busy CPU can time every tiny slice at or under the resolution
        assert load_profile_of(out).slice_term is None
        return
    assert "slice term (tile" in text and "the model's rule" in text
    assert f"wrote {out} with the slice term" in text
    # the saved profile prices slices by the term fitted on the table it wrote (refitted here from the CSV)
    from packloader.balancers.cost.model import CostModel
    from packloader.balancers.cost.profile_io import load_profile

    saved = load_profile(out)
    assert saved.slice_term is not None and "slice_fwd_mape_pct" in saved.fit_error
    rule = msgspec.structs.replace(saved, slice_term=None)
    again = fit_slice_term(rule, table, tile=saved.slice_term.tile)
    q, p = np.array(table.q), np.array(table.p)
    for got, want in zip(CostModel(saved).segment_times(q, p), slice_times(rule, again, q, p)):
        np.testing.assert_allclose(got, want, rtol=1e-3)


def load_profile_of(path):
    from packloader.balancers.cost.profile_io import load_profile

    return load_profile(path)


def test_calibrate_cli_keeps_the_calibration_when_no_slice_is_over_the_resolution(tmp_path, capsys, monkeypatch):
    """Every slice timed at the clamp (a difference of launches that came out <= 0): no term is fitted, the
    CLI says so and saves the profile pricing slices by the rule, instead of failing the whole calibration."""
    import packloader.runtime.calibrate_slices as cs
    from packloader.cli.main import main

    monkeypatch.setattr(cs, "time_slices", lambda shape, qs, ps, **kw: SliceTimings(
        q=list(qs), p=list(ps), fwd=[cs.MIN_SECONDS] * len(qs), bwd=[cs.MIN_SECONDS] * len(qs)))
    out, csv = tmp_path / "cpu.json", tmp_path / "slices.csv"
    code = main(["calibrate", "--device", "cpu", "--hidden", "16", "--heads", "2", "--kv-heads", "1", "--ffn", "32",
                 "--max-len", "256", "--dtype", "fp32", "--repeats", "1", "--warmup", "0", "--lengths", "4",
                 "--sizes", "3", "--out", str(out), "--slices", str(csv), "--quiet"])
    text = capsys.readouterr().out
    assert code == 0 and "slice term not fitted (the slice fit needs at least 2 rows with p > 0" in text
    assert load_profile_of(out).slice_term is None and read_slice_csv(csv).q


def test_the_slice_launch_attends_to_its_earlier_keys():
    """calibrate_slices times the runtime's SliceContext: its output is causal attention of each segment over
    its cached earlier keys then its own, as written out here (the same draws, keys concatenated by hand)."""
    from packloader.runtime.attention import varlen_attention
    from packloader.runtime.calibrate import LayerShape
    from packloader.runtime.calibrate_slices import _launch

    shape = LayerShape(hidden=16, heads=2, kv_heads=1, head_dim=8, ffn=32)
    q_lens, p_lens = [4, 1, 3], [0, 1, 6]
    run = _launch(shape, q_lens, p_lens, device=torch.device("cpu"), dtype=torch.float64, backend="reference",
                  gen=torch.Generator().manual_seed(7))
    (out,), (g,) = run()
    gen = torch.Generator().manual_seed(7)  # _launch's draws in its order: each prefix's k and v, then q, k, v, g

    def rnd(n, h):
        return torch.randn(n, h, 8, generator=gen, dtype=torch.float64)

    pre = [(rnd(p, 1), rnd(p, 1)) if p else None for p in p_lens]
    q, k, v = rnd(8, 2), rnd(8, 1), rnd(8, 1)
    torch.testing.assert_close(rnd(8, 2), g)
    ks, vs, lo = [], [], 0
    for n, pr in zip(q_lens, pre):
        ks += ([pr[0]] if pr else []) + [k[lo:lo + n]]
        vs += ([pr[1]] if pr else []) + [v[lo:lo + n]]
        lo += n
    cu_q = torch.tensor([0, 4, 5, 8], dtype=torch.int32)
    cu_k = torch.tensor([0, 4, 6, 15], dtype=torch.int32)
    want = varlen_attention(q, torch.cat(ks), torch.cat(vs), cu_q, cu_k, 4, 9, causal=True, backend="reference")
    torch.testing.assert_close(out, want)
