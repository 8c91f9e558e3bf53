"""examples/train_llama.py at CI size: Parquet shards written by tokenize_to_parquet, a random Llama trained
through packloader with the runtime's varlen attention, once with `fixed` and once with `wlb`; the loss starts at
the uniform-prediction value ln(vocab) and falls."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

pytest.importorskip("transformers")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_llama.py"


def load_example():
    spec = importlib.util.spec_from_file_location("train_llama_example", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_tiny_training_run_loss_falls_for_both_planners(tmp_path):
    ex = load_example()
    result = ex.main(["--out", str(tmp_path), "--tiny", "--planners", "fixed,wlb", "--quiet"])
    assert (tmp_path / "curves.png").stat().st_size > 0
    saved = json.loads((tmp_path / "curves.json").read_text())
    assert set(saved["summary"]) == {"fixed", "wlb"}
    assert list((tmp_path / "shards" / "train").glob("part-*.parquet"))
    vocab = result["config"]["vocab"]
    for run in result["runs"]:
        losses = [c["loss"] for c in run["curve"]]
        assert len(losses) + run["skipped_empty_steps"] == result["config"]["steps"]
        # a random init predicts nearly uniformly: the first loss is close to ln(vocab)
        assert abs(losses[0] - math.log(vocab)) < 0.4, (run["strategy"], losses[0])
        # and training lowers it clearly (mean of the last 3 steps)
        assert sum(losses[-3:]) / 3 < losses[0] - 0.5, (run["strategy"], losses)
        assert math.isfinite(run["held_out_loss"]) and run["held_out_loss"] < math.log(vocab) - 0.5
