"""A mixture's loader killed by SIGKILL mid-epoch (between saves) and resumed in a new process from its last saved
state: the stitched stream of micro-batches equals one uninterrupted run's, hash by hash."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.docs import token_docs, write_token_shards

pytestmark = pytest.mark.multiprocess  # starts processes

CHILD = Path(__file__).resolve().parent / "helpers" / "mixture_child.py"


def run(spec: dict) -> int:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    return subprocess.run([sys.executable, str(CHILD), json.dumps(spec)], env=env, timeout=600).returncode


def test_killed_and_resumed_mixture_equals_one_uninterrupted_run(tmp_path):
    entries = []
    for e, w in enumerate([0.5, 0.3, 0.2]):
        d = tmp_path / f"e{e}"
        d.mkdir()
        entries.append({"name": f"e{e}", "source": write_token_shards(d, token_docs(70, seed=e), shards=2),
                        "weight": w})
    base = {"entries": entries, "epochs": 2, "save_every": 5}
    ref = dict(base, state=str(tmp_path / "ref.pkl"), log=str(tmp_path / "ref.log"))
    assert run(ref) == 0
    want = Path(ref["log"]).read_text().splitlines()
    spec = dict(base, state=str(tmp_path / "k.pkl"), log=str(tmp_path / "k.log"))
    kills = [7, 19, 33]
    for k in kills:  # each run resumes from the last save and dies `k` micro-batches in, counting from the start
        assert run(dict(spec, kill_at=k)) == -9
    assert run(spec) == 0
    got = Path(spec["log"]).read_text().splitlines()
    assert len(want) > kills[-1]
    assert got == want
