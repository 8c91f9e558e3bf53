"""Devices are profile files: the shipped h100/h200 hold today's constants, a device added from outside the
package (one file in a folder on PACKLOADER_DEVICE_PATH, or register_device) is used by PlanConfig, `packloader
plan` and `packloader report` with no edit to packloader, and a bad or unknown device is a clear error."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import msgspec
import numpy as np
import pytest

from packloader.balancers.cost import devices, presets
from packloader.balancers.cost.devices import DeviceSpec, known_devices, load_device, register_device
from packloader.balancers.cost.lookup import cost_model_for
from packloader.balancers.cost.measured import measured_profile, profile_path
from packloader.balancers.cost.memory import MemoryModel, memory_model_for
from packloader.balancers.cost.model import CostModel
from packloader.balancers.cost.profile_io import load_profile
from packloader.cli.main import main
from packloader.contracts import ParallelConfig, PlanConfig

# A GPU packloader does not ship, with rates unlike the H100's so that a mix-up shows.
A100X = {
    "name": "a100x",
    "description": "a test GPU: 40 GiB, rates about half an H100's",
    "memory_gib": 40.0,
    "usable_fraction": 0.9,
    "reserve_gib": 1.5,
    "rates": {"name": "a100x-bf16", "attn_fwd_tflops": 150.0, "attn_bwd_tflops": 140.0, "gemm_fwd_tflops": 280.0,
              "gemm_bwd_tflops": 260.0, "hbm_tbps": 1.5, "layer_floor_fwd_us": 20.0, "layer_floor_bwd_us": 40.0,
              "tile": 128},
}


def write_device(folder: Path, spec: dict, name: str | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name or spec['name']}.json"
    path.write_text(json.dumps(spec))
    return path


@pytest.fixture
def device_dir(tmp_path, monkeypatch):
    folder = tmp_path / "devices"
    write_device(folder, A100X)
    monkeypatch.setenv(devices.ENV_PATH, str(folder))
    monkeypatch.setattr(devices, "_REGISTERED", [])
    return folder


def test_shipped_devices_hold_todays_constants():
    h100, h200 = load_device("h100"), load_device("h200")
    assert (h100.memory_gib, h200.memory_gib) == (80.0, 141.0)
    want = dict(attn_fwd_tflops=310.0, attn_bwd_tflops=287.0, attn_bwd_flops_ratio=2.5, gemm_fwd_tflops=600.0,
                gemm_bwd_tflops=571.0, hbm_tbps=2.6, layer_floor_fwd_us=15.0, layer_floor_bwd_us=30.0, tile=128)
    assert h100.rates == DeviceSpec(name="h100-bf16", **want)
    assert h200.rates == DeviceSpec(name="h200-bf16", **{**want, "hbm_tbps": 3.6})
    assert (h100.usable_fraction, h100.reserve_gib) == (0.92, 2.0) == (h200.usable_fraction, h200.reserve_gib)
    assert h100.measured_profile_path() == profile_path().resolve() and h100.measured.shape == "llama2-7b"
    assert h200.measured is None
    assert {"h100", "h200"} <= set(known_devices())


def test_a_device_file_from_outside_the_package_prices_plans_and_memory(device_dir):
    par = ParallelConfig(dp=2, pp=2, tp=2)
    model = cost_model_for(PlanConfig(parallel=par, device="a100x"))  # cost="measured", but a100x has no kernels timed
    shape = presets.get_shape("llama3-8b")
    # hand-worked: attention a = 0.5 * 4 * heads * head_dim * layers per stage / tp / rate
    assert model.profile.attn_fwd.a == pytest.approx(0.5 * 4 * 32 * 128 * 16 / 2 / 150e12, rel=1e-12)
    assert model.profile.lin_fwd.c == pytest.approx(20e-6 * 16, rel=1e-12)
    assert model.profile.device == "analytic:a100x-bf16" and "no measured A100X profile" in model.profile.source
    h100 = cost_model_for(PlanConfig(parallel=par, device="h100", cost="analytic"))
    assert model.profile.attn_fwd.a / h100.profile.attn_fwd.a == pytest.approx(310 / 150)
    mem = memory_model_for("llama3-8b", par, device="a100x")
    ref = MemoryModel(shape, par, memory_gib=40.0, usable_fraction=0.9, reserve_gib=1.5)
    assert mem == ref and mem.limit_bytes() == pytest.approx(40 * 0.9 * 2**30 - 1.5 * 2**30)


def test_a_device_with_its_own_measured_kernels(device_dir):
    """A device file naming a measured profile (relative to its folder): a copy of the H100's gives the H100's
    measured model; the same kernels timed twice as slow give twice the attention."""
    base = json.loads(Path(profile_path()).read_text())
    slow = dict(base, attn_fwd=[2 * x for x in base["attn_fwd"]], attn_bwd=[2 * x for x in base["attn_bwd"]])
    (device_dir / "kernels").mkdir()
    (device_dir / "kernels" / "copy.json").write_text(json.dumps(base))
    (device_dir / "kernels" / "slow.json").write_text(json.dumps(slow))
    h100 = json.loads(Path(load_device("h100").file).read_text())
    for name, prof in (("h100copy", "copy"), ("h100slow", "slow")):
        write_device(device_dir, dict(h100, name=name, measured={"profile": f"kernels/{prof}.json", "shape": "llama2-7b"}))
    par = ParallelConfig(dp=4, pp=2, tp=4)
    ref = cost_model_for(PlanConfig(parallel=par)).profile
    copy = cost_model_for(PlanConfig(parallel=par, device="h100copy")).profile
    assert msgspec.structs.replace(copy, name=ref.name) == ref and copy.name == ref.name.replace("@h100-", "@h100copy-")
    slow_p = cost_model_for(PlanConfig(parallel=par, device="h100slow")).profile
    for part in ("attn_fwd", "attn_bwd"):
        assert msgspec.structs.astuple(getattr(slow_p, part)) == pytest.approx(
            [2 * x for x in msgspec.structs.astuple(getattr(ref, part))], rel=1e-12)
    assert slow_p.lin_table == ref.lin_table


def test_plan_cli_prices_with_the_added_device(device_dir, tmp_path):
    lengths = np.random.default_rng(3).integers(50, 6000, 300)
    np.save(tmp_path / "l.npy", lengths)
    out = tmp_path / "plan.jsonl"
    args = ["plan", "--lengths", str(tmp_path / "l.npy"), "--dp", "2", "--tp", "2", "--max-tokens", "8192",
            "--tokens-per-step", "32768", "--steps", "2", "--strategy", "wlb", "--quiet", "--out", str(out)]
    assert main([*args, "--device", "a100x"]) == 0
    # reference: the analytic model with the file's rates, built here from the dict, not from the file
    rates = msgspec.convert(A100X["rates"], DeviceSpec)
    ref = CostModel(presets.analytic_profile(presets.get_shape("llama3-8b"), ParallelConfig(dp=2, tp=2), rates))
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 2
    checked = 0
    for rec in records:
        for r, rank in enumerate(rec["ranks"]):
            for i, mb in enumerate(rank):
                if not mb:
                    continue
                q = np.array([s[2] - s[1] for s in mb])
                p = np.array([s[1] - s[3] for s in mb])
                assert rec["costs"][r][i] == pytest.approx(ref.microbatch_time_of(q, p), rel=1e-9), (rec["step"], r, i)
                checked += 1
    assert checked > 4


def test_report_cli_uses_the_added_device(device_dir, tmp_path):
    np.save(tmp_path / "l.npy", np.random.default_rng(1).integers(50, 4000, 400))
    args = ["report", "--lengths", str(tmp_path / "l.npy"), "--dp", "2", "--tp", "2", "--model", "llama3-8b",
            "--max-tokens", "4096", "--steps", "2", "--strategies", "fixed,wlb", "--no-plots", "--no-advice", "--no-progress"]
    assert main([*args, "--device", "a100x", "--out", str(tmp_path / "a")]) == 0
    rep = json.loads((tmp_path / "a" / "report.json").read_text())
    assert rep["settings"]["device"] == "a100x" and "a100x-bf16" in rep["settings"]["cost_profile"]
    ref = MemoryModel(presets.get_shape("llama3-8b"), ParallelConfig(dp=2, tp=2), memory_gib=40.0, usable_fraction=0.9,
                      reserve_gib=1.5)
    assert rep["settings"]["memory_cap_tokens"] == ref.tokens_that_fit(tile=128)
    assert main([*args, "--out", str(tmp_path / "b")]) == 0
    h100 = json.loads((tmp_path / "b" / "report.json").read_text())
    assert h100["settings"]["memory_cap_tokens"] > rep["settings"]["memory_cap_tokens"]


def test_register_device_adds_one_file(tmp_path, monkeypatch):
    monkeypatch.setattr(devices, "_REGISTERED", [])
    monkeypatch.delenv(devices.ENV_PATH, raising=False)
    with pytest.raises(ValueError, match="unknown device 'regx'"):
        load_device("regx")
    path = write_device(tmp_path / "elsewhere", dict(A100X, name="regx"))
    dev = register_device(path)
    assert load_device("regx") == dev and dev.memory_gib == 40.0 and dev.file == str(path.resolve())
    assert cost_model_for(PlanConfig(device="regx")).profile.device == "analytic:a100x-bf16"
    clash = write_device(tmp_path / "other", dict(A100X, name="regx"))
    with pytest.raises(ValueError, match="device 'regx' is defined twice"):
        register_device(clash)
    assert load_device("regx") == dev  # the refused file left the search path as it was


def test_unknown_device_lists_the_known_ones(device_dir, tmp_path, capsys):
    with pytest.raises(ValueError) as info:
        load_device("b200")
    msg = str(info.value)
    assert "unknown device 'b200'; known devices: a100x, h100, h200" in msg and str(device_dir) in msg
    with pytest.raises(ValueError, match="unknown device 'b200'"):
        cost_model_for(PlanConfig(device="b200"))
    np.save(tmp_path / "l.npy", np.array([10, 20, 30]))
    assert main(["plan", "--lengths", str(tmp_path / "l.npy"), "--device", "b200", "--quiet"]) == 2
    assert "(--device): PlanConfig.device='b200': unknown device 'b200'; known devices: a100x, h100, h200" in capsys.readouterr().err
    assert main(["report", "--lengths", str(tmp_path / "l.npy"), "--device", "b200", "--out", str(tmp_path / "r"),
                 "--no-progress"]) == 2
    assert "unknown device 'b200'" in capsys.readouterr().err


@pytest.mark.parametrize("case, fragment", [
    ("name_mismatch", "its name field is 'other'; expected the file's name 'bad'"),
    ("missing_field", "not a device profile: Object missing required field `memory_gib`"),
    ("unknown_field", "not a device profile: Object contains unknown field `memroy_gib`"),
    ("negative_rate", "Expected `float` > 0.0"),
    ("not_json", "not valid JSON"),
    ("measured_missing", "measured.profile 'nowhere.json' is not a file"),
])
def test_a_bad_device_file_names_the_file(case, fragment, tmp_path, monkeypatch):
    monkeypatch.setattr(devices, "_REGISTERED", [])
    folder = tmp_path / "devs"
    spec = dict(A100X, name="bad")
    if case == "name_mismatch":
        spec["name"] = "other"
    elif case == "missing_field":
        del spec["memory_gib"]
    elif case == "unknown_field":
        spec["memroy_gib"] = 1.0
    elif case == "negative_rate":
        spec["rates"] = dict(spec["rates"], hbm_tbps=-1.0)
    elif case == "measured_missing":
        spec["measured"] = {"profile": "nowhere.json", "shape": "llama2-7b"}
    path = write_device(folder, spec, name="bad")
    if case == "not_json":
        path.write_text("{not json")
    monkeypatch.setenv(devices.ENV_PATH, str(folder))
    with pytest.raises(ValueError) as info:
        load_device("bad")
    assert str(path) in str(info.value) and fragment in str(info.value)


def test_a_name_in_two_files_and_a_bad_path_entry_are_errors(tmp_path, monkeypatch):
    monkeypatch.setattr(devices, "_REGISTERED", [])
    write_device(tmp_path / "one", A100X)
    write_device(tmp_path / "two", A100X)
    monkeypatch.setenv(devices.ENV_PATH, f"{tmp_path / 'one'}:{tmp_path / 'two'}")
    with pytest.raises(ValueError, match=r"device 'a100x' is defined twice: .*one/a100x.json and .*two/a100x.json"):
        load_device("h100")
    shutil.copy(devices.DEVICES_DIR / "h100.json", tmp_path / "h100.json")
    monkeypatch.setenv(devices.ENV_PATH, str(tmp_path / "h100.json"))
    with pytest.raises(ValueError, match="device 'h100' is defined twice"):
        load_device("h100")
    monkeypatch.setenv(devices.ENV_PATH, str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="missing .* is neither a folder nor a device profile"):
        load_device("h100")


def test_measured_profile_of_the_default_device_is_the_shipped_one():
    shape, par = presets.get_shape("llama3-8b"), ParallelConfig(pp=2, tp=2)
    assert measured_profile(shape, par) == measured_profile(shape, par, base=load_profile(profile_path()),
                                                            device=load_device("h100"))
