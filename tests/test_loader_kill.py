"""Exactly once under SIGKILL (tests/helpers/kill_harness.py): the loader's process is killed at fixed points
(after a micro-batch is logged, between writing a state and renaming it into place, right after saving) and resumed in a
new process from the last saved state; the stitched stream must equal one uninterrupted epoch record by record,
match the source's tokens, and cover every token of the epoch exactly once over all ranks.

The configurations cover Parquet token shards and gzipped JSON Lines text, `auto` (with and without slicing) and
`wlb` (outliers queued across steps), a corpus with two documents of 1,000 x tokens_per_step each, one rank, two ranks in one process and two gloo ranks, PackedLoader and a
StatefulDataLoader with two workers, children forked from a clean parent and one configuration started as fresh
interpreters. All configurations run in one clean parent process (started here), which forks the children.
A shard replaced between a save and the resume (same name and row count, other documents) is refused, naming it.
benchmarks/kill.py runs the same harness at random points, 1,000 of them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent

# Kill points as fractions of the epoch's rounds (a round: one item from every rank), or -1 for the last round.
# Saves every third round, at a few more points and at the last round: a state saved after the pass's last
# micro-batch resumes into that ended pass (no second epoch), and the LATE kill at the last round resumes from it.
EARLY = [{"at": 1, "phase": "log"}, {"at": 0.3, "phase": "save"}, {"at": 0.55, "phase": "saved"},
         {"at": 0.8, "phase": "log"}]
LATE = [{"at": 0.2, "phase": "saved"}, {"at": 0.45, "phase": "log"}, {"at": 0.7, "phase": "save"},
        {"at": -1, "phase": "log"}, {"at": -1, "phase": "saved"}]
SAVES = [0.3, 0.55, 0.7, -1] + [k / 30 for k in range(1, 29, 3)]


def case(fork=True, kills=(EARLY,), **config) -> dict:
    return {"config": config, "fork": fork, "kills": [list(k) for k in kills], "saves": [SAVES] * len(kills)}


CASES = {
    "parquet auto dp1": case(source="parquet", strategy="auto", kills=(EARLY, LATE)),
    "parquet wlb dp2 local": case(source="parquet", strategy="wlb", dp=2, kills=(LATE,)),
    "parquet auto slicing dp2 gloo": case(source="parquet", strategy="auto", slicing=True, dp=2, ranks="gloo",
                                          kills=(EARLY,)),
    "jsonl.gz wlb dp1 fresh interpreters": case(fork=False, source="jsonl.gz", strategy="wlb",
                                                kills=([EARLY[1], LATE[2]],)),
    "jsonl.gz auto slicing dp2 local": case(source="jsonl.gz", strategy="auto", slicing=True, dp=2, kills=(EARLY,)),
    "parquet wlb dp1 workers2": case(source="parquet", strategy="wlb", workers=2, kills=(LATE,)),
    "jsonl.gz auto dp2 local workers2": case(source="jsonl.gz", strategy="auto", dp=2, workers=2, kills=(EARLY,)),
    # two documents of 1,000 x tokens_per_step: kills and saves land inside them (steps end inside a document)
    "giant wlb dp2 local": case(source="giant", strategy="wlb", dp=2, kills=(EARLY,)),
    "giant auto slicing dp1": case(source="giant", strategy="auto", slicing=True, kills=(LATE,)),
}


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    d = tmp_path_factory.mktemp("kill")
    plan, out = d / "plan.json", d / "out.json"
    plan.write_text(json.dumps(list(CASES.values())))
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    root = str(HERE.parent)
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    proc = subprocess.run([sys.executable, str(HERE / "helpers" / "kill_harness.py"), "suite", str(plan), str(out)],
                          capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return dict(zip(CASES, json.loads(out.read_text())))


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.multiprocess
def test_killed_and_resumed_equals_one_uninterrupted_epoch(suite, name):
    got = suite[name]
    assert got["rounds"] >= 12  # enough rounds for the kill points to be distinct
    for run in got["runs"]:
        planned = run["kill_plan"]
        assert run["problems"] == []
        assert run["kills"] == len(planned), (run["kills"], planned)
        assert run["tokens"] > 0
        assert (run["lost"], run["repeated"], run["extra_epoch_tokens"]) == (0, 0, 0), run
        assert run["token_errors"] == 0 and run["order_errors"] == 0, run
        # every restart after the first kill resumed from a saved state, or from the start before any save
        resumes = [c["resume"] for c in run["children"]]
        assert resumes[0] is None and len(resumes) == len(planned) + 1


def test_the_harness_sees_a_lost_and_a_repeated_micro_batch(tmp_path):
    """The comparison can fail: drop one logged micro-batch of an uninterrupted run, and log another twice."""
    from helpers import kill_harness as kh

    cfg = kh.KillConfig(source="jsonl.gz", strategy="wlb")
    paths, docs = kh.write_corpus(cfg.source, tmp_path / "corpus")
    h = kh.Harness(cfg, paths, docs, tmp_path)
    h.reference = ref = [[0, 0, i, 1, 0, [[i, 0, 3]], "", "", None] for i in range(3)]  # hand-made records
    (shards, rows), n = h._locate()
    tokens = sum(len(docs[s][r]) for s, r in zip(shards.tolist(), rows.tolist()))
    lost = kh.RunResult("x")
    h.verify(ref[:2], lost)
    assert lost.lost == tokens - 6 and lost.repeated == 0 and lost.order_errors == 1
    twice = kh.RunResult("x")
    h.verify(ref + ref[2:], twice)
    assert twice.repeated == 3 and twice.order_errors == 1
    extra = kh.RunResult("x")
    h.verify(ref + [[0, 9, 0, 1, 1, [[n + 5, 0, 4]], "", "", None]], extra)
    assert extra.extra_epoch_tokens == 4 and extra.repeated == 4


@pytest.mark.multiprocess
@pytest.mark.parametrize("source", ["parquet", "jsonl.gz"])
def test_a_shard_replaced_between_save_and_resume_is_refused_naming_it(tmp_path, source):
    """Killed after saving; one shard then replaced by another with the same name and row count; the resumed
    process refuses the state, naming that shard and no other (children start as fresh interpreters)."""
    from helpers import kill_harness as kh

    cfg = kh.KillConfig(source=source, strategy="wlb")
    msg = kh.run_replaced_shard(cfg, tmp_path, at=4, shard=1)
    name = "tok-001.parquet" if source == "parquet" else "text-001.jsonl.gz"
    assert "this state was saved by a differently configured loader" in msg and f"source.{name}: saved " in msg, msg
    assert "-000." not in msg.split("differently configured loader", 1)[1].split("\n")[0], msg


@pytest.mark.multiprocess
def test_the_benchmark_writes_only_its_section(tmp_path):
    """benchmarks/kill.py at two points (its edge run): it runs, and rewrites only its own section."""
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# B\n\n<!-- SECTION:loader -->\nkeep me\n<!-- END:loader -->\n\n"
                   "<!-- SECTION:kill -->\n(pending)\n<!-- END:kill -->\n\ntail\n")
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    proc = subprocess.run([sys.executable, str(HERE.parent / "benchmarks" / "kill.py"), "--points", "2", "--only",
                           "jsonl.gz wlb no-slicing dp1 workers2", "--write", str(doc)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    text = doc.read_text()
    assert "keep me" in text and text.endswith("\ntail\n") and "(pending)" not in text
    assert "- 2 kill points in 1 configurations: 0 tokens lost, 0 repeated." in text
    assert "| jsonl.gz wlb no-slicing dp1 workers2 |" in text
