"""examples/train_sft.py trains (the assistant-token loss falls) and a run stopped mid-epoch and resumed from its
checkpoint trains the same pieces with the same losses, step for step, as one that ran through; every assistant
token of every conversation is a target exactly once per epoch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.multiprocess  # the example runs in processes of its own

ARGS = ["--rows", "120", "--epochs", "2", "--tokens-per-step", "1024", "--max-tokens", "256", "--save-every", "100"]


def _run(out: Path, *extra: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "train_sft.py"), "--out", str(out), *ARGS, *extra],
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _log(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]


def test_sft_example_trains_and_resumes_exactly(tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    summary = _run(full)
    assert summary["last_loss"] < 0.8 * summary["first_loss"]
    through = _log(full)
    stop = len(through) // 2 + 1  # inside the first epoch or just after: the loader state carries either
    _run(part, "--stop-after", str(stop))
    assert len(_log(part)) == stop
    _run(part, "--resume")
    resumed = _log(part)
    assert [r["pieces"] for r in resumed] == [r["pieces"] for r in through]
    assert [r["loss_tokens"] for r in resumed] == [r["loss_tokens"] for r in through]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in through]  # bit for bit: same data, same order
    # every assistant token once per epoch: the pieces of each epoch cover each conversation exactly once
    rows = [json.loads(line) for line in (full / "data.jsonl").read_text().splitlines()]
    cover = Counter()
    for r in through:
        for doc, start, end in r["pieces"]:
            cover[doc] += end - start
    assert len(cover) == 2 * len(rows)  # document ids of epoch 1 follow epoch 0's
    # the step normalisers add up to the assistant targets of two epochs (Tekken: content + </s> per turn)
    from mistral_common.protocol.instruct.validator import ValidationMode
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    from packloader.sources.chat import MistralChat

    inner = MistralTokenizer.from_file(MistralChat().path, mode=ValidationMode.finetuning).instruct_tokenizer.tokenizer
    per_epoch = sum(len(inner.encode(m["content"], bos=False, eos=False)) + 1
                    for row in rows for m in row["messages"] if m["role"] == "assistant")
    assert sum(r["loss_tokens"] for r in through) == 2 * per_epoch
