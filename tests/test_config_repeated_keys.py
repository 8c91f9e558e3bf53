"""A `--config` file that gives one option twice (issue 35, item 7) is refused, naming both: a key repeated in a
JSON object or a YAML mapping (the parsers keep the last), and `max_tokens` beside `max-tokens` (one option, two
spellings). TOML's parser refuses a repeated key itself; the message names the file."""

from __future__ import annotations

import json

import numpy as np
import pytest

from packloader.cli.main import main


@pytest.fixture
def lengths(tmp_path):
    np.save(tmp_path / "l.npy", np.array([100, 200, 300, 50]))
    return str(tmp_path / "l.npy")


def run(tmp_path, capsys, name: str, text: str) -> tuple[int, str]:
    (tmp_path / name).write_text(text)
    code = main(["plan", "--config", str(tmp_path / name), "--out", str(tmp_path / "p.jsonl"), "--quiet"])
    return code, capsys.readouterr().err


def test_json_key_twice(tmp_path, capsys, lengths):
    code, err = run(tmp_path, capsys, "c.json", f'{{"lengths": "{lengths}", "max_tokens": 2048, "max_tokens": 4096}}')
    assert code == 2 and "c.json: key 'max_tokens' is given twice in one table (values 2048 and 4096)" in err, err


def test_json_two_spellings_of_one_option(tmp_path, capsys, lengths):
    code, err = run(tmp_path, capsys, "c.json", json.dumps({"lengths": lengths, "max_tokens": 2048, "max-tokens": 4096}))
    assert code == 2 and "c.json: keys 'max_tokens' and 'max-tokens' name the same option (max_tokens)" in err, err


def test_json_key_twice_under_parallel(tmp_path, capsys, lengths):
    code, err = run(tmp_path, capsys, "c.json", f'{{"lengths": "{lengths}", "parallel": {{"dp": 2, "dp": 4}}}}')
    assert code == 2 and "key 'dp' is given twice in one table (values 2 and 4)" in err, err


def test_yaml_key_twice_names_both_lines(tmp_path, capsys, lengths):
    code, err = run(tmp_path, capsys, "c.yaml", f"lengths: {lengths}\nmax_tokens: 2048\ncontext: 1024\nmax_tokens: 4096\n")
    assert code == 2 and "c.yaml: key 'max_tokens' is given twice in one mapping (lines 2 and 4)" in err, err


def test_yaml_two_spellings(tmp_path, capsys, lengths):
    code, err = run(tmp_path, capsys, "c.yml", f"lengths: {lengths}\nmax-tokens: 2048\nmax_tokens: 4096\n")
    assert code == 2 and "keys 'max-tokens' and 'max_tokens' name the same option" in err, err


def test_toml_key_twice(tmp_path, capsys, lengths):
    code, err = run(tmp_path, capsys, "c.toml", f'lengths = "{lengths}"\nmax_tokens = 2048\nmax_tokens = 4096\n')
    assert code == 2 and "c.toml: not valid TOML" in err, err


def test_each_key_once_is_read(tmp_path, capsys, lengths):
    """The same files with each option once plan as the flags do (the plan files compared byte for byte)."""
    flags = ["plan", "--lengths", lengths, "--max-tokens", "4096", "--context", "4096", "--strategy", "fixed",
             "--quiet"]
    assert main([*flags, "--out", str(tmp_path / "flags.jsonl")]) == 0
    for name, text in [("ok.json", json.dumps({"lengths": lengths, "max-tokens": 4096, "context": 4096,
                                                "strategy": "fixed"})),
                       ("ok.yaml", f"lengths: {lengths}\nmax_tokens: 4096\ncontext: 4096\nstrategy: fixed\n")]:
        code, err = run(tmp_path, capsys, name, text)
        assert code == 0, err
        assert (tmp_path / "p.jsonl").read_bytes() == (tmp_path / "flags.jsonl").read_bytes()
