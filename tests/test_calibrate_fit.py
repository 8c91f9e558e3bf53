"""The calibration fit recovers known coefficients and the tile from synthetic timings, keeps coefficients
non-negative, and scores itself on lengths it did not see."""

import dataclasses

import numpy as np
import pytest

from packloader.balancers.cost.fit import Timings, fit_profile, held_out_mask
from packloader.runtime.calibrate import geometric_points

TRUE = {  # (a, b, c) per part
    "attn_fwd": (3.0e-10, 2.0e-8, 5.0e-6),
    "attn_bwd": (8.0e-10, 5.0e-8, 1.2e-5),
    "lin_fwd": (0.0, 4.0e-7, 2.0e-4),
    "lin_bwd": (0.0, 8.5e-7, 4.0e-4),
}


def synthetic(tile=128, noise=0.0, seed=0):
    rng = np.random.default_rng(seed)
    lengths = geometric_points(64, 32768, 17)
    sizes = geometric_points(64, 32768, 11)
    qt = np.ceil(lengths / tile) * tile

    def t(part, x):
        a, b, c = TRUE[part]
        return (a * x * x + b * x + c) * (1.0 + noise * rng.standard_normal(len(x)))

    return Timings(lengths, t("attn_fwd", qt), t("attn_bwd", qt), sizes, t("lin_fwd", sizes.astype(float)),
                   t("lin_bwd", sizes.astype(float)))


def test_geometric_points_and_held_out_split():
    pts = geometric_points(64, 8192, 9)
    assert pts[0] == 64 and pts[-1] == 8192 and np.all(np.diff(pts) > 0)
    mask = held_out_mask(len(pts))
    assert not mask[0] and not mask[-1] and mask.sum() == (len(pts) - 1) // 2


@pytest.mark.parametrize("tile", [1, 64, 128])
def test_exact_timings_give_back_the_coefficients_and_the_tile(tile):
    prof = fit_profile("synthetic", synthetic(tile=tile))
    assert prof.tile == tile
    for part, (a, b, c) in TRUE.items():
        got = getattr(prof, part)
        np.testing.assert_allclose([got.a, got.b, got.c], [a, b, c], rtol=1e-5, atol=1e-15)
        assert prof.fit_error[f"{part}_heldout_mape_pct"] < 1e-4


def test_noisy_timings_fit_within_the_noise():
    prof = fit_profile("noisy", synthetic(noise=0.02, seed=3))
    assert prof.tile == 128
    for part, (a, b, c) in TRUE.items():
        got = getattr(prof, part)
        if a:
            assert got.a == pytest.approx(a, rel=0.1)
        assert got.b == pytest.approx(b, rel=0.25)
        assert 0.0 <= prof.fit_error[f"{part}_heldout_mape_pct"] < 5.0


def test_coefficients_stay_non_negative():
    # a concave curve: the unconstrained fit would take a negative quadratic term
    lengths = geometric_points(64, 8192, 9)
    concave = 1e-4 * np.sqrt(lengths)
    prof = fit_profile("concave", Timings(lengths, concave, concave, lengths, concave, concave), tile=1)
    for part in ("attn_fwd", "attn_bwd", "lin_fwd", "lin_bwd"):
        p = getattr(prof, part)
        assert min(p.a, p.b, p.c) >= 0.0


def test_held_out_points_are_not_fitted_but_scored():
    data = synthetic()
    clean = fit_profile("clean", data)
    held = held_out_mask(len(data.attn_lengths))
    spoiled = dataclasses.replace(data, attn_fwd=np.where(held, data.attn_fwd * 2.0, data.attn_fwd))
    prof = fit_profile("spoiled", spoiled, tile=128)
    assert prof.attn_fwd == clean.attn_fwd  # the fit never saw the held-out lengths
    assert prof.fit_error["attn_fwd_heldout_mape_pct"] == pytest.approx(50.0, rel=1e-4)  # t = 2*pred: |pred-t|/t = 1/2
    assert prof.fit_error["attn_bwd_heldout_mape_pct"] < 1e-4


def test_too_few_points_are_refused():
    with pytest.raises(ValueError, match="at least 3"):
        fit_profile("x", Timings([64, 128], [1.0, 2.0], [1.0, 2.0], [64, 128, 256], [1.0, 2.0, 3.0], [1.0, 2.0, 3.0]))
