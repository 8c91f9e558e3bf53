"""Part 7, the CP link: `packloader calibrate --cp intra` itself, under torchrun with one process per GPU of this
node, times the K/V all-gather per-document CP runs over groups of 2, 4, ... GPUs and writes OUT/device-cp.json, a
device file (the h100 one's fields) whose cp_link.intra_node half is the fitted bandwidth and latency. One GPU
cannot measure a link: the part then says so. The dry run: two CPU processes over gloo."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from gpu_common import Budget, BudgetExceeded, Ctx

ROOT = Path(__file__).resolve().parents[2]


def run(ctx: Ctx, budget: Budget, out_dir) -> dict:
    gpus = 2 if ctx.dry_run else torch.cuda.device_count() if ctx.cuda else 0
    if gpus < 2:
        return {"skipped": f"a CP link needs 2 or more GPUs in the node; this one has {gpus}"}
    out = Path(out_dir) / "device-cp.json"
    argv = ["calibrate", "--cp", "intra", "--device", ctx.device.type, "--repeats", str(ctx.repeats), "--warmup",
            str(ctx.warmup), "--gpus-per-node", str(gpus), "--out", str(out)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}",
           "-m", "packloader.cli.main", *argv]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=max(5.0, budget.left()), env=env, cwd=ROOT)
    except subprocess.TimeoutExpired:
        raise BudgetExceeded(f"time budget of {budget.seconds:.0f} s spent timing the CP all-gather") from None
    found = {"command": f"torchrun --nproc-per-node {gpus} -m packloader.cli.main " + " ".join(argv),
             "exit": res.returncode, "output": (res.stdout + res.stderr)[-3000:]}
    if res.returncode == 0:
        found["device_file"] = out.name
        found["cp_link"] = json.loads(out.read_text())["cp_link"]
    return found
