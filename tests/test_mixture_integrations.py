"""Loss per mixture entry in the adapters: PackedTrainer's `packloader/loss/<entry>` logs and Megatron's per-entry
loss report, against cross entropy worked out here from the model's own logits, each token's entry read off its
id (entry 0's documents use ids below 50, entry 1's ids from 50)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.hf_trainer import one_step_args, tiny_llama

from packloader.contracts import PlanConfig
from packloader.loader.loader import PackedLoader
from packloader.sources.base import IterableSource
from packloader.sources.mixture import Mixture, MixtureEntry

SPLIT = 50


def mixture(seed: int = 0) -> Mixture:
    rng = np.random.default_rng(seed)
    entries = []
    for e in range(2):
        docs = [rng.integers(SPLIT * e, SPLIT * (e + 1), int(rng.integers(5, 60))).astype(np.int32) for _ in range(40)]
        entries.append(MixtureEntry(name=f"part{e}", source=IterableSource(docs, name=f"part{e}"), weight=0.5))
    return Mixture(entries=entries)


def loader(**kw) -> PackedLoader:
    cfg = PlanConfig(strategy="wlb", max_tokens=200, context=150, tokens_per_step=500, allow_slicing=False,
                     num_micro_batches=3)
    return PackedLoader(mixture(), tokenizer=None, config=cfg, num_threads=0, epochs=None, **kw)


def test_packed_trainer_logs_loss_per_entry(tmp_path):
    phf = pytest.importorskip("packloader_integrations.hf")
    model = tiny_llama().train()
    seen = []

    def on_forward(module, args, kwargs, out):
        seen.append((kwargs["input_ids"][0].clone(), kwargs["shift_labels"][0].clone(), out.logits[0].detach().clone()))

    model.register_forward_hook(on_forward, with_kwargs=True)
    args = one_step_args(tmp_path, 3, max_steps=2, logging_strategy="steps", logging_steps=1)
    trainer = phf.PackedTrainer(model=model, args=args, packed_loader=loader())
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2 and len(seen) == 6
    for step, log in enumerate(logs):
        sums, counts = np.zeros(2), np.zeros(2)
        for ids, labels, logits in seen[3 * step: 3 * step + 3]:
            keep = labels != -100
            ce = torch.nn.functional.cross_entropy(logits[keep].double(), labels[keep], reduction="none")
            ent = (ids[keep] >= SPLIT).long()
            for e in (0, 1):
                sums[e] += float(ce[ent == e].sum())
                counts[e] += int((ent == e).sum())
        for e in (0, 1):
            assert log[f"packloader/loss/part{e}"] == pytest.approx(sums[e] / counts[e], rel=1e-4)


@pytest.mark.parametrize("cp,layout", [(1, "te"), (2, "te"), (2, "packloader")])
def test_megatron_batch_entries_follow_the_tokens_and_the_report_sums_per_entry(cp, layout):
    pytest.importorskip("megatron.core")
    from packloader_integrations.megatron import loss_func_by_entry, megatron_batch

    ld = loader(pad_to_multiple=2 * cp) if layout == "te" and cp > 1 else loader()
    checked = 0
    for b in ld:
        for rank in range(cp):
            out = megatron_batch(b, cp_size=cp, cp_rank=rank, cp_layout=layout)
            tokens, mask = out["tokens"][0], out["loss_mask"][0]
            ent = out["token_entries"][0]
            real = mask > 0
            assert torch.equal(ent[real], (tokens[real] >= SPLIT).long())  # the token's own id says its entry
            losses = torch.arange(len(tokens), dtype=torch.float32).unsqueeze(0)  # a known per-token loss
            _, _, report = loss_func_by_entry(out["loss_mask"], out["token_entries"], out["entry_names"], losses)
            for e in (0, 1):
                sel = real & ((tokens >= SPLIT) == bool(e))
                assert report[f"packloader/loss/part{e}"].tolist() == [float(losses[0][sel].sum()), float(sel.sum())]
            checked += 1
        if b.step == 3:
            break
    ld.close()
    assert checked > 0
