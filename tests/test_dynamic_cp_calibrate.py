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


def _calibrate_cli(rank: int, world: int, out: str):
    from packloader.cli.main import main

    return main(["calibrate", "--cp", "intra", "--device", "cpu", "--repeats", "1", "--warmup", "0",
                 "--gpus-per-node", "4", "--out", out])


@pytest.mark.multiprocess
def test_dynamic_cp_calibrate_cli_writes_a_device_file_with_the_fitted_link(tmp_path):
    """`packloader calibrate --cp intra` over 4 gloo ranks (groups of 2 and 4): a device file that loads, named
    for its file, the h100 file's other fields and inter-node half kept, the intra-node half measured."""
    from packloader.balancers.cost.devices import load_device, read_device

    out = tmp_path / "cpu-dry.json"
    assert run_ranks(_calibrate_cli, 4, str(out), timeout=180) == [0, 0, 0, 0]
    dev, h100 = read_device(out), load_device("h100")
    assert dev.name == "cpu-dry" and dev.rates == h100.rates and dev.memory_gib == h100.memory_gib
    assert dev.measured_profile_path() == h100.measured_profile_path()  # re-pointed from the new folder
    link, ref = dev.cp_link, h100.cp_link
    assert (link.inter_node_gbps, link.inter_node_latency_us) == (ref.inter_node_gbps, ref.inter_node_latency_us)
    assert link.intra_node_gbps != ref.intra_node_gbps and link.intra_node_gbps > 0 and link.gpus_per_node == 4


def test_dynamic_cp_calibrate_cli_outside_torchrun_says_how_to_launch(tmp_path, monkeypatch, capsys):
    from packloader.cli.main import main

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(["calibrate", "--cp", "intra", "--device", "cpu", "--out", str(tmp_path / "x.json")]) == 2
    assert "torchrun --nproc-per-node" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def test_dynamic_cp_device_with_cp_link_replaces_one_half():
    from packloader.balancers.cost.devices import load_device
    from packloader.runtime.calibrate_cp import device_with_cp_link

    dev = device_with_cp_link(load_device("h200"), "inter", 30.0, 20.0, name="mine")
    assert dev.name == "mine" and (dev.cp_link.inter_node_gbps, dev.cp_link.inter_node_latency_us) == (30.0, 20.0)
    assert dev.cp_link.intra_node_gbps == load_device("h200").cp_link.intra_node_gbps
    with pytest.raises(ValueError, match="'intra' or 'inter'"):
        device_with_cp_link(dev, "rack", 1.0, 1.0, name="x")
