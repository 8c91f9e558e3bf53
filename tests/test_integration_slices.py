"""Sliced plans in the adapters. PackedTrainer runs a SlimPack plan (documents cut into slices over micro-batches)
through SliceExecutor with a real transformers Llama (float64, CPU): the step's loss and every parameter gradient
equal those of the same documents run whole, one at a time. Megatron (PP > 1) and DeepSpeed refuse sliced
batches with the setting to change."""

from __future__ import annotations

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from packloader.contracts import PlanConfig  # noqa: E402
from packloader.loader.loader import PackedLoader  # noqa: E402
from packloader.sources.base import IterableSource  # noqa: E402
from packloader_integrations import hf as phf  # noqa: E402

VOCAB = 61
LENGTHS = [150, 20, 30, 12, 45, 8, 60, 25, 33, 9]
MB = 7  # micro-batches per step: what slimpack picks for these documents at 64 tokens per micro-batch


def corpus():
    rng = np.random.default_rng(0)
    return [rng.integers(0, VOCAB, size=n).astype(np.int32) for n in LENGTHS]


def sliced_loader(ds, **kw):
    cfg = PlanConfig(strategy="slimpack", max_tokens=64, context=256, tokens_per_step=400, num_micro_batches=MB)
    return PackedLoader(IterableSource(ds), config=cfg, num_threads=0, append_eos=False, **kw)


def tiny_llama(attn, seed=0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   use_cache=False)
    return transformers.LlamaForCausalLM._from_config(cfg, attn_implementation=attn, dtype=torch.float64)


def first_step(ld):
    out = []
    for b in ld:
        if b.step > 0:
            break
        out.append(b)
    return out


def whole_document_reference(model, docs):
    """Loss (per-token mean over all documents) and gradients, every document run whole on its own."""
    model.zero_grad()
    total = sum(len(d) - 1 for d in docs)
    loss = 0.0
    for d in docs:
        x = torch.from_numpy(d).long().unsqueeze(0)
        lg = model(input_ids=x).logits[0].float()  # transformers' causal-LM loss upcasts logits to float32 too
        loss = loss + torch.nn.functional.cross_entropy(lg[:-1], x[0, 1:], reduction="sum")
    (loss / total).backward()
    return float(loss) / total, {n: p.grad.clone() for n, p in model.named_parameters()}


def test_packed_trainer_runs_a_sliced_plan_like_whole_documents(tmp_path):
    pytest.importorskip("accelerate")
    docs = corpus()
    step0 = first_step(sliced_loader(docs, epochs=1))
    # the plan really slices: a document over several micro-batches, later slices attending to earlier ones
    assert len(step0) == MB
    assert any(s.attend_from < s.start for b in step0 for s in b.segments)
    assert sum(b.num_tokens for b in step0) == sum(LENGTHS)  # one step holds every document

    name = phf.register_packloader_attention()
    model = tiny_llama(name)
    ref = tiny_llama("eager")
    ref.load_state_dict(model.state_dict())
    ref.train()
    ref_loss, ref_grads = whole_document_reference(ref, docs)

    grads, losses = {}, []

    class Grab(transformers.TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kw):
            if not grads:
                grads.update({n: p.grad.clone() for n, p in model.named_parameters()})

    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=1, gradient_accumulation_steps=MB,
                                          learning_rate=1e-3, use_cpu=True, report_to=[], save_strategy="no",
                                          logging_strategy="no", max_grad_norm=0.0, dataloader_num_workers=0)
    trainer = phf.PackedTrainer(model=model, args=args, packed_loader=sliced_loader(docs, epochs=None),
                                callbacks=[Grab()])
    step = trainer.training_step
    trainer.training_step = lambda *a, **k: losses.append(float(step(*a, **k))) or torch.tensor(losses[-1])
    trainer.train()
    assert len(losses) == MB
    # the model runs in float64; transformers' loss (and so its gradient's first step) in float32, as here
    assert sum(losses) == pytest.approx(ref_loss, rel=1e-6)
    assert set(grads) == set(ref_grads)
    for n, g in ref_grads.items():
        torch.testing.assert_close(grads[n], g, rtol=1e-5, atol=1e-8, msg=n)


def test_packed_trainer_names_the_attention_setting_for_a_sliced_plan(tmp_path):
    pytest.importorskip("accelerate")
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=1, gradient_accumulation_steps=MB,
                                          use_cpu=True, report_to=[], save_strategy="no")
    trainer = phf.PackedTrainer(model=tiny_llama("sdpa"), args=args, packed_loader=sliced_loader(corpus(), epochs=None))
    with pytest.raises(ValueError, match=r"attn_implementation=register_packloader_attention\(\).*allow_slicing=False"):
        trainer.train()


def test_hf_batch_alone_still_refuses_slices():
    b = next(b for b in first_step(sliced_loader(corpus(), epochs=1)) if any(s.attend_from < s.start for s in b.segments))
    with pytest.raises(ValueError, match="allow_slicing=False"):
        phf.hf_batch(b)
