"""Every command's `--config FILE` (JSON, YAML, TOML) and `--log-level`; `plan` plans the whole file by default;
the version in one place and the py.typed marker."""

from __future__ import annotations

import json
import re
from pathlib import Path

import msgspec
import numpy as np
import pytest

import packloader
from packloader.cli.main import main

ROOT = Path(__file__).resolve().parent.parent
LENGTHS = [300, 5, 1200, 40, 900, 700, 64, 2000, 10, 333] * 20  # 200 documents


@pytest.fixture
def lengths(tmp_path):
    path = tmp_path / "lengths.npy"
    np.save(path, np.array(LENGTHS, dtype=np.int64))
    return path


def plan_lines(path: Path) -> list[dict]:
    return [msgspec.json.decode(line) for line in path.read_bytes().splitlines()]


def docs_in(recs: list[dict]) -> set[int]:
    return {seg[0] for r in recs for rank in r["ranks"] for mb in rank for seg in mb}


def test_plan_plans_the_whole_file_by_default(lengths, tmp_path):
    out = tmp_path / "p.jsonl"
    assert main(["plan", "--lengths", str(lengths), "--max-tokens", "2048", "--tokens-per-step", "4096",
                 "--out", str(out), "--quiet"]) == 0
    recs = plan_lines(out)
    assert docs_in(recs) == set(range(len(LENGTHS)))
    assert len(recs) > 10  # steps of about 4096 tokens, not one


def test_plan_help_gives_the_output_format_and_the_default(capsys):
    assert main(["plan", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for word in ('"ranks"', '"costs"', '"memory_over"', "attend_from", "every step of the file", "exit status"):
        assert word in text, word


CONFIG = {"parallel": {"dp": 2}, "max_tokens": 2048, "tokens_per_step": 8192, "strategy": "fixed", "quiet": True}


def write(tmp_path: Path, suffix: str, data: dict) -> Path:
    path = tmp_path / f"cfg{suffix}"
    if suffix == ".json":
        path.write_text(json.dumps(data))
    elif suffix == ".yaml":
        yaml = pytest.importorskip("yaml")
        path.write_text(yaml.safe_dump(data))
    else:  # TOML by hand: top-level keys, then the parallel table
        top = [f"{k} = {json.dumps(v) if not isinstance(v, bool) else str(v).lower()}"
               for k, v in data.items() if k != "parallel"]
        par = [f"{k} = {v}" for k, v in data.get("parallel", {}).items()]
        path.write_text("\n".join(top + ["[parallel]"] + par) + "\n")
    return path


@pytest.mark.parametrize("suffix", [".json", ".yaml", ".toml"])
def test_config_file_gives_the_same_plans_as_the_flags(lengths, tmp_path, suffix):
    by_flags, by_file = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    assert main(["plan", "--lengths", str(lengths), "--dp", "2", "--max-tokens", "2048", "--tokens-per-step", "8192",
                 "--strategy", "fixed", "--quiet", "--out", str(by_flags)]) == 0
    cfg = write(tmp_path, suffix, {**CONFIG, "lengths": str(lengths), "out": str(by_file)})
    assert main(["plan", "--config", str(cfg)]) == 0  # --lengths, otherwise required, comes from the file
    assert by_file.read_bytes() == by_flags.read_bytes()
    # the layout part is PlanConfig's own shape
    layout = {k: v for k, v in CONFIG.items() if k != "quiet"}
    assert packloader.PlanConfig(**{**layout, "parallel": packloader.ParallelConfig(**layout["parallel"])})


def test_flags_override_the_file(lengths, tmp_path):
    cfg = write(tmp_path, ".json", {**CONFIG, "lengths": str(lengths)})
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    assert main(["plan", "--config", str(cfg), "--dp", "4", "--out", str(a)]) == 0
    assert main(["plan", "--lengths", str(lengths), "--dp", "4", "--max-tokens", "2048", "--tokens-per-step", "8192",
                 "--strategy", "fixed", "--quiet", "--out", str(b)]) == 0
    assert a.read_bytes() == b.read_bytes()
    assert all(len(r["ranks"]) == 4 for r in plan_lines(a))


@pytest.mark.parametrize("data,words", [
    ({"max_tokenz": 10}, ["unknown key 'max_tokenz'", "max_tokens"]),
    ({"parallel": {"dpp": 2}}, ["'parallel'", "dpp"]),
    ({"max_tokens": 0}, ["'max_tokens'", ">= 1"]),
    ({"schedule": "zigzag"}, ["'schedule'", "1f1b"]),
    ({"no_slicing": "yes"}, ["unknown key 'no_slicing'"]),
    ({"allow_slicing": "yes"}, ["'allow_slicing'", "true or false"]),
])
def test_bad_keys_and_values_are_named(lengths, tmp_path, capsys, data, words):
    cfg = write(tmp_path, ".json", {"lengths": str(lengths), **data})
    assert main(["plan", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert str(cfg) in err
    for w in words:
        assert w in err, (w, err)


@pytest.mark.parametrize("command", ["report", "plan", "tokenize", "calibrate"])
def test_every_command_takes_config_and_log_level(command, capsys):
    assert main([command, "--help"]) == 0
    text = capsys.readouterr().out
    assert "--config FILE" in text and "--log-level" in text


def test_log_level_info_shows_the_pricing(lengths, tmp_path, capsys, monkeypatch):
    from packloader.balancers.cost import lookup

    monkeypatch.setattr(lookup, "_MODELS", {})  # the line comes when a process first loads the model
    assert main(["plan", "--lengths", str(lengths), "--max-tokens", "2048", "--tokens-per-step", "8192", "--quiet",
                 "--out", str(tmp_path / "p.jsonl"), "--log-level", "info"]) == 0
    err = capsys.readouterr().err
    assert re.search(r"packloader: INFO: .*priced .*llama3-8b", err), err
    assert main(["plan", "--lengths", str(lengths), "--max-tokens", "2048", "--tokens-per-step", "8192", "--quiet",
                 "--out", str(tmp_path / "p.jsonl")]) == 0
    assert "INFO" not in capsys.readouterr().err


def test_version_in_one_place_and_typed_marker():
    text = (ROOT / "pyproject.toml").read_text()
    assert packloader.__version__ == re.search(r'^version = "([^"]+)"', text, re.MULTILINE).group(1)
    assert (ROOT / "packloader" / "py.typed").is_file()
    assert '"py.typed"' in text  # packaged with the wheel
    assert f"## {packloader.__version__}" in (ROOT / "CHANGELOG.md").read_text()


def test_calibrate_takes_its_options_from_a_file(tmp_path):
    out = tmp_path / "cpu.json"
    cfg = write(tmp_path, ".toml", {"device": "cpu", "hidden": 32, "heads": 4, "kv_heads": 2, "head_dim": 8,
                                    "ffn": 64, "max_len": 256, "lengths": 5, "sizes": 4, "repeats": 1, "warmup": 0,
                                    "quiet": True, "out": str(out)})
    assert main(["calibrate", "--config", str(cfg)]) == 0
    prof = msgspec.json.decode(out.read_bytes())
    assert prof["device"].startswith("cpu:") and prof["attn_fwd"]


def test_plan_summary_names_the_cost_model(lengths, tmp_path, capsys):
    assert main(["plan", "--lengths", str(lengths), "--max-tokens", "2048", "--tokens-per-step", "8192",
                 "--model", "tiny", "--out", str(tmp_path / "p.jsonl")]) == 0
    assert "priced by tiny@" in capsys.readouterr().err


def test_tokenize_takes_its_inputs_from_a_file(tmp_path):
    src = tmp_path / "a.jsonl"
    src.write_text('{"text": "hello world"}\n{"text": "more text here"}\n')
    cfg = write(tmp_path, ".json", {"inputs": str(src), "out": str(tmp_path / "out"), "tokenizer": "bytes",
                                    "no_progress": True})
    assert main(["tokenize", "--config", str(cfg)]) == 0
    import pyarrow.parquet as pq

    table = pq.read_table(next((tmp_path / "out").glob("*.parquet")))
    assert table.column("length").to_pylist() == [len("hello world") + 1, len("more text here") + 1]  # + EOS
