"""SFT rows from MDS shards (written by mosaicml-streaming's MDSWriter) and Megatron pairs (written by
megatron-core's IndexedDatasetBuilder) give the same documents and masks as the same rows from JSONL."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers.sft_data import CONVERSATIONS, TOKENIZER_DIR

from packloader import PackedLoader
from packloader.contracts import PlanConfig
from packloader.sources.errors import SourceError
from packloader.sources.sft import SftSource

ROWS = [{"messages": c} for c in CONVERSATIONS]
TOKEN_ROWS = [  # hand-written: ids with a 0/1 mask, the first token never trains
    {"input_ids": [5, 6, 7, 8, 9], "loss_mask": [0, 0, 1, 1, 1]},
    {"input_ids": [11, 12, 13], "loss_mask": [0, 1, 0]},
    {"input_ids": [21, 22, 23, 24, 25, 26, 27], "loss_mask": [0, 0, 0, 0, 1, 1, 1]},
]


def _docs(source) -> list[tuple[list[int], list[int]]]:
    return [(d.tolist(), d.loss_mask.astype(int).tolist()) for s, info in enumerate(source.shards)
            for d in source.read(s, np.arange(info.num_rows))]


def _jsonl(tmp_path, rows, name="ref.jsonl") -> str:
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _mds(tmp_path, rows, columns, name="mds", **kw) -> str:
    import streaming

    out = tmp_path / name
    with streaming.MDSWriter(out=str(out), columns=columns, size_limit=256, **kw) as w:
        for r in rows:
            w.write(r)
    return str(out)


def _megatron(tmp_path, name: str, arrays, dtype) -> str:
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(str(tmp_path / f"{name}.bin"), dtype=dtype)
    for a in arrays:
        builder.add_document(torch.tensor(a), [len(a)])
    builder.finalize(str(tmp_path / f"{name}.idx"))
    return str(tmp_path / name)


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_mds_conversations_equal_jsonl(tmp_path, compression):
    want = _docs(SftSource(_jsonl(tmp_path, ROWS), str(TOKENIZER_DIR)))
    mds = _mds(tmp_path, ROWS, {"messages": "json"}, compression=compression)
    got = SftSource(mds, str(TOKENIZER_DIR))
    assert len(got.shards) > 1  # several MDS shards, read in order
    assert _docs(got) == want


def test_mds_token_rows_with_a_mask_column(tmp_path):
    rows = [{k: np.asarray(v, np.int32) for k, v in r.items()} for r in TOKEN_ROWS]
    mds = _mds(tmp_path, rows, {"input_ids": "ndarray:int32", "loss_mask": "ndarray:int32"})
    assert _docs(SftSource(mds)) == [(r["input_ids"], r["loss_mask"]) for r in TOKEN_ROWS]


def test_megatron_pair_with_its_mask_pair(tmp_path):
    prefix = _megatron(tmp_path, "sft_text_document", [r["input_ids"] for r in TOKEN_ROWS], np.uint16)
    _megatron(tmp_path, "sft_text_document_loss_mask", [r["loss_mask"] for r in TOKEN_ROWS], np.uint8)
    want = [(r["input_ids"], r["loss_mask"]) for r in TOKEN_ROWS]
    assert _docs(SftSource(prefix)) == want
    assert _docs(SftSource(prefix + ".bin")) == want
    # through the loader: labels train exactly the masked targets (target t+1 trains where mask[t+1] == 1)
    loader = PackedLoader(SftSource(prefix), tokenizer=None, num_threads=0,
                          config=PlanConfig(strategy="fixed", max_tokens=16, context=16, tokens_per_step=16))
    trained = sorted(int(t) for b in loader for t in b.labels[b.labels != -100].tolist())
    assert trained == sorted(t for r in TOKEN_ROWS for t, m in zip(r["input_ids"][1:], r["loss_mask"][1:]) if m)


def test_megatron_pair_without_a_mask_trains_all_only(tmp_path):
    prefix = _megatron(tmp_path, "plain", [r["input_ids"] for r in TOKEN_ROWS], np.int32)
    assert _docs(SftSource(prefix, loss_on="all")) == [(r["input_ids"], [1] * len(r["input_ids"])) for r in TOKEN_ROWS]
    with pytest.raises(SourceError, match=r"plain\.bin, document 0: no mask column"):
        _docs(SftSource(prefix))


def test_mask_pair_of_another_shape_is_refused(tmp_path):
    prefix = _megatron(tmp_path, "a", [r["input_ids"] for r in TOKEN_ROWS], np.int32)
    masks = [r["loss_mask"] for r in TOKEN_ROWS]
    _megatron(tmp_path, "a_loss_mask", [masks[0], masks[1] + [1], masks[2]], np.uint8)
    with pytest.raises(SourceError, match=r"a_loss_mask\.idx: 3 documents, document 1 of 4 tokens; .*a\.idx has 3, "
                                          r"document 1 of 3"):
        SftSource(prefix)


def test_only_some_pairs_with_a_mask_is_refused(tmp_path):
    a = _megatron(tmp_path, "a", [r["input_ids"] for r in TOKEN_ROWS], np.int32)
    _megatron(tmp_path, "a_loss_mask", [r["loss_mask"] for r in TOKEN_ROWS], np.uint8)
    b = _megatron(tmp_path, "b", [r["input_ids"] for r in TOKEN_ROWS], np.int32)
    with pytest.raises(SourceError, match=r"/b: no mask pair .*/b_loss_mask\.bin/\.idx, while .*/a has one"):
        SftSource([a, b])


def test_mds_mask_values_are_checked(tmp_path):
    rows = [{"input_ids": np.asarray([1, 2, 3], np.int32), "loss_mask": np.asarray([0, 2, 1], np.int32)}]
    mds = _mds(tmp_path, rows, {"input_ids": "ndarray:int32", "loss_mask": "ndarray:int32"})
    with pytest.raises(SourceError, match=r"shard\.\d+\.mds, row 0, field 'loss_mask', position 1: 2, expected 0 or 1"):
        _docs(SftSource(mds))
