"""Smaller CLI defects: one rule for tokens per step in the library and the CLIs, lengths beyond int64 refused
by name, and a closed stdout (`packloader plan | head`) ending the command quietly."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from packloader.cli.main import EXIT_PIPE_CLOSED, main
from packloader.contracts import PlanConfig
from packloader.loader.state import validate_config
from packloader.sources.lengths_file import LengthsError, read_lengths

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("tps, ok", [(1023, False), (1024, True)])
def test_plan_accepts_tokens_per_step_exactly_where_the_library_does(tmp_path, capsys, tps, ok):
    np.save(tmp_path / "l.npy", np.full(40, 100))
    code = main(["plan", "--lengths", str(tmp_path / "l.npy"), "--max-tokens", "1024", "--tokens-per-step", str(tps),
                 "--strategy", "fixed", "--quiet", "--out", str(tmp_path / "p.jsonl")])
    cfg = dict(strategy="fixed", max_tokens=1024, context=1024, tokens_per_step=tps)
    if ok:
        validate_config(PlanConfig(**cfg))
        assert code == 0
        return
    with pytest.raises(ValueError) as lib:
        validate_config(PlanConfig(**cfg))
    err = capsys.readouterr().err
    assert code == 2 and "--tokens-per-step" in err and str(lib.value) in err, err


def test_report_refuses_the_same(tmp_path, capsys):
    np.save(tmp_path / "l.npy", np.full(400, 100))
    code = main(["report", "--lengths", str(tmp_path / "l.npy"), "--max-tokens", "1024", "--tokens-per-step", "512",
                 "--out", str(tmp_path / "r"), "--no-plots", "--no-advice", "--no-progress"])
    assert code == 2 and "tokens_per_step=512 is below max_tokens=1024" in capsys.readouterr().err


def test_lengths_beyond_int64_are_refused_naming_the_place(tmp_path):
    (tmp_path / "big.txt").write_text("10\n# a comment\n" + "1234567890" * 4 + "\n")
    with pytest.raises(LengthsError, match=r"big\.txt, line 3: 1,234,567,890,.* is beyond the largest length"):
        read_lengths(tmp_path / "big.txt")
    (tmp_path / "edge.txt").write_text(f"10\n{2**63 - 1}\n")  # the largest int64 is read as it is
    assert read_lengths(tmp_path / "edge.txt").lengths.tolist() == [10, 2**63 - 1]
    np.save(tmp_path / "u.npy", np.array([5, 2**64 - 1, 7], np.uint64))
    with pytest.raises(LengthsError, match=r"u\.npy: entry 1 is 18,446,744,073,709,551,615, beyond .*\(array element 1\)"):
        read_lengths(tmp_path / "u.npy")
    np.save(tmp_path / "u_ok.npy", np.array([5, 2**63 - 1], np.uint64))
    assert read_lengths(tmp_path / "u_ok.npy").lengths.tolist() == [5, 2**63 - 1]
    np.save(tmp_path / "f.npy", np.array([5.0, 2.0**63]))
    with pytest.raises(LengthsError, match=r"f\.npy: entry 1 is 9,223,372,036,854,775,808, beyond"):
        read_lengths(tmp_path / "f.npy")


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_closed_stdout_ends_the_command_quietly(tmp_path):
    """The reader closes the pipe before the command writes (its imports take far longer than closing), and the
    output is larger than a pipe's buffer, so the write meets the closed pipe either way."""
    np.save(tmp_path / "l.npy", np.random.default_rng(0).integers(1, 3000, 20000))
    cmd = [sys.executable, "-m", "packloader.cli.main", "plan", "--lengths", str(tmp_path / "l.npy"), "--steps", "200",
           "--max-tokens", "8192", "--tokens-per-step", "65536", "--strategy", "fixed"]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=ROOT)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    # the one line a cold numba cache adds before planning (cli/kernel_cache.py) is not about the pipe
    err = "".join(line for line in err.splitlines(True) if not line.startswith("packloader plan: compiling"))
    assert proc.wait(timeout=110) == EXIT_PIPE_CLOSED and err == "", err
    # the same command writing to a reader that stays gives the whole plan: the output is past a pipe's buffer
    full = subprocess.run(cmd + ["--quiet"], capture_output=True, env=env, cwd=ROOT, timeout=110)
    assert full.returncode == 0 and len(full.stdout) > 1 << 16
