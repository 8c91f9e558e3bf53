"""The SFT source: the same rows from every kind of input, chat templates (transformers and Mistral's instruct
Tekken) against the libraries' own functions, and the outcomes for rows with no loss token or longer than the
context, counted in the loader's stats."""

from __future__ import annotations

import gzip
import json
import pickle

import msgspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers.sft_data import CONVERSATIONS, PLAIN_PAIRS, TOKENIZER_DIR

from packloader import PackedLoader
from packloader.contracts import PlanConfig
from packloader.sources.errors import SourceError
from packloader.sources.sft import SftSource

ROWS = [{"messages": c} for c in CONVERSATIONS]


def _hf():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(TOKENIZER_DIR), local_files_only=True)


def _docs(source) -> list[tuple[list[int], list[int]]]:
    return [(d.tolist(), d.loss_mask.astype(int).tolist()) for s, info in enumerate(source.shards)
            for d in source.read(s, np.arange(info.num_rows))]


def test_messages_match_transformers_apply_chat_template():
    tok = _hf()
    got = _docs(SftSource(ROWS, tok))
    for (ids, mask), conv in zip(got, CONVERSATIONS):
        ref = tok.apply_chat_template(conv, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        assert ids == list(ref["input_ids"]) and mask == list(ref["assistant_masks"])
        assert 0 < sum(mask) < len(mask)
    # loss_on="all": the same ids, every token
    assert _docs(SftSource(ROWS, tok, loss_on="all")) == [(ids, [1] * len(ids)) for ids, _ in got]


def test_every_input_kind_gives_the_same_documents(tmp_path):
    import datasets

    want = _docs(SftSource(ROWS, str(TOKENIZER_DIR)))
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in ROWS[:2]) + "\n" + json.dumps(ROWS[2]) + "\n")
    (tmp_path / "b.jsonl.gz").write_bytes(gzip.compress((json.dumps(ROWS[3]) + "\n").encode()))
    table = pa.Table.from_pylist(ROWS)
    pq.write_table(table, tmp_path / "p.parquet", row_group_size=1)
    with pa.OSFile(str(tmp_path / "t.arrow"), "wb") as f, pa.ipc.new_file(f, table.schema) as w:
        w.write_table(table)
    ds = datasets.Dataset.from_list(ROWS)
    ds.save_to_disk(str(tmp_path / "disk"))
    inputs = {
        "jsonl": [str(jsonl), str(tmp_path / "b.jsonl.gz")], "parquet": str(tmp_path / "p.parquet"),
        "arrow": str(tmp_path / "t.arrow"), "table": table, "dataset": ds, "disk": str(tmp_path / "disk"),
        "datasetdict": datasets.DatasetDict({"train": ds}),
    }
    for kind, data in inputs.items():
        assert _docs(SftSource(data, str(TOKENIZER_DIR))) == want, kind
    # an IterableDataset and a generator: read once, kept in memory
    assert _docs(SftSource(ds.to_iterable_dataset(), str(TOKENIZER_DIR))) == want
    assert _docs(SftSource((r for r in ROWS), str(TOKENIZER_DIR))) == want
    # a shuffled Dataset reads through its index mapping
    shuffled = ds.shuffle(seed=1)
    order = [CONVERSATIONS.index(r["messages"]) for r in shuffled]
    assert _docs(SftSource(shuffled, str(TOKENIZER_DIR))) == [want[i] for i in order]
    # a directory of Parquet files (and pickling, as spawned workers do)
    (tmp_path / "dir").mkdir()
    pq.write_table(pa.Table.from_pylist(ROWS[:2]), tmp_path / "dir" / "0.parquet")
    pq.write_table(pa.Table.from_pylist(ROWS[2:]), tmp_path / "dir" / "1.parquet")
    src = pickle.loads(pickle.dumps(SftSource(str(tmp_path / "dir"), str(TOKENIZER_DIR))))
    assert _docs(src) == want


def test_mistral_tekken_instruct():
    """Tokens: mistral-common's encode_chat_completion. Trained tokens: each assistant message's content as Tekken
    encodes it plus </s>, in order (found here from the contents alone, not from the source's recording)."""
    from mistral_common.protocol.instruct.request import ChatCompletionRequest
    from mistral_common.protocol.instruct.validator import ValidationMode
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    src = SftSource(ROWS, "mistral")
    ref = MistralTokenizer.from_file(src.chat.path, mode=ValidationMode.finetuning)
    inner = ref.instruct_tokenizer.tokenizer
    for (ids, mask), conv in zip(_docs(src), CONVERSATIONS):
        assert ids == ref.encode_chat_completion(ChatCompletionRequest(messages=conv)).tokens
        trained = [t for t, m in zip(ids, mask) if m]
        want = [t for m in conv if m["role"] == "assistant"
                for t in inner.encode(m["content"], bos=False, eos=False) + [inner.eos_id]]
        assert trained == want
    assert src.vocab_size == 131072


def test_pairs_train_the_completion():
    tok = _hf()
    for (ids, mask), row in zip(_docs(SftSource(PLAIN_PAIRS, tok)), PLAIN_PAIRS):
        assert ids == tok(text=row["prompt"] + row["completion"] + tok.eos_token)["input_ids"]
        prompt = tok(text=row["prompt"])["input_ids"]
        start = next((i for i, (a, b) in enumerate(zip(prompt, ids)) if a != b), len(prompt))
        assert mask == [0] * start + [1] * (len(ids) - start)
        assert tok.decode([t for t, m in zip(ids, mask) if m]).endswith(row["completion"] + tok.eos_token)


def test_pretokenized_mask_columns():
    ids = [5, 6, 7, 8, 9]
    for col, values in [("assistant_masks", [0, 0, 1, 1, 0]), ("loss_mask", [0, 0, 1, 1, 0]),
                        ("labels", [-100, -100, 7, 8, -100])]:
        (got,) = _docs(SftSource([{"input_ids": ids, col: values}]))
        assert got == (ids, [0, 0, 1, 1, 0]), col
    assert _docs(SftSource([{"input_ids": ids, "loss_mask": [0] * 5}], loss_on="all", on_no_loss="drop")) == \
        [(ids, [1] * 5)]
    both = [{"input_ids": ids, "assistant_masks": [0, 1, 1, 1, 1], "completion_mask": [0, 0, 0, 1, 1]}]
    assert _docs(SftSource(both, loss_on="assistant")) == [(ids, [0, 1, 1, 1, 1])]
    assert _docs(SftSource(both, loss_on="completion")) == [(ids, [0, 0, 0, 1, 1])]


@pytest.mark.parametrize("row,options,message", [
    ({"input_ids": [1, 2, 3], "labels": [-100, 5, 3]}, {}, r"row 0, field 'labels', position 1: 5, expected -100 or "
     r"the token itself \(2\)"),
    ({"input_ids": [1, 2, 3], "loss_mask": [0, 1]}, {}, r"field 'loss_mask': 2 entries for 3 input_ids"),
    ({"input_ids": [1, 2, 3], "loss_mask": [0, 2, 1]}, {}, r"position 1: 2, expected 0 or 1"),
    ({"input_ids": [1, 2, 3]}, {}, r"no mask column among"),
    ({"input_ids": [1, 2, 3], "loss_mask": [1, 0, 0]}, {}, r"row 0: no token to train on"),
    ({"messages": [{"role": "user"}]}, {}, r"field 'messages', message 0: expected \{'role': str, 'content': str\}"),
    ({"prompt": "a b", "completion": "c"}, {"loss_on": "assistant"}, r"loss_on='assistant' needs conversations"),
    ({"messages": CONVERSATIONS[0]}, {"loss_on": "completion"}, r"loss_on='completion' needs prompt/completion"),
    ({"text": "x"}, {}, r"fields \['text'\]; expected 'messages'"),
])
def test_bad_rows_are_named(row, options, message):
    tok = None if "input_ids" in row else str(TOKENIZER_DIR)
    with pytest.raises(SourceError, match=message):
        list(SftSource([row], tok, **options).read(0, np.array([0])))


def test_template_without_generation_marks_is_refused_for_assistant_loss():
    tok = _hf()
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(SourceError, match=r"no \{% generation %\} block"):
        list(SftSource(ROWS, tok).read(0, np.array([0])))
    assert len(list(SftSource(ROWS, tok, loss_on="all").read(0, np.array([0])))) == 1
    with pytest.raises(msgspec.ValidationError, match="loss_on"):
        SftSource(ROWS, tok, loss_on="prompt")


def _stats(rows, **options):
    cfg = PlanConfig(strategy="fixed", max_tokens=64, context=64, tokens_per_step=256)
    loader = PackedLoader(SftSource(rows, **options), tokenizer=None, config=cfg, num_threads=1)
    batches = list(loader)
    loader.close()
    docs = {s.doc for b in batches for s in b.segments}
    return batches[-1].stats, docs, loader.stream


def test_no_loss_rows_and_long_rows_outcomes_are_counted():
    ok = {"input_ids": list(range(1, 11)), "loss_mask": [0] * 5 + [1] * 5}
    none = {"input_ids": list(range(1, 11)), "loss_mask": [1] + [0] * 9}  # only the first token: never a target
    long = {"input_ids": list(range(1, 101)), "loss_mask": [1] * 100}
    rows = [ok, none, long, ok, none]
    with pytest.raises(SourceError, match=r"row [14]: no token to train on"):
        _stats(rows)
    stats, docs, stream = _stats(rows, on_no_loss="drop", on_too_long="drop", context=64)
    assert (stats.dropped_no_loss, stats.dropped_too_long, stats.no_loss_documents) == (2, 1, 0)
    assert stats.empty_documents == 3 and len(docs) == 2
    stats, docs, _ = _stats(rows, on_no_loss="keep", on_too_long="slice", context=64)
    assert (stats.dropped_no_loss, stats.dropped_too_long, stats.no_loss_documents) == (0, 0, 2)
    assert stats.split_documents == 1 and len(docs) == 5
    with pytest.raises(SourceError, match=r"row 2: 100 tokens, longer than context=64"):
        _stats(rows, on_no_loss="keep", on_too_long="error", context=64)
    with pytest.raises(ValueError, match="needs context="):
        SftSource(rows, on_too_long="drop")


def test_mistral_conversational_pairs_train_the_completion():
    """A conversational pair through Tekken's instruct format: the prompt ends in [/INST], so the completion's
    tokens (what `loss_on="completion"` trains) are the last assistant message's content and </s>."""
    from mistral_common.protocol.instruct.validator import ValidationMode
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    pairs = [{"prompt": c[:-1], "completion": c[-1:]} for c in CONVERSATIONS]
    src = SftSource(pairs, "mistral")
    inner = MistralTokenizer.from_file(src.chat.path, mode=ValidationMode.finetuning).instruct_tokenizer.tokenizer
    for (ids, mask), pair in zip(_docs(src), pairs):
        want = inner.encode(pair["completion"][0]["content"], bos=False, eos=False) + [inner.eos_id]
        assert [t for t, m in zip(ids, mask) if m] == want
        assert mask == [0] * (len(ids) - len(want)) + [1] * len(want)


def test_jsonl_rows_name_bad_lines(tmp_path):
    from packloader.sources.errors import NonUtf8Error

    p = tmp_path / "rows.jsonl"
    p.write_bytes(b'{"input_ids": [1, 2], "loss_mask": [0, 1]}\n{"input_ids": [1, "caf\xe9"]}\n{"input_ids": [1,\n')
    src = SftSource(str(p))
    with pytest.raises(NonUtf8Error, match=r"rows\.jsonl, line 2: text is not valid UTF-8"):
        list(src.read(0, np.array([1])))
    with pytest.raises(SourceError, match=r"rows\.jsonl, line 3: not valid JSON"):
        list(src.read(0, np.array([2])))
    assert [d.tolist() for d in src.read(0, np.array([0]))] == [[1, 2]]
