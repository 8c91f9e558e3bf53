"""docs/megatron-data.md's recipe, run as written: `packloader tokenize`, then its Python block, and the pair
read back by megatron-core's own IndexedDataset (bytes tokenizer: each document is its UTF-8 bytes and EOS 256)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from packloader.cli.main import main

indexed = pytest.importorskip("megatron.core.datasets.indexed_dataset")

DOC = Path(__file__).resolve().parents[1] / "docs" / "megatron-data.md"


def test_the_recipe_writes_the_corpus_as_a_megatron_pair(tmp_path, monkeypatch):
    texts = ["first document", "zweites Dokument, länger", "3", "the fourth " * 50]
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    monkeypatch.chdir(tmp_path)
    command = re.search(r"```bash\n(packloader tokenize [^\n#]*)", DOC.read_text()).group(1).split()
    assert main([*command[1:], "--tokenizer", "bytes", "--no-progress"]) == 0
    block = re.search(r"```python\n(.*?)```", DOC.read_text(), re.S).group(1)
    exec(compile(block, str(DOC), "exec"), {})
    pair = indexed.IndexedDataset(str(tmp_path / "corpus_text_document"))
    assert len(pair.document_indices) - 1 == len(texts)
    for k, text in enumerate(texts):
        assert pair[k].tolist() == list(text.encode()) + [256], k

    from packloader.sources.megatron_indexed import MegatronIndexedSource

    src = MegatronIndexedSource(str(tmp_path / "corpus_text_document"))
    assert [len(d) for d in src.read(0, np.arange(len(texts)))] == [len(t.encode()) + 1 for t in texts]
