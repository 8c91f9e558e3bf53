"""PackedTrainer binds each loader state to its checkpoint (issue 35, item 3): resuming `checkpoint-2` with the
`packloader_state-rank0.pt` of `checkpoint-4` (which trained loader steps 4-5 and never 2-3), or with the state of
another run's `checkpoint-2`, is refused naming both; the checkpoint's own state resumes. Real transformers
Trainer on the CPU with a tiny Llama."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from helpers.hf_trainer import one_step_args

from packloader.contracts import PlanConfig
from packloader.loader.loader import PackedLoader
from packloader.sources.base import IterableSource

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate (in the hf extra)")

from packloader_integrations import hf as phf  # noqa: E402
from packloader_integrations.hf_resume import load_loader_state  # noqa: E402

VOCAB = 101


def loader(seed: int = 0):
    rng = np.random.default_rng(seed)
    docs = [rng.integers(0, VOCAB, size=int(n)).astype(np.int32) for n in rng.integers(5, 60, size=80)]
    cfg = PlanConfig(strategy="fixed", max_tokens=64, context=64, tokens_per_step=64, num_micro_batches=2)
    return PackedLoader(IterableSource(docs), config=cfg, num_threads=0, append_eos=False)


def tiny_llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128)
    return transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa", dtype=torch.float32)


def train(out, max_steps: int, resume=None):
    args = one_step_args(out, 2, max_steps=max_steps, save_strategy="steps", save_steps=2)
    trainer = phf.PackedTrainer(model=tiny_llama(), args=args, packed_loader=loader())
    trainer.train(resume_from_checkpoint=resume)
    return trainer


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two runs of 4 steps, checkpoints at steps 2 and 4."""
    base = tmp_path_factory.mktemp("runs")
    for name in ("a", "b"):
        train(base / name, 4)
    return base


def test_a_state_of_a_later_checkpoint_is_refused(runs, tmp_path):
    ck = tmp_path / "checkpoint-2"
    shutil.copytree(runs / "a" / "checkpoint-2", ck)
    shutil.copy(runs / "a" / "checkpoint-4" / "packloader_state-rank0.pt", ck / "packloader_state-rank0.pt")
    with pytest.raises(ValueError, match=r"packloader_state-rank0.pt was saved at global step 4 \(run [0-9a-f]+\), "
                                         r"but checkpoint .*checkpoint-2 is at global step 2"):
        load_loader_state(loader(), str(ck), 0)
    with pytest.raises(ValueError, match="saved at global step 4"):  # what train(resume_from_checkpoint=...) runs
        train(tmp_path / "out", 6, resume=str(ck))


def test_a_state_of_another_runs_checkpoint_is_refused(runs, tmp_path):
    ck = tmp_path / "checkpoint-2"
    shutil.copytree(runs / "a" / "checkpoint-2", ck)
    shutil.copy(runs / "b" / "checkpoint-2" / "packloader_state-rank0.pt", ck / "packloader_state-rank0.pt")
    with pytest.raises(ValueError, match=r"was saved by run [0-9a-f]+ at global step 2, but checkpoint "
                                         r".*checkpoint-2 was saved by run [0-9a-f]+"):
        load_loader_state(loader(), str(ck), 0)


def test_the_checkpoints_own_state_resumes_and_keeps_the_run(runs, tmp_path):
    from packloader_integrations.hf_checkpoint import checkpoint_identity

    out = tmp_path / "resumed"
    shutil.copytree(runs / "a", out)
    shutil.rmtree(out / "checkpoint-4")
    trainer = train(out, 4, resume=str(out / "checkpoint-2"))
    assert trainer.state.global_step == 4
    # the resumed run wrote checkpoint-4 again, under the run that wrote checkpoint-2
    assert checkpoint_identity(str(out / "checkpoint-4")) == (4, checkpoint_identity(str(out / "checkpoint-2"))[1])
    load_loader_state(loader(), str(out / "checkpoint-4"), 0)
