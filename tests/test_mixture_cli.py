"""`plan` and `report` on a mixture from a config file (YAML, TOML, JSON): what they plan is the blend's documents,
every token once, at the entries' shares; the report's per-entry rows against entries of one length each, whose
counts, shares and GPU time are worked out here by hand (and by the cost model's own per-document time)."""

from __future__ import annotations

import json

import msgspec
import numpy as np
import pytest
from helpers.docs import write_token_shards

from packloader.balancers.cost.lookup import cost_model_for
from packloader.cli.main import main
from packloader.contracts import PlanConfig

LENGTHS = {"short": 100, "mid": 700, "long": 3000}
WEIGHTS = {"short": 0.5, "mid": 0.3, "long": 0.2}


def entries(tmp_path) -> list[dict]:
    out = []
    for name, length in LENGTHS.items():
        d = tmp_path / name
        d.mkdir()
        docs = [np.full(length, 7, np.int32)] * 200
        out.append({"name": name, "source": str(d), "weight": WEIGHTS[name]})
        write_token_shards(d, docs, shards=2)
    return out


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main(list(argv))
    got = capsys.readouterr()
    return code, got.out, got.err


def write(path, table) -> str:
    if path.suffix == ".json":
        path.write_text(json.dumps(table))
    elif path.suffix == ".yaml":
        import yaml

        path.write_text(yaml.safe_dump(table))
    else:
        lines = [f"{k} = {json.dumps(v)}" for k, v in table.items() if not isinstance(v, (dict, list))]
        for e in table.get("mixture", {}).get("entries", table.get("entries", [])):
            head = "[[mixture.entries]]" if "mixture" in table else "[[entries]]"
            lines += [head] + [f"{k} = {json.dumps(v)}" for k, v in e.items()]
        path.write_text("\n".join(lines) + "\n")
    return str(path)


@pytest.mark.parametrize("how", ["mixture.yaml", "mixture.json", "config.toml", "config.yaml"])
def test_plan_on_a_mixture_from_a_file(tmp_path, capsys, how):
    mix = {"entries": entries(tmp_path)}
    out = tmp_path / "plan.jsonl"
    layout = {"max_tokens": 4096, "context": 4096, "tokens_per_step": 16384, "strategy": "wlb"}
    if how.startswith("mixture"):
        args = ["plan", "--mixture", write(tmp_path / how, mix)] + \
            [f"--{k.replace('_', '-')}={v}" for k, v in layout.items()]
    else:
        args = ["plan", "--config", write(tmp_path / how, {**layout, "mixture": mix})]
    code, _, err = run(capsys, *args, "--out", str(out), "--steps", "20")
    assert code == 0, err
    assert "mixture token shares: short" in err
    tokens: dict[int, int] = {}
    for line in out.read_text().splitlines():
        for rank in json.loads(line)["ranks"]:
            for mb in rank:
                for doc, start, end, _ in mb:
                    tokens[doc] = tokens.get(doc, 0) + end - start
    # every planned document whole, and its length one of the entries' (so which entry it came from)
    by_length = {v: k for k, v in LENGTHS.items()}
    per = dict.fromkeys(LENGTHS, 0)
    for doc, n in tokens.items():
        per[by_length[n]] += n
    assert sorted(tokens) == list(range(len(tokens)))  # the blend's first documents, none skipped
    total = sum(per.values())
    for name, w in WEIGHTS.items():
        assert abs(per[name] - w * total) <= 4096, (name, per, total)


def test_report_on_a_mixture_has_per_entry_rows(tmp_path, capsys):
    mix = tmp_path / "mix.yaml"
    write(mix, {"entries": entries(tmp_path)})
    out = tmp_path / "rep"
    code, stdout, err = run(capsys, "report", "--mixture", str(mix), "--max-tokens", "4096", "--context", "4096",
                            "--tokens-per-step", "16384", "--steps", "6", "--strategies", "wlb,fixed", "--no-plots",
                            "--no-advice", "--no-progress", "--out", str(out), "--tokenizer", "bytes")
    assert code == 0, err
    assert "mixture entries (delay as wlb plans them)" in stdout
    rows = {r["name"]: r for r in msgspec.json.decode((out / "mixture.json").read_bytes())}
    assert list(rows) == list(LENGTHS)
    config = PlanConfig(max_tokens=4096, context=4096, tokens_per_step=16384)
    model = cost_model_for(config)
    time = {n: rows[n]["documents"] * float(model.doc_time(np.array([L]))[0]) for n, L in LENGTHS.items()}
    total_tokens = sum(rows[n]["documents"] * L for n, L in LENGTHS.items())
    for name, length in LENGTHS.items():
        r = rows[name]
        assert r["tokens"] == r["documents"] * length
        assert r["length_p50"] == r["length_max"] == length
        assert r["token_share"] == pytest.approx(r["tokens"] / total_tokens)
        assert r["gpu_share"] == pytest.approx(time[name] / sum(time.values()))
        assert r["target_share"] == pytest.approx(WEIGHTS[name])
        assert abs(r["tokens"] - WEIGHTS[name] * total_tokens) <= 3000
        assert 0 <= r["delayed_share"] <= 1
