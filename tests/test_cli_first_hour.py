"""What a new user meets in the first hour with the CLIs: help text that states the defaults the commands use,
summaries that count what they say they count, and errors that name the flag to change. Each check compares
with a value worked out here by hand, not with what the code under test printed elsewhere."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from packloader.cli.main import main


def run(argv: list[str], capsys) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def flat(text: str) -> str:
    return " ".join(text.split())


def test_report_help_states_the_tokens_per_step_it_derives(tmp_path, capsys):
    """The report's --tokens-per-step defaults to dp x max-tokens x max(4, 2 pp), not PlanConfig's 65536: the
    help says so, and a run without the flag draws that many (dp 2, pp 3, cap 1024: 2 x 1024 x 6 = 12,288)."""
    assert main(["report", "--help"]) == 0
    text = flat(capsys.readouterr().out)
    entry = text[text.index("--tokens-per-step N global"):][:200]
    assert "default dp x max-tokens x max(4, 2 pp); demo 524288" in entry, entry
    assert "65536" not in entry, entry
    assert "the same flags and defaults as `packloader plan` but --tokens-per-step's" in text
    np.save(tmp_path / "l.npy", np.full(200, 500, np.int64))
    code, out, err = run(["report", "--lengths", str(tmp_path / "l.npy"), "--dp", "2", "--pp", "3", "--max-tokens",
                          "1024", "--model", "tiny", "--steps", "1", "--strategies", "fixed", "--no-advice",
                          "--no-plots", "--no-progress", "--out", str(tmp_path / "o")], capsys)
    assert code == 0, err
    assert "12,288 tokens per step" in out, out


def test_plan_summary_counts_each_document_once(tmp_path, capsys):
    """A document cut at --context into pieces that run in different steps is still one document: lengths 300,
    50 and 120 at context and step 100 make 5 pieces over 5 steps, of 3 documents (was: 6, once per step)."""
    (tmp_path / "l.txt").write_text("300\n50\n120\n")
    code, out, err = run(["plan", "--lengths", str(tmp_path / "l.txt"), "--max-tokens", "100", "--context", "100",
                          "--tokens-per-step", "100", "--strategy", "fixed", "--out", str(tmp_path / "p.jsonl")], capsys)
    assert code == 0, err
    summary = re.search(r"packloader plan: (\d+) steps, (\d+) documents, (\d+) tokens", err)
    assert summary, err
    steps = len((tmp_path / "p.jsonl").read_text().splitlines())
    assert summary.groups() == (str(steps), "3", "470"), err


def test_config_file_misspelling_gets_the_close_key(tmp_path, capsys):
    """A misspelt key is named with the key it was probably meant to be; `parallel` is offered only to commands
    with the layout flags."""
    (tmp_path / "run.json").write_text('{"max_tokenz": 4096}')
    np.save(tmp_path / "l.npy", np.array([10, 20]))
    code, _, err = run(["plan", "--lengths", str(tmp_path / "l.npy"), "--config", str(tmp_path / "run.json")], capsys)
    assert code == 2
    assert "unknown key 'max_tokenz'" in err and "did you mean 'max_tokens'?" in err, err
    assert "'parallel': a table of dp, pp, cp, tp, vpp" in err, err
    (tmp_path / "tok.toml").write_text('tokenizr = "bytes"\n')
    (tmp_path / "in.jsonl").write_text('{"text": "a b"}\n')
    code, _, err = run(["tokenize", str(tmp_path / "in.jsonl"), "--out", str(tmp_path / "o"), "--config",
                        str(tmp_path / "tok.toml")], capsys)
    assert code == 2
    assert "unknown key 'tokenizr'" in err and "did you mean 'tokenizer'?" in err, err
    assert "parallel" not in err, err  # tokenize has no layout: a `parallel` table would be refused too
    (tmp_path / "far.json").write_text('{"zzz": 1}')
    code, _, err = run(["plan", "--lengths", str(tmp_path / "l.npy"), "--config", str(tmp_path / "far.json")], capsys)
    assert code == 2 and "unknown key 'zzz'" in err and "did you mean" not in err, err


def test_a_missing_text_column_names_the_flag(tmp_path, capsys):
    """On the command line the way out is --column, not the library's column=."""
    pq.write_table(pa.table({"body": ["one two", "three"]}), tmp_path / "b.parquet")
    (tmp_path / "b.jsonl").write_text('{"body": "one two"}\n')
    for path in ("b.parquet", "b.jsonl"):
        code, _, err = run(["tokenize", str(tmp_path / path), "--out", str(tmp_path / "o"), "--no-progress"], capsys)
        assert code == 2
        assert f"{path}" in err and "['body']" in err and "--column on the command line" in err, err
    code, _, err = run(["tokenize", str(tmp_path / "b.parquet"), "--column", "body", "--tokenizer", "bytes",
                        "--out", str(tmp_path / "o"), "--no-progress"], capsys)
    assert code == 0, err


def test_report_out_that_cannot_be_made_is_named_before_reading(tmp_path, capsys):
    """--out under a regular file: refused naming --out before the data are read (the lengths file named here
    does not exist, so an error about it would mean the data came first)."""
    (tmp_path / "f.txt").write_text("")
    code, _, err = run(["report", "--lengths", str(tmp_path / "absent.npy"), "--out", str(tmp_path / "f.txt" / "r"),
                        "--no-progress"], capsys)
    assert code == 2
    assert f"--out {tmp_path / 'f.txt' / 'r'}: cannot create the directory" in err, err


def test_report_reads_one_kind_of_a_mixed_directory_with_pattern(tmp_path, capsys):
    """The mixed-directory error offers --pattern; the report takes it. Parquet documents of 99 bytes (100 bytes
    tokens with EOS) beside JSONL ones of 49: a step of 256 tokens draws three 100-token documents, 300 tokens."""
    d = tmp_path / "mix"
    d.mkdir()
    pq.write_table(pa.table({"text": ["p" * 99] * 20}), d / "a.parquet")
    (d / "b.jsonl").write_text('{"text": "%s"}\n' % ("j" * 49) * 20)
    base = ["report", str(d), "--tokenizer", "bytes", "--max-tokens", "256", "--tokens-per-step", "256", "--steps",
            "1", "--strategies", "fixed", "--model", "tiny", "--no-shuffle", "--no-advice", "--no-plots",
            "--no-progress", "--out", str(tmp_path / "o")]
    code, _, err = run(base, capsys)
    assert code == 2 and "mixes file formats" in err and "--pattern" in err, err
    code, out, err = run([*base, "--pattern", "*.parquet"], capsys)
    assert code == 0, err
    assert "documents: 3 drawn (300 tokens), median 100," in out, out


def test_tokenize_into_shards_names_overwrite(tmp_path, capsys):
    (tmp_path / "in.jsonl").write_text('{"text": "one two"}\n')
    argv = ["tokenize", str(tmp_path / "in.jsonl"), "--tokenizer", "bytes", "--out", str(tmp_path / "o"),
            "--no-progress"]
    assert run(argv, capsys)[0] == 0
    code, _, err = run(argv, capsys)
    assert code == 2 and "already holds token shards" in err and "--overwrite" in err, err
    assert run([*argv, "--overwrite"], capsys)[0] == 0


def test_bad_input_exits_2_on_every_command(tmp_path, capsys):
    """One convention: bad input is 2 on every command (was 1 for report, tokenize and calibrate, 2 for plan), and
    every --help says so."""
    from packloader.cli.main import COMMANDS

    for command in COMMANDS:
        assert main([command, "--help"]) == 0
        assert "exit status (every packloader command): 0 done; 2 bad input" in flat(capsys.readouterr().out), command
    np.save(tmp_path / "few.npy", np.full(3, 100, np.int64))  # 300 tokens: not one step of 1,024
    code, _, err = run(["report", "--lengths", str(tmp_path / "few.npy"), "--max-tokens", "256", "--tokens-per-step",
                        "1024", "--model", "tiny", "--no-plots", "--no-progress", "--out", str(tmp_path / "o")], capsys)
    assert code == 2 and "the documents hold 300 tokens, fewer than one step" in err, err
    code, _, err = run(["plan", "--lengths", str(tmp_path / "absent.npy")], capsys)
    assert code == 2 and "absent.npy" in err, err
    code, _, err = run(["tokenize", str(tmp_path / "absent.jsonl"), "--out", str(tmp_path / "t")], capsys)
    assert code == 2 and "absent.jsonl" in err, err
    code, _, err = run(["calibrate", "--device", "cpu", "--heads", "4", "--out", str(tmp_path / "p.json")], capsys)
    assert code == 2 and "--hidden" in err, err


def test_plan_given_a_corpus_names_tokenize_and_the_recipe_runs(tmp_path, capsys):
    """`plan corpus.jsonl` and `plan --lengths corpus.jsonl` say to run `packloader tokenize` first; doing what the
    message says plans the corpus: 3 documents of 4, 9 and 2 bytes are 5, 10 and 3 tokens with EOS (bytes)."""
    (tmp_path / "c.jsonl").write_text('{"text": "abcd"}\n{"text": "abcdefghi"}\n{"text": "ab"}\n')
    assert main(["plan", "--help"]) == 0
    assert "`packloader tokenize CORPUS --out DIR`" in flat(capsys.readouterr().out)
    for argv in (["plan", str(tmp_path / "c.jsonl")], ["plan", "--lengths", str(tmp_path / "c.jsonl")]):
        code, _, err = run(argv, capsys)
        assert code == 2 and "c.jsonl" in err and "`packloader tokenize CORPUS --out DIR`" in err, err
    assert run(["tokenize", str(tmp_path / "c.jsonl"), "--tokenizer", "bytes", "--out", str(tmp_path / "tok"),
                "--no-progress"], capsys)[0] == 0
    (shard,) = sorted((tmp_path / "tok").glob("*.parquet"))
    code, _, err = run(["plan", "--lengths", str(shard), "--max-tokens", "16", "--tokens-per-step", "32", "--strategy",
                        "fixed", "--model", "tiny", "--out", str(tmp_path / "p.jsonl")], capsys)
    assert code == 0, err
    assert "3 documents, 18 tokens" in err, err


@pytest.mark.multiprocess
@pytest.mark.timeout(1800)  # every kernel compiled from cold: ~45 s of CPU, many minutes on a loaded machine
def test_a_cold_numba_cache_is_announced_and_warmup_compiles_it(tmp_path):
    """With nothing compiled (an empty NUMBA_CACHE_DIR) the first planning compiles the kernels: the command says
    so on stderr first, instead of a progress bar reading seconds per step (was: nothing). `packloader warmup`
    compiles them (a setup step), after which the same command says nothing."""
    np.save(tmp_path / "l.npy", np.arange(100, 2100, 100))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba"),
               PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))

    def cli(*argv: str) -> subprocess.CompletedProcess:
        proc = subprocess.run([sys.executable, "-m", "packloader.cli.main", *argv], capture_output=True, text=True,
                              env=env, timeout=900)
        assert proc.returncode == 0, proc.stderr
        return proc

    plan = ["plan", "--lengths", str(tmp_path / "l.npy"), "--strategy", "fixed", "--model", "tiny", "--max-tokens",
            "2048", "--tokens-per-step", "4096", "--quiet", "--out", str(tmp_path / "p.jsonl")]
    notice = "packloader plan: compiling the planners' numba kernels on this first run"
    assert cli(*plan).stderr.startswith(notice)
    # 21,000 tokens drawn in steps of >= 4,096: 100..900 (4,500), 1,000..1,300, 1,400..1,600, 1,700..1,900, 2,000
    assert len((tmp_path / "p.jsonl").read_text().splitlines()) == 5
    assert "packloader warmup: numba kernels compiled in" in cli("warmup").stdout
    assert notice not in cli(*plan).stderr


def test_report_tells_one_story(tmp_path, capsys):
    """No figure over 100 % ("fill-credited 111 %" read as an error): efficiency is against the no-bubble ideal
    only. The advice, tried at other caps, states the table's own figure for its strategy at the user's cap, and
    that figure is the table's speedup over the fastest baseline; the grouping line says what it compares."""
    rng = np.random.default_rng(0)
    np.save(tmp_path / "lt.npy", np.minimum((rng.pareto(1.1, 3000) + 1) * 200, 40000).astype(np.int64))
    code, out, err = run(["report", "--lengths", str(tmp_path / "lt.npy"), "--dp", "4", "--pp", "2", "--tp", "2",
                          "--max-tokens", "32768", "--model", "llama3-8b", "--steps", "2", "--strategies",
                          "fixed,hydraulis,auto", "--no-plots", "--no-progress", "--out", str(tmp_path / "o")], capsys)
    assert code == 0, err
    assert "fill-credited" not in out
    row = next(line for line in out.splitlines() if line.startswith("efficiency vs no-bubble ideal"))
    assert all(int(p) <= 100 for p in re.findall(r"(\d+)%", row)), row
    names = out.splitlines()[[i for i, line in enumerate(out.splitlines()) if line.startswith("---")][0] - 1].split()
    speedups = next(line for line in out.splitlines() if line.startswith("speedup over fixed"))
    table = dict(zip(names, speedups.split("(tokens/s)")[1].split()))
    advice = re.search(r"strategy (\w+): .* with cap ([\d,]+) .*, ([\d.]+)x the fastest baseline \(fixed\) at your "
                       r"settings \(the table's (\w+) column, at your cap 32,768: ([\d.]+x)\)", out)
    assert advice, out  # this layout's advice is at another cap than the table's
    assert advice.group(2) != "32,768" and advice.group(1) == advice.group(4)
    assert advice.group(5) == table[advice.group(1)], (advice.groups(), table)
    grouping = next(line for line in out.splitlines() if "heterogeneous grouping:" in line)
    assert "planned by hydraulis" in grouping and "hydraulis on your layout unchanged (the table's hydraulis column)" \
        in grouping, grouping


def test_the_default_model_is_named_on_the_command_line(tmp_path, capsys):
    """Without --model the plan summary and the report say that llama3-8b is the default and how to price one's
    own model; with --model they do not."""
    np.save(tmp_path / "l.npy", np.full(40, 500, np.int64))
    base = ["plan", "--lengths", str(tmp_path / "l.npy"), "--max-tokens", "1024", "--tokens-per-step", "2048",
            "--strategy", "fixed", "--out", str(tmp_path / "p.jsonl")]
    code, _, err = run(base, capsys)
    assert code == 0 and "priced by llama3-8b@h100" in err and "(the default --model: --model PRESET" in err, err
    code, _, err = run([*base, "--model", "tiny"], capsys)
    assert code == 0 and "the default --model" not in err, err
    report = ["report", "--lengths", str(tmp_path / "l.npy"), "--max-tokens", "1024", "--steps", "1", "--strategies",
              "fixed", "--no-advice", "--no-plots", "--no-progress", "--out", str(tmp_path / "o")]
    code, out, err = run(report, capsys)
    assert code == 0 and "note: priced as llama3-8b, the default --model: for your own model pass --model" in out, out
    code, out, err = run([*report, "--model", "tiny"], capsys)
    assert code == 0 and "the default --model" not in out, out
