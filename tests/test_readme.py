"""The README's Python code runs as written with a Hugging Face causal LM: its blocks are executed in order, in
one namespace, after the substitutions below (each must match, so a README edit that drops one fails here):

- the shard glob: a small local corpus of text shards written here;
- tokenizer "tekken" -> "bytes": a tiny model cannot hold Tekken's 131,072-id vocabulary on a CPU test (logits of
  [T, 131072]); the README names both vocabularies;
- dp=8 -> dp=1: one process, no torch.distributed;
- the Trainer's max_steps, save_steps and output folder: a short run in a temporary folder.

`model` (a 2-layer Llama built from a config with the bytes tokenizer's 257 ids, no download) and `optimizer` are
given to the code. The loop's losses are checked against each document run on its own, its tokens against the
corpus's bytes, and the Trainer's checkpoints for the loader state.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

transformers = pytest.importorskip("transformers")

README = Path(__file__).resolve().parent.parent / "README.md"
EOS, VOCAB = 256, 257  # the bytes tokenizer's EOS id and vocabulary, stated here independently


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def substituted(code: str, subs: list[tuple[str, str]]) -> str:
    for old, new in subs:
        assert old in code, f"the README no longer holds {old!r}: update this test's substitutions"
        code = code.replace(old, new)
    return code


def corpus(tmp_path) -> list[str]:
    rng = np.random.default_rng(0)
    words = ["packed", "loader", "attention", "cost", "naïve", "über", "日本", "token"]
    texts = [" ".join(rng.choice(words, size=int(rng.integers(1, 12)))) + f" #{i}" for i in range(16)]
    (tmp_path / "shards").mkdir()
    for k, part in enumerate((texts[:10], texts[10:])):
        pq.write_table(pa.table({"text": part}), tmp_path / "shards" / f"part-{k}.parquet")
    return texts


def tiny_llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    return transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa", dtype=torch.float32).train()


def reference_loss(model, input_ids, position_ids, loss_tokens) -> float:
    """Each document of the row (a new one wherever the position is 0) run alone: its next-token loss sum, over
    the step's loss tokens."""
    ids, pos = input_ids.reshape(-1), position_ids.reshape(-1)
    starts = torch.nonzero(pos == 0).view(-1).tolist() + [ids.numel()]
    total = 0.0
    with torch.no_grad():
        for a, b in zip(starts, starts[1:]):
            doc = ids[a:b].unsqueeze(0)
            logits = model(input_ids=doc).logits[0]
            total += float(torch.nn.functional.cross_entropy(logits[:-1], doc[0, 1:], reduction="sum"))
    return total / loss_tokens


def test_readme_python_blocks_run_as_written(tmp_path, monkeypatch):
    pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate (in the hf extra)")
    monkeypatch.chdir(tmp_path)
    texts = corpus(tmp_path)
    # the training loop and the Trainer block; the elastic-resume blocks after them need several processes and
    # run as tests/test_elastic_resume.py and tests/test_elastic_workers.py do
    loop, trainer_block, *elastic = python_blocks()
    assert "for batch in loader" in loop and "PackedTrainer" in trainer_block
    assert all("merge_states" in b or "dataloader_state_for" in b for b in elastic)
    common = [('"shards/*.parquet"', f'"{tmp_path}/shards/*.parquet"'), ('tokenizer="tekken"', 'tokenizer="bytes"'),
              ("ParallelConfig(dp=8)", "ParallelConfig(dp=1)")]

    model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    seen, losses, steps = [], [], []
    busy = []

    def check_forward(module, args, kwargs, out):
        if busy:  # the reference's own forwards
            return
        busy.append(1)
        try:
            seen.append(kwargs["input_ids"].reshape(-1).tolist())
            ref = reference_loss(module, kwargs["input_ids"], kwargs["position_ids"], kwargs["num_items_in_batch"])
            losses.append((float(out.loss), ref))
        finally:
            busy.clear()

    hook = model.register_forward_hook(check_forward, with_kwargs=True)
    optimizer.register_step_post_hook(lambda *a: steps.append(1))
    ns = {"model": model, "optimizer": optimizer}
    exec(compile(substituted(loop, common), "README.md (loop)", "exec"), ns)

    expected = sorted(t for text in texts for t in list(text.encode("utf-8")) + [EOS])
    assert sorted(t for row in seen for t in row) == expected  # every token of the corpus once
    assert losses and all(got == pytest.approx(ref, rel=1e-4) for got, ref in losses), losses
    assert len(steps) == ns["batch"].step + 1  # one optimizer step per packloader step
    assert ns["state"]["stats"]["tokens"] == len(expected)
    hook.remove()

    exec(compile(substituted(trainer_block, common + [("max_steps=1000", "max_steps=2"), ("save_steps=100", "save_steps=1"),
                                                       ('TrainingArguments("run"', f'TrainingArguments("{tmp_path}/run"')]),
                 "README.md (Trainer)", "exec"), ns)
    assert ns["trainer"].state.global_step == 2  # resumed from the last checkpoint: no step beyond max_steps
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["checkpoint-1", "checkpoint-2"]
    for c in ("checkpoint-1", "checkpoint-2"):
        assert (tmp_path / "run" / c / "packloader_state-rank0.pt").is_file()
