"""DP-Merge micro-batches (SlimPack at dp 3: a piece heavier than a rank's share is run by a group of DP ranks as
context parallelism) reach each rank of the group whole, labels included. PackedTrainer, hf_batch, the DeepSpeed
helpers and the Megatron batch path cannot run them as a group, so they refuse them, naming the step, the
micro-batch and the ranks (issue 35, item 2), as the Megatron pipeline adapter already did; without DP-Merge the
same data trains. Which micro-batches are merged is read from the plan by hand below (rank 0's step 0)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.hf_trainer import one_step_args

from packloader.contracts import ParallelConfig, PlanConfig
from packloader.loader.loader import PackedLoader
from packloader.sources.base import IterableSource

transformers = pytest.importorskip("transformers")

from packloader_integrations import deepspeed as pds  # noqa: E402
from packloader_integrations import hf as phf  # noqa: E402

LENGTHS = [900, 50, 60, 40, 70, 30, 20, 25, 900, 40, 30, 60]
VOCAB = 101


def docs():
    rng = np.random.default_rng(0)
    return [rng.integers(0, VOCAB, size=n).astype(np.int32) for n in LENGTHS]


def loader(dp_merge: bool = True, dp_rank: int = 0):
    cfg = PlanConfig(strategy="slimpack", parallel=ParallelConfig(dp=3), max_tokens=1024, context=1024,
                     tokens_per_step=1200, model="tiny", allow_slicing=False, num_micro_batches=2,
                     planner_options={} if dp_merge else {"slimpack": {"dp_merge": False}})
    return PackedLoader(IterableSource(docs()), config=cfg, dp_rank=dp_rank, num_threads=0, append_eos=False)


def test_the_plan_merges_the_900_token_documents():
    """The precondition, by hand: rank 0's step 0 holds both 900-token documents, each shared with another rank."""
    first = [b for b in loader() if b.step == 0]
    assert [(b.dp_group, b.num_tokens) for b in first] == [([0, 1], 900), ([0, 2], 900)]
    assert all(b.dp_group is None for b in loader(dp_merge=False))


def test_hf_and_deepspeed_batches_refuse_a_dp_merge_micro_batch():
    b = next(iter(loader()))
    msg = r"cannot run DP-Merge micro-batches: step 0, micro-batch 0 is shared by DP ranks \[0, 1\]"
    with pytest.raises(ValueError, match=msg):
        phf.hf_batch(b)
    with pytest.raises(ValueError, match=msg):
        next(iter(phf.HFBatches(loader(), slices=True)))
    with pytest.raises(ValueError, match=msg):
        pds.deepspeed_batch(b)
    with pytest.raises(ValueError, match=msg):
        pds.ulysses_batch(b, 1, 0)


def tiny_llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024)
    return transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa", dtype=torch.float32)


def test_packed_trainer_refuses_dp_merge_and_trains_without_it(tmp_path):
    pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate (in the hf extra)")
    trainer = phf.PackedTrainer(model=tiny_llama(), args=one_step_args(tmp_path / "a", 2), packed_loader=loader())
    with pytest.raises(ValueError, match=r"PackedTrainer.* cannot run DP-Merge micro-batches: step 0, "
                                         r"micro-batch 0 is shared by DP ranks \[0, 1\].*'dp_merge': False"):
        trainer.train()
    ok = phf.PackedTrainer(model=tiny_llama(), args=one_step_args(tmp_path / "b", 2),
                           packed_loader=loader(dp_merge=False))
    assert ok.train().global_step == 1


def test_megatron_batch_refuses_dp_merge():
    pytest.importorskip("megatron.core")
    from packloader_integrations.megatron.batch import megatron_batch

    with pytest.raises(ValueError, match="the Megatron adapter cannot run DP-Merge micro-batches: step 0"):
        megatron_batch(next(iter(loader())))
