"""Measuring CP links for per-document CP's cost model (issue 26): the fit recovers a hand-made link, and the
measurement runs over a real two-rank gloo group (a CPU dry run: the numbers that matter come from NCCL)."""

from __future__ import annotations

import pytest
from helpers.distributed import run_ranks

from packloader.runtime.calibrate_cp import fit_cp_link, time_all_gather


def test_dynamic_cp_fit_recovers_bandwidth_and_latency():
    # 45 GB/s and 15 us per ring step, by hand: seconds = (s - 1) x 15e-6 + bytes / 45e9
    samples = [(s, b, (s - 1) * 15e-6 + b / 45e9) for s in (2, 4, 8) for b in (1e6, 1e8, 1e9)]
    gbps, lat_us = fit_cp_link(samples)
    assert gbps == pytest.approx(45.0, rel=1e-9) and lat_us == pytest.approx(15.0, rel=1e-6)
    with pytest.raises(ValueError, match="two different sizes"):
        fit_cp_link(samples[:1])


def _measure(rank: int, world: int):
    return time_all_gather([64, 4096], 256, repeats=2, warmup=1)


@pytest.mark.multiprocess
def test_dynamic_cp_all_gather_timed_over_gloo():
    results = run_ranks(_measure, 2, timeout=120)
    for got in results:
        assert [(s, b) for s, b, _ in got] == [(2, 64 * 256), (2, 4096 * 256)]  # one peer's rows received
        assert all(t > 0 for _, _, t in got)
