"""The one lengths-file reader (`packloader.sources.lengths_file`) behind `packloader plan` and `packloader
report`: each command's empty-document policy, and the option it names for a missing Parquet column. The
expected lengths are written out by hand from the files the tests make."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from packloader.cli.main import main
from packloader.sources.lengths_file import LengthsError, LengthsFileMissing, read_lengths


def test_both_commands_read_through_the_shared_reader():
    import packloader.report.lengths as report_lengths

    assert report_lengths.read_lengths is read_lengths
    assert report_lengths.LengthsError is LengthsError


def test_empty_policies(tmp_path):
    path = tmp_path / "l.txt"
    path.write_text("# lengths\n5\n\n0  # an empty document\n7\n")
    got = read_lengths(path)
    assert got.lengths.tolist() == [5, 7] and got.empty == 1 and got.origin == str(path)
    with pytest.raises(LengthsError, match=r"l\.txt, line 4: entry 1 is 0, expected a positive length"):
        read_lengths(path, empty="error")
    np.save(tmp_path / "a.npy", np.array([4, 0, 2]))
    with pytest.raises(LengthsError, match=r"entry 1 is 0, expected a positive length \(array element 1\)"):
        read_lengths(tmp_path / "a.npy", empty="error")
    assert read_lengths(tmp_path / "a.npy").lengths.tolist() == [4, 2]
    kept = read_lengths(path, empty="keep")  # plan's policy: positions kept, empties counted
    assert kept.lengths.tolist() == [5, 0, 7] and kept.empty == 1
    with pytest.raises(ValueError, match="empty must be"):
        read_lengths(path, empty="skip")


def test_missing_file_is_both_error_kinds(tmp_path):
    with pytest.raises(LengthsFileMissing) as e:
        read_lengths(tmp_path / "gone.npy")
    assert isinstance(e.value, FileNotFoundError) and isinstance(e.value, LengthsError)
    assert "gone.npy" in str(e.value) and "no such" in str(e.value)


def test_missing_column_names_the_callers_option(tmp_path, capsys):
    pq.write_table(pa.table({"n": [3, 4]}), tmp_path / "p.parquet")
    with pytest.raises(LengthsError, match="pass --lengths-column"):
        read_lengths(tmp_path / "p.parquet")
    assert main(["plan", "--lengths", str(tmp_path / "p.parquet"), "--quiet"]) == 2
    assert "pass --column" in capsys.readouterr().err


def test_plan_reads_comments_and_skips_empty_documents(tmp_path, capsys):
    (tmp_path / "ok.txt").write_text("# two documents\n100\n200\n")
    out = tmp_path / "p.jsonl"
    assert main(["plan", "--lengths", str(tmp_path / "ok.txt"), "--tokens-per-step", "300", "--steps", "1",
                 "--max-tokens", "256", "--out", str(out), "--quiet"]) == 0
    docs = sorted({seg[0] for line in out.read_text().splitlines() for rank in json.loads(line)["ranks"]
                   for mb in rank for seg in mb})
    assert docs == [0, 1]
    (tmp_path / "z.txt").write_text("100\n0\n200\n")
    assert main(["plan", "--lengths", str(tmp_path / "z.txt"), "--max-tokens", "1024", "--out", str(out), "--quiet"]) == 0
    docs = sorted({seg[0] for line in out.read_text().splitlines() for rank in json.loads(line)["ranks"]
                   for mb in rank for seg in mb})
    assert docs == [0, 2]
    (tmp_path / "zz.txt").write_text("0\n0\n")
    assert main(["plan", "--lengths", str(tmp_path / "zz.txt"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "zz.txt" in err and "no non-empty" in err
