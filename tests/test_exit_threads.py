"""A loader's background threads end with the process: closed graphs, graphs dropped unclosed and graphs still
open at exit. Without this, a training script that left two loaders mid-epoch (one restored from the other's
state) and did not call destroy_process_group finished its work, then died of SIGABRT at exit ("terminate called
without an active exception"): a daemon thread frozen inside the rank store's C++ poll (issue 33)."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from packloader import PackedLoader, PlanConfig
from packloader.loader import graph_threads

ROOT = Path(__file__).resolve().parents[1]


def _loader() -> PackedLoader:
    rng = np.random.default_rng(1)
    docs = [rng.integers(0, 250, size=int(n)).astype(np.int32) for n in rng.integers(20, 600, size=300)]
    cfg = PlanConfig(strategy="wlb", max_tokens=1024, context=256, tokens_per_step=2048, num_micro_batches=2,
                     allow_slicing=False, model="tiny")
    return PackedLoader(docs, config=cfg, prefetch=4, append_eos=False, epochs=1)


def _started(loader) -> list[threading.Thread]:
    """The threads the loader's graph started for its first batch (those not running before it)."""
    before = set(threading.enumerate())
    next(iter(loader))
    new = [t for t in threading.enumerate() if t not in before]
    assert new, "the loader should plan and collate in background threads (num_threads=2 by default)"
    return new


def test_a_loader_dropped_unclosed_stops_its_threads():
    threads = _started(_loader())  # the loader is garbage at once: nothing holds it
    gc.collect()
    for t in threads:
        t.join(timeout=120)  # a bound for a stuck thread, not a timing assertion
    assert [t.name for t in threads if t.is_alive()] == []


def test_the_exit_hook_stops_an_open_loader_and_waits_for_its_threads():
    loader = _loader()
    threads = _started(loader)
    graph_threads.stop_all()  # what atexit runs: it returns once the threads ended
    assert [t.name for t in threads if t.is_alive()] == []
    assert loader is not None


@pytest.mark.multiprocess
def test_two_ranks_leaving_loaders_mid_epoch_exit_cleanly(tmp_path):
    """torchrun, 2 gloo ranks, 6 loaders left mid-epoch per rank, rank 0 waiting on rank 1's plans: measured
    before the fix, 3 runs of 3 aborted (rank 0, SIGABRT, torchrun exit 1); after it 3 of 3 exit 0."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                          str(ROOT / "tests" / "helpers" / "abandoned_loaders.py")],
                         capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert "terminate called" not in res.stderr, res.stderr[-3000:]
    assert "Exception ignored" not in res.stderr, res.stderr[-3000:]
    assert res.returncode == 0, res.stderr[-3000:]
    assert sorted(line for line in res.stdout.splitlines() if "loaders trained" in line) == [
        "rank 0: 6 loaders trained to step 4", "rank 1: 6 loaders trained to step 4"]
