"""examples/train_deepspeed.py and examples/train_megatron.py (PP 1 and PP 2), each on 2 gloo ranks through
torchrun as a user runs them: the process exits 0 without "terminate called" (the DeepSpeed one without
destroy_process_group), every step's line is printed once (rank 0), the resumed run repeats
the uninterrupted run's steps (same pieces, same loss), the DP replicas end with equal parameters (their gradients
were reduced), and the epoch trains every byte of the corpus files once:
each document's pieces tile [0, its length) and the lengths are the files' own sizes plus the EOS token, read
here from the files."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import sysconfig
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_example(name: str, out: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(ROOT / "examples" / name), "--out", str(out), *args],
                          capture_output=True, text=True, env=env, timeout=900, cwd=out.parent)


def corpus_lengths() -> list[int]:
    """The stdlib json package's files in bytes, plus the EOS the loader appends (the `bytes` tokenizer: one id per
    byte)."""
    files = sorted((Path(sysconfig.get_paths()["stdlib"]) / "json").glob("*.py"))
    return sorted(len(p.read_bytes()) + 1 for p in files if p.stat().st_size > 0)


def check_tiles(pieces_by_rank: list[dict], steps: list[str]) -> None:
    """Each document's pieces over `steps` and ranks tile [0, length) once; the lengths are the files'."""
    by_doc = defaultdict(list)
    for pieces in pieces_by_rank:
        for step in steps:
            for doc, start, end in pieces.get(step, []):
                by_doc[doc].append((start, end))
    lengths = []
    for doc, spans in by_doc.items():
        spans.sort()
        assert spans[0][0] == 0 and all(a[1] == b[0] for a, b in zip(spans, spans[1:])), (doc, spans)
        lengths.append(spans[-1][1])
    assert sorted(lengths) == corpus_lengths()


def check_run(res: subprocess.CompletedProcess, out: Path, stages: int = 1) -> dict:
    assert "terminate called" not in res.stderr, res.stderr[-3000:]
    assert res.returncode == 0, res.stderr[-3000:]
    result = json.loads((out / "result.json").read_text())
    assert result["world"] == 2
    first, second = result["first"], result["second"]
    # the pieces of one DP rank: every pipeline stage reads the same batches, so count stage 0's
    keep = [r for r in range(2) if result.get("pp_rank", [0, 0])[r] == 0]
    assert len(keep) == 2 // stages
    steps = sorted(first[0]["losses"], key=int)
    k = result["resume_at"]
    resumed = [s for s in steps if int(s) >= k]
    assert sorted(second[0]["losses"], key=int) == resumed and len(resumed) >= 3
    check_tiles([first[r]["pieces"] for r in keep], steps)  # run 1: the whole epoch, each byte once
    check_tiles([{s: p for s, p in first[r]["pieces"].items() if int(s) < k} for r in keep]
                + [second[r]["pieces"] for r in keep], steps)  # run 1 up to the checkpoint, then run 2
    for r in keep:
        assert {s: second[r]["pieces"][s] for s in resumed} == {s: first[r]["pieces"][s] for s in resumed}
    for s in resumed:  # same model, optimizer and data from the checkpoint on: the same losses
        assert second[0]["losses"][s] == pytest.approx(first[0]["losses"][s], rel=1e-6, abs=0)
    if stages == 1:  # the DP gradient reduction ran: both replicas hold the same parameters after every run
        assert first[0]["checksum"] == first[1]["checksum"] and second[0]["checksum"] == second[1]["checksum"]
    losses = [first[0]["losses"][s] for s in steps]
    assert losses[-1] < losses[0] - 0.5  # it trains
    lines = re.findall(r"^step (\d+): loss ", res.stdout, flags=re.M)
    assert sorted(lines, key=int) == sorted(steps + resumed, key=int)  # one line per step and run: rank 0's
    return result


@pytest.mark.multiprocess
def test_deepspeed_example_trains_resumes_exactly_and_exits_cleanly(tmp_path):
    pytest.importorskip("deepspeed")
    pytest.importorskip("transformers")
    out = tmp_path / "ds"
    check_run(run_example("train_deepspeed.py", out), out)


@pytest.mark.multiprocess
@pytest.mark.parametrize("pp", [1, 2])
def test_megatron_example_trains_resumes_exactly(tmp_path, pp):
    pytest.importorskip("megatron.core")
    out = tmp_path / f"mg{pp}"
    result = check_run(run_example("train_megatron.py", out, "--pp", str(pp)), out, stages=pp)
    assert result["pp"] == pp
