"""The trainers train with the SFT mask: PackedTrainer's accumulated gradient equals the mean over the step's
trained targets computed one document at a time, and Megatron's per-token loss (through megatron-core's own
`forward_step_calc_loss`) equals the masked mean next-token loss computed unpacked. The references read each
document's mask straight from the rows, not from packloader's labels."""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest
import torch
from helpers.hf_trainer import first_grads_callback, one_step_args

from packloader.contracts import PlanConfig
from packloader.loader.loader import PackedLoader
from packloader.sources.sft import SftSource

VOCAB = 101


def _rows(n=30, seed=0, max_len=120):
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        k = int(rng.integers(4, max_len))
        p = int(rng.integers(1, k - 1))  # a prompt, then a completion that trains
        rows.append({"input_ids": rng.integers(0, VOCAB, k).tolist(), "completion_mask": [0] * p + [1] * (k - p)})
    return rows


def _loader(rows, *, context=200, ga=None, **kw):
    cfg = PlanConfig(strategy="fixed", max_tokens=200, context=context, tokens_per_step=400, allow_slicing=False,
                     num_micro_batches=ga)
    return PackedLoader(SftSource(rows), tokenizer=None, config=cfg, num_threads=0, **kw)


def _masked_sum(logits: torch.Tensor, ids: list[int], mask: list[int], start: int, end: int):
    """CE summed over tokens start..end-1 whose next token (of the document) trains, and their count."""
    tgt, keep = [], []
    for t in range(start, end):
        if t + 1 < len(ids) and mask[t + 1]:
            keep.append(t - start)
            tgt.append(ids[t + 1])
    if not keep:
        return logits.sum() * 0.0, 0
    return torch.nn.functional.cross_entropy(logits[keep], torch.tensor(tgt), reduction="sum"), len(keep)


def test_packed_trainer_gradient_is_the_mean_over_trained_targets(tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from packloader_integrations import hf as phf

    rows, ga = _rows(), 3
    ld = _loader(rows, ga=ga, epochs=None)
    step0 = []
    for b in ld:
        if b.step > 0:
            break
        step0.append(b)
    keys = dict(zip(range(ld.stream.num_docs), ld.stream.keys(range(ld.stream.num_docs))))
    ld.close()

    def tiny():
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
        return transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa", dtype=torch.float32)

    model, ref = tiny(), tiny()
    ref.train()
    loss, n = 0.0, 0
    for b in step0:
        for s in b.segments:
            row = rows[keys[s.doc].row]
            x = torch.tensor(row["input_ids"][s.start:s.end]).unsqueeze(0)
            part, k = _masked_sum(ref(input_ids=x).logits[0], row["input_ids"], row["completion_mask"], s.start, s.end)
            loss, n = loss + part, n + k
    assert n == step0[0].loss_tokens_in_step and 0 < n < sum(b.num_tokens for b in step0)
    (loss / n).backward()
    grads = {}
    model.train()
    trainer = phf.PackedTrainer(model=model, args=one_step_args(tmp_path, ga), packed_loader=_loader(rows, ga=ga),
                                callbacks=[first_grads_callback(model, grads)])
    trainer.train()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=2e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("cp_size,context", [(1, 200), (2, 200), (1, 40)])
def test_megatron_per_token_loss_counts_trained_targets_only(cp_size, context):
    pytest.importorskip("megatron.core")
    from megatron.core.pipeline_parallel.schedules import forward_step_calc_loss
    from megatron.core.transformer.transformer_config import TransformerConfig

    from packloader_integrations import megatron as pm

    rows = _rows(seed=1)
    cfg = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, calculate_per_token_loss=True)
    table = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(1))
    ref_sum, ref_n = 0.0, 0
    for r in rows:
        part, k = _masked_sum(table[torch.tensor(r["input_ids"])], r["input_ids"], r["completion_mask"], 0,
                              len(r["input_ids"]))
        ref_sum, ref_n = ref_sum + float(part), ref_n + k
    total_loss, total_tokens, step_tokens = 0.0, 0, {}
    for b in _loader(rows, context=context):
        step_tokens[b.step] = b.loss_tokens_in_step
        for r in range(cp_size):
            d = pm.megatron_batch(b, cp_size=cp_size, cp_rank=r)
            out = torch.nn.functional.cross_entropy(table[d["tokens"][0]], d["labels"][0], reduction="none")
            loss, num = forward_step_calc_loss(torch.nn.Identity(), out.unsqueeze(0), partial(pm.loss_func,
                                               d["loss_mask"]), cfg, None, False, b.micro_batches_in_step, [],
                                               cp_group_size=cp_size, is_last_stage=True)
            total_loss += float(loss)
            total_tokens += int(num)
    assert total_tokens == ref_n == sum(step_tokens.values())
    assert total_loss / total_tokens == pytest.approx(ref_sum / ref_n, rel=1e-5)
