"""The SFT source's cases of the bad-input catalogue (tests/test_bad_input_catalogue.py runs them; docs/bad-input.md
lists them): each builder takes a temporary folder and returns the thunk the catalogue runs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from helpers.sft_data import TOKENIZER_DIR
from packloader.contracts import PlanConfig
from packloader.loader.loader import PackedLoader
from packloader.sources.errors import SourceError
from packloader.sources.sft import SftSource


def _read(src):
    return [d for s, info in enumerate(src.shards) for d in src.read(s, np.arange(info.num_rows))]


def _jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def sft_labels_not_tokens(tmp):
    p = _jsonl(tmp / "sft.jsonl", [{"input_ids": [1, 2, 3], "labels": [-100, 2, 3]},
                                   {"input_ids": [1, 2, 3], "labels": [-100, 5, 3]}])
    return lambda: _read(SftSource(p))


def sft_mask_length_mismatch(tmp):
    p = tmp / "sft.parquet"
    pq.write_table(pa.Table.from_pylist([{"input_ids": [1, 2, 3], "loss_mask": [0, 1]}]), p)
    return lambda: _read(SftSource(str(p)))


def sft_megatron_mask_mismatch(tmp):
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    for name, docs, dtype in (("sft", [[1, 2, 3], [4, 5]], np.int32), ("sft_loss_mask", [[0, 1, 1], [0, 1, 1]], np.uint8)):
        builder = IndexedDatasetBuilder(str(tmp / f"{name}.bin"), dtype=dtype)
        for d in docs:
            builder.add_document(torch.tensor(d), [len(d)])
        builder.finalize(str(tmp / f"{name}.idx"))
    return lambda: SftSource(str(tmp / "sft"))


def sft_message_without_content(tmp):
    p = _jsonl(tmp / "chat.jsonl", [{"messages": [{"role": "user"}]}])
    return lambda: _read(SftSource(p, str(TOKENIZER_DIR)))


def sft_no_assistant_turn(tmp):
    p = _jsonl(tmp / "chat.jsonl", [{"messages": [{"role": "user", "content": "hello"},
                                                  {"role": "assistant", "content": "hi"}]},
                                    {"messages": [{"role": "user", "content": "hello"}]}])
    return lambda: _read(SftSource(p, str(TOKENIZER_DIR)))


def sft_template_without_generation(tmp):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR), local_files_only=True)
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    return lambda: _read(SftSource([{"messages": [{"role": "user", "content": "hello"}]}], tok))


def sft_assistant_loss_on_plain_pairs(tmp):
    return lambda: _read(SftSource([{"prompt": "2+2=", "completion": "4"}], str(TOKENIZER_DIR), loss_on="assistant"))


def sft_too_long(tmp):
    rows = [{"input_ids": list(range(1, 101)), "loss_mask": [1] * 100}]
    return lambda: _read(SftSource(rows, on_too_long="error", context=64))


def sft_dropped_counted(tmp):
    ok = {"input_ids": list(range(1, 11)), "loss_mask": [0] * 5 + [1] * 5}
    rows = [ok, {"input_ids": [1, 2, 3], "loss_mask": [1, 0, 0]}, {"input_ids": list(range(1, 101)),
                                                                   "loss_mask": [1] * 100}]

    def run():
        src = SftSource(rows, on_no_loss="drop", on_too_long="drop", context=64)
        loader = PackedLoader(src, tokenizer=None, num_threads=1,
                              config=PlanConfig(strategy="fixed", max_tokens=64, context=64, tokens_per_step=128))
        st = list(loader)[-1].stats
        loader.close()
        return (f"dropped_no_loss={st.dropped_no_loss} dropped_too_long={st.dropped_too_long} "
                f"empty_documents={st.empty_documents} documents={st.documents}")
    return run


# (name, builder, exception or None for what was read, message fragments): Case(*entry) in the catalogue
SFT_CASES = [
    ("sft_labels_not_tokens", sft_labels_not_tokens, SourceError,
     ("sft.jsonl, line 2, field 'labels', position 1: 5, expected -100 or the token itself (2)",)),
    ("sft_mask_length_mismatch", sft_mask_length_mismatch, SourceError,
     ("sft.parquet, row 0, field 'loss_mask': 2 entries for 3 input_ids; expected one per token",)),
    ("sft_megatron_mask_mismatch", sft_megatron_mask_mismatch, SourceError,
     ("sft_loss_mask.idx: 2 documents, document 1 of 3 tokens;", "sft.idx has 2, document 1 of 2: expected one mask "
      "value per token")),
    ("sft_message_without_content", sft_message_without_content, SourceError,
     ("chat.jsonl, line 1, field 'messages', message 0: expected {'role': str, 'content': str}",)),
    ("sft_no_assistant_turn", sft_no_assistant_turn, SourceError,
     ("chat.jsonl, line 2: no token to train on (loss_on='assistant'); pass on_no_loss='drop' or 'keep'",)),
    ("sft_template_without_generation", sft_template_without_generation, SourceError,
     ("its chat template has no {% generation %} block", "or loss_on='all'")),
    ("sft_assistant_loss_on_plain_pairs", sft_assistant_loss_on_plain_pairs, SourceError,
     ("row 0: loss_on='assistant' needs conversations", "use loss_on='completion'")),
    ("sft_too_long", sft_too_long, SourceError,
     ("row 0: 100 tokens, longer than context=64; pass on_too_long='slice' (pieces) or 'drop' (counted)",)),
    ("sft_dropped_counted", sft_dropped_counted, None,
     ("dropped_no_loss=1 dropped_too_long=1 empty_documents=2 documents=3",)),
]
