"""`packloader plan` end to end: the JSON lines it writes are checked by a reader written here against the raw
lengths (every token of every drawn document exactly once, the token cap, slice rules), for .npy, text and
Parquet inputs, in a subprocess and through main([...]); bad input exits with status 2 and names the problem."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from packloader.cli.main import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def long_tail_lengths(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    body = rng.lognormal(np.log(600), 1.3, n)
    tail = 6000 * (1 + rng.pareto(1.3, n))
    return np.clip(np.rint(np.where(rng.random(n) < 0.04, tail, body)), 1, 40000).astype(np.int64)


def drawn_tokens(lengths: np.ndarray, tokens_per_step: int, context: int, steps: int) -> dict[int, int]:
    """How many tokens of each document `steps` steps draw: each takes pieces of at most `context` tokens until
    tokens_per_step is reached (a document's later pieces go to the next step)."""
    out: dict[int, int] = {}
    i, off = 0, 0
    for _ in range(steps):
        got = 0
        while i < len(lengths) and got < tokens_per_step:
            n = min(context, int(lengths[i]) - off)
            got, off = got + n, off + n
            out[i] = off
            if off == lengths[i]:
                i, off = i + 1, 0
    return out


def check_jsonl(text: str, lengths: np.ndarray, *, dp: int, max_tokens: int, context: int, tokens_per_step: int,
                steps: int, slicing: bool) -> list[dict]:
    records = [json.loads(line) for line in text.splitlines() if line.strip()]
    assert [r["step"] for r in records] == list(range(len(records)))
    assert len(records) >= 1
    drawn = drawn_tokens(lengths, tokens_per_step, context, steps)
    n_docs = len(drawn)
    seen = {d: np.zeros(int(lengths[d]), np.int64) for d in range(n_docs)}
    slices = 0
    for rec in records:
        assert len(rec["ranks"]) == dp
        assert len({len(r) for r in rec["ranks"]}) == 1, "every rank runs the same number of micro-batches"
        for rank in rec["ranks"]:
            chain_end: dict[tuple[int, int], tuple[int, int]] = {}  # (doc, attend_from) -> (end, position)
            for pos, mb in enumerate(rank):
                assert sum(e - s for _, s, e, _ in mb) <= max_tokens
                for doc, s, e, af in mb:
                    assert doc in seen, f"doc {doc} was never drawn (only {n_docs} were)"
                    assert 0 <= s < e <= lengths[doc]
                    piece = (s // context) * context
                    assert e <= piece + context, "a segment crosses an independent piece's boundary"
                    if af < s:
                        slices += 1
                        assert slicing and af == piece
                        prev = chain_end.get((doc, af))
                        assert prev is not None and prev[0] == s and prev[1] < pos
                    else:
                        assert af == s
                    chain_end[(doc, af)] = (e, pos)
                    seen[doc][s:e] += 1
    for d, arr in seen.items():
        assert (arr[:drawn[d]] == 1).all() and not arr[drawn[d]:].any(), \
            f"doc {d}: some token appears {int(arr.max())} times, some {int(arr.min())}"
    if not slicing:
        assert slices == 0
    return records


ARGS = ["--dp", "4", "--pp", "2", "--max-tokens", "8192", "--context", "16384", "--tokens-per-step", "65536",
        "--steps", "4"]
KW = dict(dp=4, max_tokens=8192, context=16384, tokens_per_step=65536, steps=4)


@pytest.mark.multiprocess
def test_subprocess_npy_auto(tmp_path):
    lengths = long_tail_lengths(400, 1)
    np.save(tmp_path / "l.npy", lengths)
    out = tmp_path / "plan.jsonl"
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, "-m", "packloader.cli.main", "plan", "--lengths", str(tmp_path / "l.npy"),
                          *ARGS, "--strategy", "auto", "--out", str(out)], capture_output=True, text=True, env=env,
                         cwd=ROOT, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "imbalance" in res.stderr and "dropped 0" in res.stderr
    recs = check_jsonl(out.read_text(), lengths, slicing=True, **KW)
    assert "costs" in recs[0]


@pytest.mark.parametrize("strategy", ["wlb", "hydraulis", "slimpack", "fixed"])
def test_main_text_input_each_strategy_no_slicing(tmp_path, capsys, strategy):
    lengths = long_tail_lengths(300, 2)
    (tmp_path / "l.txt").write_text("\n".join(str(x) for x in lengths) + "\n\n")
    out = tmp_path / "p.jsonl"
    args = ["plan", "--lengths", str(tmp_path / "l.txt"), "--dp", "3", "--pp", "1", "--max-tokens", "4096",
            "--context", "4096", "--tokens-per-step", "30000", "--steps", "3", "--strategy", strategy,
            "--no-slicing", "--out", str(out), "--quiet"]
    assert main(args) == 0
    check_jsonl(out.read_text(), lengths, dp=3, max_tokens=4096, context=4096, tokens_per_step=30000, steps=3, slicing=False)


def test_main_parquet_input_slimpack_to_stdout(tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    lengths = long_tail_lengths(250, 3)
    pq.write_table(pa.table({"text_id": np.arange(len(lengths)), "length": lengths}), tmp_path / "l.parquet")
    assert main(["plan", "--lengths", str(tmp_path / "l.parquet"), *ARGS, "--strategy", "slimpack"]) == 0
    text = capsys.readouterr().out
    check_jsonl(text, lengths, slicing=True, **KW)


def test_wlb_delays_then_flushes_everything(tmp_path):
    """Outliers held back by wlb still appear by the end of the run (the last step flushes)."""
    lengths = np.array(([7000] + [100] * 30) * 6, np.int64)
    np.save(tmp_path / "l.npy", lengths)
    out = tmp_path / "p.jsonl"
    args = ["plan", "--lengths", str(tmp_path / "l.npy"), "--dp", "2", "--max-tokens", "8192", "--context", "8192",
            "--tokens-per-step", "10000", "--steps", "5", "--strategy", "wlb", "--micro-batches", "2",
            "--out", str(out), "--quiet"]
    assert main(args) == 0
    recs = check_jsonl(out.read_text(), lengths, dp=2, max_tokens=8192, context=8192, tokens_per_step=10000, steps=5,
                       slicing=False)
    assert any(r.get("delayed") for r in recs), "the test expects wlb to delay an outlier"


def test_documents_running_out_stop_early(tmp_path):
    lengths = np.array([500, 600, 700], np.int64)
    np.save(tmp_path / "l.npy", lengths)
    out = tmp_path / "p.jsonl"
    assert main(["plan", "--lengths", str(tmp_path / "l.npy"), "--tokens-per-step", "1000", "--steps", "10",
                 "--max-tokens", "1000", "--out", str(out), "--quiet"]) == 0
    recs = check_jsonl(out.read_text(), lengths, dp=1, max_tokens=1000, context=1000, tokens_per_step=1000, steps=10,
                       slicing=True)
    assert len(recs) == 2  # [500, 600] then [700]


def _bad(tmp_path, capsys, args, *needles):
    code = main(["plan", *args, "--quiet"])
    err = capsys.readouterr().err
    assert code == 2, err
    for n in needles:
        assert n in err, err


def test_bad_inputs_exit_2_naming_the_problem(tmp_path, capsys):
    np.save(tmp_path / "ok.npy", np.array([10, 20, 30]))
    np.save(tmp_path / "neg.npy", np.array([10, -4, 30]))
    np.save(tmp_path / "frac.npy", np.array([10.0, 2.5, 30.0]))
    np.save(tmp_path / "twod.npy", np.ones((2, 2), np.int64))
    (tmp_path / "bad.txt").write_text("12\nabc\n")
    (tmp_path / "zero.txt").write_text("12\n-3\n")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"len": [1, 2]}), tmp_path / "p.parquet")
    _bad(tmp_path, capsys, ["--lengths", str(tmp_path / "missing.npy")], "missing.npy", "no such")
    _bad(tmp_path, capsys, ["--lengths", str(tmp_path / "neg.npy")], "neg.npy", "entry 1", "element 1")
    _bad(tmp_path, capsys, ["--lengths", str(tmp_path / "frac.npy")], "frac.npy", "entry 1", "whole number")
    _bad(tmp_path, capsys, ["--lengths", str(tmp_path / "twod.npy")], "twod.npy", "1-D")
    _bad(tmp_path, capsys, ["--lengths", str(tmp_path / "bad.txt")], "bad.txt", "line 2")
    _bad(tmp_path, capsys, ["--lengths", str(tmp_path / "zero.txt")], "zero.txt", "line 2", "negative")
    _bad(tmp_path, capsys, ["--lengths", str(tmp_path / "p.parquet")], "p.parquet", "'length'", "len")
    _bad(tmp_path, capsys, ["--lengths", str(tmp_path / "ok.npy"), "--dp", "0"], "--dp")
    _bad(tmp_path, capsys, ["--lengths", str(tmp_path / "ok.npy"), "--max-tokens", "-5"], "--max-tokens")
    _bad(tmp_path, capsys, ["--lengths", str(tmp_path / "ok.npy"), "--strategy", "nope"], "--strategy")
    _bad(tmp_path, capsys, ["--lengths", str(tmp_path / "ok.npy"), "--model", "no-such-model"], "--model", "no-such-model")
    _bad(tmp_path, capsys, ["--lengths", str(tmp_path / "ok.npy"), "--no-slicing", "--context", "9000",
                            "--max-tokens", "8192"], "--context", "--no-slicing")
    _bad(tmp_path, capsys, ["--lengths", str(tmp_path / "ok.npy"), "--steps", "0"], "--steps")
    _bad(tmp_path, capsys, ["--lengths", str(tmp_path / "ok.npy"), "--micro-batches", "100000000"], "--micro-batches",
         "65,536")
    _bad(tmp_path, capsys, ["--lengths", str(tmp_path / "ok.npy"), "--max-tokens", "1" + "0" * 21], "--max-tokens")
    _bad(tmp_path, capsys, ["--lengths", str(tmp_path / "ok.npy"), "--seed", "-1"], "--seed")
    _bad(tmp_path, capsys, ["--lengths", str(tmp_path / "ok.npy"), "--pp", "many"], "--pp", "'many'")


def test_auto_names_the_candidates_its_memory_check_drops(tmp_path, capsys):
    """Llama-3-8B at TP 1 with 32K micro-batches does not fit an 80 GiB H100: the summary names the dropped
    candidates with peaks above the limit, 80 GiB x 0.92 usable - 2 GiB reserve = 71.6 GiB (memory.py's
    constants, worked by hand); --memory-gib moves the limit, and with room for everything nothing is dropped."""
    import re

    rng = np.random.default_rng(0)
    np.save(tmp_path / "l.npy", np.minimum(32768, (rng.pareto(1.2, 1500) * 800 + 50).astype(np.int64)))
    base = ["plan", "--lengths", str(tmp_path / "l.npy"), "--dp", "4", "--pp", "2", "--max-tokens", "32768",
            "--tokens-per-step", "262144", "--steps", "2", "--out", str(tmp_path / "p.jsonl")]
    for gib, limit in ((None, 71.6), (60.0, 60 * 0.92 - 2)):
        assert main(base + ([] if gib is None else ["--memory-gib", str(gib)])) == 0
        err = capsys.readouterr().err
        assert "auto dropped" in err, err
        assert f"against {limit:.1f} GiB usable of the {gib or 80:g} GiB H100" in err, err
        peaks = [float(x) for x in re.findall(r"\(peak ([0-9.]+) GiB", err)]
        assert peaks and all(p > limit for p in peaks), err
        assert all(name in ("wlb", "hydraulis", "slimpack", "fixed")
                   for name in re.findall(r"(\w+) at (?:its default|\d+) micro-batches", err)), err
    assert main(base + ["--memory-gib", "100000"]) == 0
    assert "auto dropped" not in capsys.readouterr().err


def test_empty_documents_are_skipped_keeping_ids_and_counted(tmp_path, capsys):
    lengths = [5, 0, 7, 0, 0, 9, 3]
    (tmp_path / "l.txt").write_text("\n".join(map(str, lengths)) + "\n")
    out = tmp_path / "p.jsonl"
    assert main(["plan", "--lengths", str(tmp_path / "l.txt"), "--dp", "2", "--max-tokens", "12", "--context", "12",
                 "--tokens-per-step", "12", "--steps", "5", "--strategy", "fixed", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "holds 3 empty documents (length 0), skipped" in err, err
    tokens: dict[int, int] = {}
    for line in out.read_text().splitlines():
        for rank in json.loads(line)["ranks"]:
            for mb in rank:
                for doc, start, end, _ in mb:
                    tokens[doc] = tokens.get(doc, 0) + end - start
    assert tokens == {0: 5, 2: 7, 5: 9, 6: 3}  # ids are positions in the file, every token once


def test_a_length_beyond_the_piece_bound_is_refused_at_once(tmp_path, capsys):
    """A length of 10^12 would be 1.2e8 pieces at context 8,192: refused before planning, naming the entry."""
    from packloader.sources.lengths_file import MAX_PIECES_PER_DOCUMENT

    np.save(tmp_path / "huge.npy", np.array([10, 10**12, 30]))
    _bad(tmp_path, capsys, ["--lengths", str(tmp_path / "huge.npy")], "huge.npy", "entry 1", "1,000,000,000,000",
         "--context 8,192", "65,536")
    at_bound = tmp_path / "at.npy"  # exactly the bound is planned: 65,536 pieces of 16 tokens
    np.save(at_bound, np.array([MAX_PIECES_PER_DOCUMENT * 16, 5]))
    assert main(["plan", "--lengths", str(at_bound), "--max-tokens", "16", "--tokens-per-step", "64", "--strategy",
                 "fixed", "--out", str(tmp_path / "p.jsonl"), "--quiet"]) == 0
    _bad(tmp_path, capsys, ["--lengths", str(at_bound), "--max-tokens", "15"], "at.npy", "entry 0")
