"""packloader's SFT data against TRL's on the same conversations: token ids, trained positions and loss-token
counts equal to TRL 1.16's padding-free collator with assistant_only_loss and completion_only_loss.

CI has no TRL (it pins its own stack): tests/helpers/trl_fixture.py ran TRL's SFTTrainer data path and its
`DataCollatorForLanguageModeling(padding_free=True)` on these rows and recorded the result in
tests/data/sft_trl_1.16.0.json (how to regenerate: that script's docstring). Both tokenize with the committed
tokenizer folder tests/data/sft_tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from helpers.sft_data import CHAT_PAIRS, CONVERSATIONS, PLAIN_PAIRS, TOKENIZER_DIR

from packloader.collate.collate import collate
from packloader.contracts import Segment
from packloader.sources.sft import SftSource

FIXTURE = Path(__file__).resolve().parent / "data" / "sft_trl_1.16.0.json"

# the same rows as trl_fixture.CASES, and the loss_on that asks packloader for what TRL's flags ask
CASES = {
    "messages_assistant": ([{"messages": c} for c in CONVERSATIONS], "assistant"),
    "messages_all": ([{"messages": c} for c in CONVERSATIONS], "all"),
    "plain_pairs_completion": (PLAIN_PAIRS, "completion"),
    "chat_pairs_completion": (CHAT_PAIRS, "completion"),
    "chat_pairs_assistant": (CHAT_PAIRS, "assistant"),
}


@pytest.fixture(scope="module")
def trl_record():
    return json.loads(FIXTURE.read_text())


@pytest.mark.parametrize("case", list(CASES))
def test_same_tokens_trained_positions_and_counts_as_trl(case, trl_record):
    rows, loss_on = CASES[case]
    want = trl_record["cases"][case]
    source = SftSource(rows, str(TOKENIZER_DIR), loss_on=loss_on)
    docs = list(source.read(0, np.arange(len(rows))))
    assert [d.tolist() for d in docs] == [r["input_ids"] for r in want["rows"]]  # row by row
    batch = collate([Segment(i, 0, len(d), 0) for i, d in enumerate(docs)], dict(enumerate(docs)), layout="hf")
    hf = batch.to_hf()
    assert hf["input_ids"][0].tolist() == want["input_ids"]
    assert hf["position_ids"][0].tolist() == want["position_ids"]
    # TRL's labels are unshifted (the model shifts): packloader's in that convention must be the same list ...
    assert hf["labels"][0].tolist() == want["labels"]
    # ... and packloader's own (shifted) labels train the same positions: label t is TRL's label t + 1
    trl_targets = [t for t, lab in enumerate(want["labels"]) if lab != -100]
    ours = [t + 1 for t, lab in enumerate(batch.labels[0].tolist()) if lab != -100]
    assert ours == trl_targets
    assert batch.num_loss_tokens == len(trl_targets) == batch.loss_tokens_in_step


def test_fixture_is_what_it_says(trl_record):
    """The record comes from the TRL version the issue names, and its cases train fewer tokens than all of them
    (a record of masks that mask nothing would compare nothing)."""
    assert trl_record["trl"] == "1.16.0"
    for case, rec in trl_record["cases"].items():
        trained = sum(lab != -100 for lab in rec["labels"])
        starts = sum(p == 0 for p in rec["position_ids"])
        if case != "messages_all":
            assert 0 < trained < len(rec["labels"]) - starts, case
        else:
            assert trained == len(rec["labels"]) - starts
