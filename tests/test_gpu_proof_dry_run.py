"""benchmarks/gpu/run_all.py in its dry-run mode (CPU, reference attention, tiny shapes), so the GPU proof
cannot rot while no GPU is around: every part runs to the end, the JSON holds each part's figures, the markdown
section lands between its markers, and a budget too small to measure stops a part with what it has."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu" / "run_all.py"
PARTS = ("calibrate", "slices", "accuracy", "balance", "runtime", "loader", "cp_link", "cp_shards")


def _run(*args: str, timeout: float = 480) -> subprocess.CompletedProcess:
    """Every part; 2.5 minutes on the busy 2-core machine, most of it the CP and pipeline checks' three spawns
    of ranks (2, 2 and 4 processes importing torch)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, str(SCRIPT), "--dry-run", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)


@pytest.mark.multiprocess
def test_dry_run_runs_every_part(tmp_path):
    docs = tmp_path / "benchmarks.md"
    docs.write_text("# Benchmarks\n\n## Other\n\nkept\n")
    res = _run("--out", str(tmp_path / "out"), "--write-docs", str(docs))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "gpu-proof.json").read_text())
    assert report["dry_run"] is True
    env = report["environment"]
    for key in ("torch", "cuda", "driver", "gpu", "attention_backend", "packages"):
        assert key in env
    assert env["attention_backend"] == "reference"
    assert list(report["parts"]) == list(PARTS)
    for name, part in report["parts"].items():
        assert part["status"] == "done", (name, part.get("error"), part.get("traceback"))
    p = report["parts"]
    assert len(p["calibrate"]["shapes"]) == 1 and (tmp_path / "out" / "profile-tiny-dry-run.json").exists()
    assert p["calibrate"]["cli"]["exit"] == 0 and "slice term" in p["calibrate"]["cli"]["output"]
    assert (tmp_path / "out" / "cli-slices.csv").exists() and (tmp_path / "out" / "cli-profile.json").exists()
    assert len(p["slices"]["rows"]) == p["slices"]["rows_planned"] == 9
    assert (tmp_path / "out" / "slices.csv").read_text().startswith("q,p,fwd_ms,bwd_ms")
    kinds = {r["kind"] for r in p["accuracy"]["rows"]}
    assert kinds == {"one long", "many short", "mixed", "slices"}
    bal = p["balance"]
    assert {r["strategy"] for r in bal["rows"]} == {"fixed", "auto", "concat"}
    assert all("error" not in r for r in bal["rows"])
    # every strategy timed over the same steps (at least 2), so their tokens/s compare like with like
    assert bal["steps"] >= 2 and [r["steps"] for r in bal["rows"]] == [bal["steps"]] * 3
    # planned and predicted with part 2's calibrated profile, handed to PlanConfig as a profile JSON path
    assert bal["profile"].startswith("the profile calibrated in part 2") and bal["plan_model"].endswith(".json")
    assert (tmp_path / "out" / Path(bal["plan_model"]).name).exists() and bal["planner_warnings"] == []
    # the runtime on CPU float32 against the float64 reference: errors of float32 rounding, not of logic
    errs = p["runtime"]["distributed_max_rel_err"]
    assert {k.split("/")[0] for k in errs} == {"cp", "remap"} and max(errs.values()) < 1e-4
    assert max(p["runtime"]["slice_executor"].values()) < 1e-4
    # the pipeline schedule with its stage processes over gloo, point to point copied through the CPU: every
    # schedule at PP 2 and PP 4 against the float64 reference (a lost copy-back fails the run or shows here)
    pipe = p["runtime"]["pipeline_max_rel_err"]
    assert set(pipe) == {f"pipeline/{c}/{x}" for c in ("pp2/1f1b", "pp2/interleaved/vpp2", "pp2/zb-h1",
                                                       "pp2/zb-v/vpp2", "pp4/1f1b", "pp4/zb-h1")
                         for x in ("loss", "grads")}, p["runtime"]
    assert all(v < 1e-4 for v in pipe.values()), pipe  # a NaN fails too
    # every tensor that crossed ranks went through the staging: point to point only, no other collective
    assert all(v["send"] > 0 and v["recv"] == v["send"] and v["other collectives"] == {}
               for v in p["runtime"]["pipeline_staged_p2p"].values()), p["runtime"]["pipeline_staged_p2p"]
    assert list(p["runtime"]["pipeline_staged_p2p"]) == ["pp2", "pp4"]
    assert p["loader"]["batches"] == 6 and p["loader"]["loader_tokens_per_s"] > 0
    assert p["loader"]["plan_warnings"] == []  # a model that fits the device: no "no candidate plan fits"
    # packloader calibrate --cp under torchrun (2 CPU ranks): a device file with the fitted intra-node CP link
    assert p["cp_link"]["exit"] == 0, p["cp_link"]["output"]
    assert p["cp_link"]["cp_link"]["intra_node_gbps"] > 0 and (tmp_path / "out" / "device-cp.json").exists()
    # one device's CP shards of each document against 1/s of it: a device file with cp_shard at every size timed
    from packloader.balancers.cost.devices import read_device

    assert {(r["length"], r["size"]) for r in p["cp_shards"]["rows"]} == {(128, 2), (128, 4), (64, 2), (64, 4)}
    assert set(read_device(tmp_path / "out" / "device-cp-shards.json").cp_shard.fwd) == {2, 4}
    text = docs.read_text()
    assert "kept" in text and "<!-- SECTION:gpu-proof -->" in text and "DRY RUN" in text
    assert (tmp_path / "out" / "gpu-proof.md").read_text().strip() in text
    assert "| pipeline/pp2/zb-v/vpp2/grads |" in text


def _run_all():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import run_all
    finally:
        sys.path.remove(str(SCRIPT.parent))
    return run_all


def test_a_spent_budget_stops_parts_and_keeps_the_run(tmp_path):
    run_all = _run_all()
    from gpu_report import render

    ctx = run_all.make_ctx(run_all.parse(["--dry-run"]))
    parts = {name: run_all.run_part(name, ctx, 0.0, tmp_path) for name in ("accuracy", "slices")}
    assert parts["accuracy"]["status"] == "budget" and "time budget" in parts["accuracy"]["stopped"]
    assert parts["slices"]["status"] == "done" and parts["slices"]["rows"] == []  # stopped before its first slice
    md = render({"command": "x", "dry_run": True, "started": "now", "parts": parts,
                 "environment": {"device": "cpu", "torch": "t", "dtype": "float32", "attention_backend": "reference"}})
    assert "Stopped: time budget" in md and "**slices** (done" in md


def test_dynamic_cp_shards_part_with_its_budget_spent_stops(tmp_path):
    run_all = _run_all()
    ctx = run_all.make_ctx(run_all.parse(["--dry-run", "--parts", "cp_shards"]))
    res = run_all.run_part("cp_shards", ctx, 0.0, tmp_path)
    assert res["status"] == "budget" and "before the first shard" in res["stopped"]
    assert not (tmp_path / "device-cp-shards.json").exists()


def test_parts_and_budgets_are_checked(capsys):
    run_all = _run_all()
    with pytest.raises(SystemExit) as e:
        run_all.parse(["--parts", "calibrate,warp"])
    assert e.value.code == 2 and "unknown part(s) ['warp']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        run_all.parse(["--budget-min", "0"])
    # the selected parts share the minutes in the parts' proportions; the full run is the 25 minutes of the issue
    full = run_all.budgets(list(run_all.PARTS), 25.0)
    assert sum(full.values()) == pytest.approx(25 * 60)
    two = run_all.budgets(["slices", "balance"], 11.0)
    assert two["balance"] / two["slices"] == pytest.approx(run_all.PARTS["balance"][1] / run_all.PARTS["slices"][1])
    assert sum(two.values()) == pytest.approx(11 * 60)


def test_a_gpu_run_drops_pending_from_the_heading(tmp_path):
    _run_all()
    from gpu_report import write

    docs = tmp_path / "benchmarks.md"
    docs.write_text("# B\n\n## GPU proof (pending a GPU)\n\nhow to run\n\n<!-- SECTION:gpu-proof -->\nold\n"
                    "<!-- END:gpu-proof -->\n\n## Next\n")
    write("dry figures", tmp_path / "a.md", str(docs))
    assert "(pending a GPU)" in docs.read_text() and "dry figures" in docs.read_text()
    write("gpu figures", tmp_path / "b.md", str(docs), measured=True)
    text = docs.read_text()
    assert "## GPU proof\n\nhow to run" in text and "gpu figures" in text and "old" not in text
    assert text.endswith("## Next\n")


def test_balance_steps_come_from_the_budget():
    _run_all()
    from part_balance import steps_for_budget

    # first steps took 10 + 20 + 20 s; 85 % of 100 s left buys one more round: 2 steps each
    assert steps_for_budget(100.0, [10.0, 20.0, 20.0], 20) == 2
    assert steps_for_budget(1000.0, [10.0, 20.0, 20.0], 20) == 18  # 1 + 850 // 50
    assert steps_for_budget(1000.0, [10.0, 20.0, 20.0], 6) == 6  # --quick's cap
    assert steps_for_budget(-5.0, [10.0, 20.0, 20.0], 20) == 2  # budget spent: still the minimum of 2


def test_balance_without_a_calibration_plans_with_the_shipped_profile(tmp_path):
    run_all = _run_all()
    import part_balance

    ctx = run_all.make_ctx(run_all.parse(["--dry-run"]))  # no calibrate part ran: ctx.results is empty
    res = run_all.run_part("balance", ctx, 0.0, tmp_path)  # and the budget is spent from the start
    assert res["status"] == "done", res.get("traceback")
    assert res["plan_model"] == "llama2-7b" and res["plan_device"] == "h100" and "shipped H100" in res["profile"]
    assert res["steps"] == part_balance.MIN_STEPS and [r["steps"] for r in res["rows"]] == [2, 2, 2]


def test_the_device_file_is_the_gpu_present():
    _run_all()
    from gpu_plan import device_for_gpu

    assert device_for_gpu("NVIDIA H200") == "h200"
    assert device_for_gpu("NVIDIA H100 80GB HBM3") == "h100"
    assert device_for_gpu("NVIDIA A100-SXM4-80GB") == "h100"  # no file of its own: PlanConfig's default


def test_the_h200_runs_balance_plans_replanned_offline_give_its_predictions():
    """reprice_balance.py plans the H200 run's steps again on CPU: its shipped-profile prices are the run's own
    predictions (so the plans are the ones that were timed), and the per-micro-batch cost fitted on auto's row
    brings every other strategy's price within 5 % of its measured time."""
    _run_all()
    from reprice_balance import reprice

    folder = ROOT / "benchmarks" / "gpu" / "results" / "2026-11-26-h200"
    run = {r["strategy"]: r for r in json.loads((folder / "gpu-proof.json").read_text())["parts"]["balance"]["rows"]}
    d, rows = reprice(folder)
    assert {r["strategy"] for r in rows} == set(run)
    for r in rows:
        assert r["shipped"] == pytest.approx(run[r["strategy"]]["step_time_predicted_s"], rel=1e-6)
        assert r["fitted"] == pytest.approx(r["measured"], rel=0.05)
    assert 0.02 < d < 0.04  # about 31 ms per micro-batch per 8-layer stage


@pytest.mark.multiprocess
def test_seconds_replace_the_shares_of_the_named_parts_only(tmp_path):
    # a short lease gives chosen parts fixed budgets; the others keep their share of --budget-min (4 + 4 of 8 min)
    proc = _run("--dry-run", "--parts", "calibrate,slices", "--budget-min", "8", "--seconds", "slices=7",
                "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    parts = json.loads((tmp_path / "gpu-proof.json").read_text())["parts"]
    assert (parts["calibrate"]["budget_s"], parts["slices"]["budget_s"]) == (240.0, 7.0)
    bad = _run("--dry-run", "--parts", "calibrate", "--seconds", "slices=7", "--out", str(tmp_path))
    assert bad.returncode == 2 and "--seconds: each part must be one of --parts (calibrate)" in bad.stderr
