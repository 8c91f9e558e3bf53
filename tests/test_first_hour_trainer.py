"""PackedTrainer in a new user's first hour: plans priced for the model it trains, not the default llama3-8b, and
an accumulation hint that, followed, trains."""

from __future__ import annotations

import re

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate (in the hf extra)")

from helpers.hf_trainer import one_step_args, tiny_llama  # noqa: E402

import packloader_integrations.hf as phf  # noqa: E402
from packloader import PackedLoader, PlanConfig  # noqa: E402
from packloader.sources.base import IterableSource  # noqa: E402


def _loader(config: PlanConfig, n: int = 40, length: int = 150) -> PackedLoader:
    docs = [np.arange(1, 1 + length, dtype=np.int32) % 100 for _ in range(n)]
    return PackedLoader(IterableSource(docs), config=config, num_threads=0, append_eos=False, epochs=None)


def test_the_default_cost_model_becomes_the_trained_model(tmp_path):
    """A config that names no model is priced for the model trained (tiny_llama: hidden 32, 2 layers, 4 heads of
    8, 2 KV heads, FFN 64 gated, vocabulary 101); a model named in the config is kept."""
    config = PlanConfig(strategy="fixed", max_tokens=200, context=200, tokens_per_step=400, allow_slicing=False)
    loader = _loader(config)
    phf.PackedTrainer(model=tiny_llama(), args=one_step_args(tmp_path, 3), packed_loader=loader)
    assert loader.config.model == "shape:llama:hidden=32,layers=2,heads=4,kv_heads=2,head_dim=8,ffn=64,vocab=101,gated_mlp=1"
    batch = next(iter(loader))
    assert "llama3-8b" not in batch.step_metrics.cost_model, batch.step_metrics.cost_model
    named = _loader(PlanConfig(strategy="fixed", max_tokens=200, context=200, tokens_per_step=400,
                               allow_slicing=False, model="tiny"))
    phf.PackedTrainer(model=tiny_llama(), args=one_step_args(tmp_path, 3), packed_loader=named)
    assert named.config.model == "tiny"


def test_the_accumulation_hint_leads_to_settings_that_train(tmp_path):
    """Documents of 150 tokens, cap 200, 400 tokens per step: every step draws three documents, one per
    micro-batch. gradient_accumulation_steps=2 is refused with a count to set on both sides; setting it trains
    (was: num_micro_batches=2, which the loader then refused as needing >= 3)."""
    config = PlanConfig(strategy="fixed", max_tokens=200, context=200, tokens_per_step=400, allow_slicing=False,
                        model="tiny")
    trainer = phf.PackedTrainer(model=tiny_llama(), args=one_step_args(tmp_path, 2), packed_loader=_loader(config))
    with pytest.raises(ValueError) as e:
        trainer.train()
    hint = re.search(r"gradient_accumulation_steps=(\d+)\) and PlanConfig\(num_micro_batches=(\d+)\)", str(e.value))
    assert hint and hint.group(1) == hint.group(2), str(e.value)
    n = int(hint.group(1))
    assert n == 3  # ceil((400 + 200 - 1) / 200)
    pinned = PlanConfig(strategy="fixed", max_tokens=200, context=200, tokens_per_step=400, allow_slicing=False,
                        model="tiny", num_micro_batches=n)
    trainer = phf.PackedTrainer(model=tiny_llama(), args=one_step_args(tmp_path, n, max_steps=2),
                                packed_loader=_loader(pinned))
    assert trainer.train().global_step == 2
