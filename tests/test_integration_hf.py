"""Hugging Face adapter with the real transformers package on CPU: a tiny random LlamaForCausalLM's packed forward
on packloader batches equals its per-document unpacked forward (logits and loss), through transformers' own
packed-position path (sdpa) and through packloader's varlen attention; PackedTrainer's accumulated gradient equals
the per-token mean gradient computed one document at a time."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch
from helpers.hf_trainer import first_grads_callback, one_step_args

transformers = pytest.importorskip("transformers")

from packloader.collate.batch import IGNORE_INDEX  # noqa: E402
from packloader.contracts import PlanConfig  # noqa: E402
from packloader.loader.loader import PackedLoader  # noqa: E402
from packloader.sources.base import IterableSource  # noqa: E402
from packloader_integrations import hf as phf  # noqa: E402

VOCAB = 101
ROOT = Path(__file__).resolve().parent.parent


def docs(n=40, seed=0, max_len=120):
    rng = np.random.default_rng(seed)
    lengths = np.minimum(rng.pareto(1.1, size=n) * 20 + 2, max_len).astype(int)
    return [rng.integers(0, VOCAB, size=int(k)).astype(np.int32) for k in lengths]


def loader(ds, *, context=200, **kw):
    cfg = PlanConfig(strategy=kw.pop("strategy", "fixed"), max_tokens=200, context=context,
                     tokens_per_step=kw.pop("tokens_per_step", 400),
                     allow_slicing=False, num_micro_batches=kw.pop("num_micro_batches", None))
    return PackedLoader(IterableSource(ds), config=cfg, num_threads=0, append_eos=False, **kw)


def tiny_llama(attn="sdpa", seed=0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    model = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation=attn, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def corpus():
    return docs()


def doc_tokens(ld, batches) -> dict:
    """Each segment's whole document, read straight from the loader's stream (doc ids are the stream's)."""
    ids = sorted({s.doc for b in batches for s in b.segments})
    return dict(zip(ids, ld.stream.read(ids)))


def reference(model, batch, corpus):
    """Per-segment forward, one document or independent piece at a time, as its own sequence from position 0
    (concat-and-chunk); each token's target is the document's next token, past the piece's end too."""
    logits, loss_sum, n = [], 0.0, 0
    for s in batch.segments:
        x = torch.from_numpy(corpus[s.doc][s.start:s.end]).long().unsqueeze(0)
        pos = torch.arange(s.end - s.start).unsqueeze(0)
        with torch.no_grad():
            lg = model(input_ids=x, position_ids=pos).logits[0]
        logits.append(lg)
        doc = corpus[s.doc]
        tgt = torch.from_numpy(doc[s.start + 1:s.end + 1]).long()  # next tokens (the document's, past the piece)
        k = tgt.numel()
        loss_sum += float(torch.nn.functional.cross_entropy(lg[:k], tgt, reduction="sum"))
        n += k
    return torch.cat(logits), loss_sum / n


@pytest.mark.parametrize("attention", ["position_ids", "varlen"])
def test_packed_forward_equals_per_document_forward(corpus, attention):
    attn = "sdpa" if attention == "position_ids" else phf.register_packloader_attention()
    model = tiny_llama(attn)
    # context 90 < longest document: pieces of long documents (positions from 0) are in the batches too
    ld = loader(corpus, context=90)
    batches = list(ld)[:6]
    toks = doc_tokens(ld, batches)
    assert any(s.start > 0 for b in batches for s in b.segments)
    for b in batches:
        inputs = phf.hf_batch(b, attention=attention)
        assert inputs["input_ids"].shape == inputs["position_ids"].shape == (1, b.num_tokens)
        with torch.no_grad():
            out = model(**inputs)
        ref_logits, ref_loss = reference(model, b, toks)
        torch.testing.assert_close(out.logits[0], ref_logits, rtol=1e-4, atol=1e-4)
        assert float(out.loss) == pytest.approx(ref_loss, rel=1e-4)


def test_unshifted_labels_shift_to_packloader_labels_inside_the_row(corpus):
    """HF-convention labels, shifted the way transformers' loss shifts them, give packloader's labels except at a
    piece's last token (whose target lies outside the row)."""
    for b in list(loader(corpus, context=90))[:6]:
        inputs = phf.hf_batch(b)
        shifted = torch.nn.functional.pad(inputs["labels"][0], (0, 1), value=IGNORE_INDEX)[1:]
        lab = b.labels
        ends = b.cu_seqlens[1:].long() - 1
        keep = torch.ones_like(lab, dtype=torch.bool)
        keep[ends] = False
        assert torch.equal(shifted[keep], lab[keep])
        assert (shifted[ends] == IGNORE_INDEX).all()


def test_ambiguous_positions_are_refused():
    """The collate never makes such positions (every segment starts at 0); a hand-made batch can."""
    import dataclasses

    from packloader.collate.collate import collate
    from packloader.contracts import Segment

    toks = {0: np.arange(10, dtype=np.int32), 1: np.arange(20, dtype=np.int32)}
    b = collate([Segment(0, 0, 4, 0), Segment(1, 4, 9, 4)], toks)
    assert phf.hf_batch(b)["position_ids"][0].tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 4]
    # the second segment continuing the first one's positions: both of transformers' inferences merge them
    merged = dataclasses.replace(b, position_ids=torch.arange(9))
    # the second segment starting at 5: the mask path sees the boundary, the flash path (starts at 0) does not
    shifted = dataclasses.replace(b, position_ids=torch.tensor([0, 1, 2, 3, 5, 6, 7, 8, 9]))
    for bad in (merged, shifted):
        with pytest.raises(ValueError, match="attention='varlen'"):
            phf.hf_batch(bad)
        assert phf.hf_batch(bad, attention="varlen")["cu_seq_lens_q"].tolist() == [0, 4, 9]


def _transformers_cu_seqlens(position_ids: torch.Tensor) -> tuple[list[int], list[int]]:
    """Sequence starts as transformers infers them from [1, T] position ids: its flash-attention path
    (`prepare_fa_kwargs_from_position_ids`, a start where the position is 0) and its mask path
    (`find_packed_sequence_indices`, a start where the position does not grow by one), as cu_seqlens."""
    from transformers.masking_utils import find_packed_sequence_indices
    from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids

    (cu_q, cu_k), _ = prepare_fa_kwargs_from_position_ids(position_ids)
    assert torch.equal(cu_q, cu_k)
    seq = find_packed_sequence_indices(position_ids)[0]
    counts = torch.bincount(seq - seq[0])
    return cu_q.tolist(), [0] + torch.cumsum(counts, 0).tolist()


def test_adjacent_pieces_of_one_document_stay_apart_in_transformers():
    """Issue reproduction: documents of 16, 48 and 96 tokens at context 48 (max_tokens 200) give the segments
    (1,0,16) (4,0,48) (8,0,48) (8,48,96), two adjacent pieces of document 8 in one micro-batch. Their positions
    used to continue (48..95 after 0..47), and transformers' flash path merged the two pieces; now every piece
    restarts at 0, and both of transformers' inferences give packloader's cu_seqlens."""
    from packloader.collate.collate import collate
    from packloader.contracts import Segment

    toks = {1: np.arange(16, dtype=np.int32), 4: np.arange(48, dtype=np.int32), 8: np.arange(96, dtype=np.int32)}
    segs = [Segment(1, 0, 16, 0), Segment(4, 0, 48, 0), Segment(8, 0, 48, 0), Segment(8, 48, 96, 48)]
    b = collate(segs, toks)
    assert b.cu_seqlens.tolist() == [0, 16, 64, 112, 160]
    inputs = phf.hf_batch(b)  # position_ids mode accepts it
    flash, mask = _transformers_cu_seqlens(inputs["position_ids"])
    assert flash == mask == [0, 16, 64, 112, 160]
    assert int(inputs["position_ids"].max()) == 47  # below the context


def test_loader_pieces_in_one_micro_batch_through_transformers():
    """The same through the loader: documents cut at context 32 < max_tokens 200, adjacent pieces packed into one
    micro-batch; transformers' inferred sequences are packloader's segments, positions stay below the context."""
    lengths = [16, 48, 96, 70, 5, 33]
    rng = np.random.default_rng(3)
    ds = [rng.integers(0, VOCAB, size=k).astype(np.int32) for k in lengths]
    cfg = PlanConfig(strategy="fixed", max_tokens=200, context=32, tokens_per_step=400, allow_slicing=False)
    ld = PackedLoader(IterableSource(ds), config=cfg, num_threads=0, append_eos=False, epochs=1)
    batches = [b for b in ld if b.num_tokens]
    adjacent = 0
    for b in batches:
        segs = b.segments
        adjacent += sum(p.doc == q.doc and p.end == q.start for p, q in zip(segs, segs[1:]))
        inputs = phf.hf_batch(b)
        flash, mask = _transformers_cu_seqlens(inputs["position_ids"])
        assert flash == mask == b.cu_seqlens.tolist()
        assert int(inputs["position_ids"].max()) < 32
    assert adjacent > 0  # the case of the issue did occur


def test_packed_trainer_gradient_is_the_per_token_mean_of_the_step(tmp_path, corpus):
    pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate (in the hf extra)")
    ga = 3
    mk = lambda: loader(corpus, num_micro_batches=ga, epochs=None)  # noqa: E731
    step0 = []
    ld = mk()
    it = iter(ld)
    while True:
        b = next(it)
        if b.step > 0:
            break
        step0.append(b)
    assert len(step0) == ga
    toks = doc_tokens(ld, step0)

    model = tiny_llama("sdpa")
    ref_model = tiny_llama("sdpa")
    ref_model.load_state_dict(model.state_dict())
    ref_model.train()
    total = sum(b.loss_tokens_in_step for b in step0[:1])
    loss = 0.0
    for b in step0:
        for s in b.segments:
            x = torch.from_numpy(toks[s.doc][s.start:s.end]).long().unsqueeze(0)
            lg = ref_model(input_ids=x).logits[0]
            loss = loss + torch.nn.functional.cross_entropy(lg[:-1], x[0, 1:], reduction="sum")
    (loss / total).backward()
    ref_grads = {n: p.grad.clone() for n, p in ref_model.named_parameters()}

    grads = {}
    model.train()
    trainer = phf.PackedTrainer(model=model, args=one_step_args(tmp_path, ga), packed_loader=mk(),
                                callbacks=[first_grads_callback(model, grads)])
    trainer.train()
    assert grads
    for n, g in ref_grads.items():
        torch.testing.assert_close(grads[n], g, rtol=2e-4, atol=1e-6, msg=n)


def test_trainer_refuses_a_mismatched_accumulation(tmp_path, corpus):
    pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate (in the hf extra)")
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=1, gradient_accumulation_steps=5,
                                          use_cpu=True, report_to=[], save_strategy="no")
    with pytest.raises(ValueError, match="num_micro_batches=5"):  # at once, not at the first step
        phf.PackedTrainer(model=tiny_llama(), args=args, packed_loader=loader(corpus, num_micro_batches=3, epochs=None))


def _step_with_empty_last(batches, toks, ga):
    """One step's micro-batches rearranged: all segments in the first ga - 1, the last one empty."""
    from packloader.collate.collate import collate_step

    segs = [s for b in batches for s in b.segments]
    parts = [list(p) for p in np.array_split(np.arange(len(segs)), ga - 1)]
    mbs = [[segs[i] for i in p] for p in parts] + [[]]
    return list(collate_step(mbs, toks, step=batches[0].step, loss_tokens_in_step=batches[0].loss_tokens_in_step))


def _reference_grads(model, segments, toks, total):
    """Gradient of the summed next-token loss of every segment, each run on its own, divided by `total`."""
    loss = 0.0
    for s in segments:
        x = torch.from_numpy(toks[s.doc][s.start:s.end]).long().unsqueeze(0)
        lg = model(input_ids=x).logits[0]
        loss = loss + torch.nn.functional.cross_entropy(lg[:-1], x[0, 1:], reduction="sum")
    (loss / total).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_hf_batch_of_an_empty_micro_batch_is_a_placeholder_row():
    from packloader.collate.collate import collate

    empty = collate([], {}, loss_tokens_in_step=9)
    for attention in ("position_ids", "varlen"):
        d = phf.hf_batch(empty, attention=attention, include_meta=True, pad_id=3)
        assert d["input_ids"].tolist() == [[3]] and d["position_ids"].tolist() == [[0]]
        assert d["labels"].tolist() == d["shift_labels"].tolist() == [[IGNORE_INDEX]]
        assert d[phf.META_KEY]["num_loss_tokens"] == 0 and d[phf.META_KEY]["loss_tokens_in_step"] == 9
    assert d["cu_seq_lens_q"].tolist() == [0, 1] and d["max_length_q"] == 1


def test_packed_trainer_runs_an_empty_last_micro_batch(tmp_path, corpus):
    """A step whose last micro-batch is empty: PackedTrainer runs the placeholder row through the model (a forward
    for each of the ga micro-batches, so under DDP the accumulation boundary's all-reduce still happens), and the
    gradient is still the per-token mean over the step's documents."""
    pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate (in the hf extra)")
    ga = 3
    ld = loader(corpus, num_micro_batches=ga, epochs=None)
    step0 = []
    for b in ld:
        if b.step > 0:
            break
        step0.append(b)
    toks = doc_tokens(ld, step0)
    step = _step_with_empty_last(step0, toks, ga)
    assert [b.num_tokens == 0 for b in step] == [False, False, True]

    model, ref_model = tiny_llama("sdpa"), tiny_llama("sdpa")
    ref_model.load_state_dict(model.state_dict())
    ref_model.train()
    ref_grads = _reference_grads(ref_model, [s for b in step for s in b.segments], toks, step[0].loss_tokens_in_step)

    grads, calls = {}, []
    model.register_forward_hook(lambda *a: calls.append(1))
    model.train()
    phf.PackedTrainer(model=model, args=one_step_args(tmp_path, ga), packed_loader=step,
                      callbacks=[first_grads_callback(model, grads)]).train()
    assert len(calls) == ga
    for n, g in ref_grads.items():
        torch.testing.assert_close(grads[n], g, rtol=2e-4, atol=1e-6, msg=n)


def _ddp_ranks(rank, world, steps, toks, ref_grads):
    """Plain DDP (gloo) over hf_batch rows, all-reduce only in the last micro-batch's backward (no_sync before)."""
    import contextlib

    from torch.nn.parallel import DistributedDataParallel

    model = tiny_llama("sdpa").train()
    ddp = DistributedDataParallel(model)
    mbs = steps[rank]
    for i, b in enumerate(mbs):
        inputs = phf.hf_batch(b)
        target = inputs.pop("shift_labels")[0]
        inputs.pop("labels")
        with ddp.no_sync() if i < len(mbs) - 1 else contextlib.nullcontext():
            lg = ddp(**inputs).logits[0]
            loss = torch.nn.functional.cross_entropy(lg, target, ignore_index=IGNORE_INDEX, reduction="sum")
            (loss * world / b.loss_tokens_in_step).backward()  # DDP averages over ranks
    return max(float((p.grad - ref_grads[n]).abs().max()) for n, p in model.named_parameters())


@pytest.mark.multiprocess
def test_ddp_ranks_stay_in_step_over_an_empty_last_micro_batch(corpus):
    """Two DP ranks, rank 1's last micro-batch empty: its placeholder row's backward joins DDP's all-reduce (a rank
    that skipped it would leave the other waiting), and both end with the per-token mean gradient of the step."""
    from helpers.distributed import run_ranks

    ga = 2
    # 2 micro-batches of 200 hold any step of 200 tokens within one piece of 200 (a step holds up to 399)
    ld = loader(corpus, num_micro_batches=ga, epochs=None, tokens_per_step=200)
    first = [b for _, b in zip(range(2 * ga), ld)]  # two steps of one loader: the two ranks' shares of a step
    toks = doc_tokens(ld, first)
    total = first[0].loss_tokens_in_step + first[ga].loss_tokens_in_step
    steps = [first[:ga], _step_with_empty_last(first[ga:], toks, ga)]
    for s in steps:
        for b in s:
            b.loss_tokens_in_step = total
    ref = tiny_llama("sdpa").train()
    ref_grads = _reference_grads(ref, [s for st in steps for b in st for s in b.segments], toks, total)
    errs = run_ranks(_ddp_ranks, 2, steps, toks, ref_grads, timeout=240)
    assert max(errs) < 1e-5, errs


# --- checkpoints and resume through the real Trainer --------------------------------------------------------------

def _run_trainer_process(spec: dict) -> subprocess.CompletedProcess:
    """tests/helpers/hf_trainer.py's `trainer_run` in a fresh interpreter (the test's PYTHONPATH passed on)."""
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return subprocess.run([sys.executable, str(ROOT / "tests" / "helpers" / "hf_trainer.py"), json.dumps(spec)],
                          capture_output=True, text=True, timeout=300, env=env)


def _records(path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def _per_step(records) -> dict[int, tuple[list, float]]:
    """step -> (its micro-batches' input ids, its loss: the sum of the micro-batches' per-step-normalised losses)."""
    out: dict[int, tuple[list, float]] = {}
    for r in records:
        ids, loss = out.get(r["step"], ([], 0.0))
        out[r["step"]] = (ids + [r["ids"]], loss + r["loss"])
    return out


@pytest.mark.multiprocess
def test_trainer_killed_mid_step_resumes_the_same_tokens_and_losses(tmp_path):
    """A PackedTrainer run killed (SIGKILL) in the middle of step 5, after its checkpoints at steps 2 and 4, and
    resumed in a new process with train(resume_from_checkpoint=True), trains the same micro-batches (token ids)
    and the same losses at every step as one uninterrupted run; every checkpoint holds the loader state."""
    pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate (in the hf extra)")
    from helpers.docs import token_docs, write_token_shards
    from helpers.hf_trainer import VOCAB as HVOCAB

    shards = write_token_shards(tmp_path, token_docs(n=60, seed=1, max_len=300, vocab=HVOCAB), shards=2)
    base = dict(shards=shards, ga=3, max_steps=8, save_steps=2)
    runs = {name: dict(base, out=str(tmp_path / name), record=str(tmp_path / f"{name}.jsonl"),
                       logs=str(tmp_path / f"{name}-logs.json")) for name in ("whole", "killed")}
    whole = _run_trainer_process(runs["whole"])
    assert whole.returncode == 0, whole.stderr[-4000:]
    killed = _run_trainer_process(dict(runs["killed"], kill_at=5))
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-4000:]
    ckpts = sorted(p.name for p in (tmp_path / "killed").iterdir())
    assert ckpts == ["checkpoint-2", "checkpoint-4"]
    for c in ckpts:
        assert (tmp_path / "killed" / c / "packloader_state-rank0.pt").is_file()
    # what the killed run trained: steps 1-4 and step 5's first micro-batch, which no checkpoint holds
    killed_steps = _per_step(_records(runs["killed"]["record"]))
    assert sorted(killed_steps) == [1, 2, 3, 4, 5] and len(killed_steps[5][0]) == 1
    resumed = _run_trainer_process(dict(runs["killed"], resume=True, record=str(tmp_path / "resumed.jsonl")))
    assert resumed.returncode == 0, resumed.stderr[-4000:]

    ref = _per_step(_records(runs["whole"]["record"]))
    got = {**{s: v for s, v in killed_steps.items() if s <= 4}, **_per_step(_records(tmp_path / "resumed.jsonl"))}
    assert sorted(ref) == sorted(got) == list(range(1, 9))
    for s in ref:
        assert got[s][0] == ref[s][0], f"step {s}: other tokens than the uninterrupted run"
        assert got[s][1] == pytest.approx(ref[s][1], rel=1e-6, abs=1e-7), f"step {s}: loss"
    # the logged losses agree too (the resumed history starts with the checkpoint's steps 1-4)
    ref_logs = {h["step"]: h["loss"] for h in json.loads(Path(runs["whole"]["logs"]).read_text()) if "loss" in h}
    got_logs = {h["step"]: h["loss"] for h in json.loads(Path(runs["killed"]["logs"]).read_text()) if "loss" in h}
    assert got_logs == ref_logs and len(ref_logs) == 8


def _steps_of(batches) -> dict[int, list]:
    out: dict[int, list] = {}
    for b in batches:
        out.setdefault(b.step, []).append(b)
    return out


def test_trainer_logs_the_data_epoch_and_tokens_per_second(tmp_path, corpus):
    """The logged epoch is the data's (completed epochs + the share of the epoch's documents drawn), computed here
    from the documents of each step of an independent loader (`fixed` plans every document it draws, no delay);
    the run's throughput is tokens per second, its tokens those of the micro-batches trained."""
    pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate (in the hf extra)")
    ga, steps = 3, 9
    mk = lambda: loader(corpus, num_micro_batches=ga, epochs=None)  # noqa: E731
    ref = _steps_of(b for b, _ in zip(mk(), range(steps * ga)))
    assert sorted(ref) == list(range(steps)) and ref[steps - 1][0].epoch >= 1  # crosses an epoch boundary
    seen: dict[int, set] = {}
    expected_epoch = {}
    for s in range(steps):
        e = ref[s][0].epoch
        seen.setdefault(e, set()).update(seg.doc for b in ref[s] for seg in b.segments)
        expected_epoch[s + 1] = e + len(seen[e]) / len(corpus)
    assert expected_epoch[max(s + 1 for s in ref if ref[s][0].epoch == 0)] == 1.0

    model = tiny_llama("sdpa").train()
    args = one_step_args(tmp_path, ga, max_steps=steps, logging_strategy="steps", logging_steps=1)
    trainer = phf.PackedTrainer(model=model, args=args, packed_loader=mk())
    metrics = trainer.train().metrics
    logs = {h["step"]: h for h in trainer.state.log_history if "loss" in h}
    assert {s: h["epoch"] for s, h in logs.items()} == pytest.approx(expected_epoch)
    assert all(h["packloader/tokens_per_second"] > 0 for h in logs.values())
    tokens = sum(b.num_tokens for s in ref.values() for b in s)
    assert metrics["train_tokens"] == tokens
    assert metrics["train_tokens_per_second"] == pytest.approx(tokens / metrics["train_runtime"], rel=1e-3)
    assert "train_samples_per_second" not in metrics  # micro-batches per second, not samples


class _StandInStepMetrics(msgspec.Struct, kw_only=True):
    """A record shaped like the loader's StepMetrics (contracts.StepMetrics, not on this branch): numbers and a
    name; PackedTrainer logs the numeric fields."""

    predicted_step_time: float
    tokens: int
    note: str = "x"
    bubble_share: float | None = None


def test_trainer_logs_the_loaders_step_metrics(tmp_path, corpus):
    """Each micro-batch's `step_metrics` record, where the loader sets one, reaches the logs of its step as
    `packloader/<field>` (numbers only); a step without one logs no such field."""
    pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate (in the hf extra)")
    ga = 3
    batches = [b for b, _ in zip(loader(corpus, num_micro_batches=ga, epochs=None), range(2 * ga))]
    for b in batches[:ga]:
        b.step_metrics = _StandInStepMetrics(predicted_step_time=0.25, tokens=sum(x.num_tokens for x in batches[:ga]))
    for b in batches[ga:]:  # the loader sets a real StepMetrics on every batch: this step stands for one without
        b.step_metrics = None
    args = one_step_args(tmp_path, ga, max_steps=2, logging_strategy="steps", logging_steps=1)
    trainer = phf.PackedTrainer(model=tiny_llama("sdpa").train(), args=args, packed_loader=batches)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert logs[0]["packloader/predicted_step_time"] == 0.25
    assert logs[0]["packloader/tokens"] == sum(b.num_tokens for b in batches[:ga])
    assert "packloader/note" not in logs[0] and "packloader/bubble_share" not in logs[0]
    assert not any(k.startswith("packloader/") and k != "packloader/tokens_per_second" for k in logs[1])


def test_trainer_logs_the_real_step_metrics(tmp_path, corpus):
    """The loader's own StepMetrics record (not a stand-in) reaches the logs of its step."""
    pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate (in the hf extra)")
    ga = 3
    batches = [b for b, _ in zip(loader(corpus, num_micro_batches=ga, epochs=None), range(ga))]
    record = batches[0].step_metrics
    assert record is not None and all(b.step_metrics == record for b in batches)
    args = one_step_args(tmp_path, ga, max_steps=1, logging_strategy="steps", logging_steps=1)
    trainer = phf.PackedTrainer(model=tiny_llama("sdpa").train(), args=args, packed_loader=batches)
    trainer.train()
    log = next(h for h in trainer.state.log_history if "loss" in h)
    assert log["packloader/step_time"] == record.step_time and log["packloader/tokens"] == record.tokens
    assert log["packloader/tokens"] == sum(b.num_tokens for b in batches)


def test_trainer_refuses_to_checkpoint_a_loader_without_state(tmp_path, corpus):
    pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate (in the hf extra)")
    ga = 3
    batches = [b for b, _ in zip(loader(corpus, num_micro_batches=ga, epochs=None), range(ga))]
    args = one_step_args(tmp_path, ga, save_strategy="steps", save_steps=1)
    trainer = phf.PackedTrainer(model=tiny_llama("sdpa").train(), args=args, packed_loader=batches)
    with pytest.raises(ValueError, match=r"cannot checkpoint its packed_loader \(list\): it has no state_dict"):
        trainer.train()


def test_to_hf_gives_transformers_rows_in_either_layout(corpus):
    """PackedBatch.to_hf(): [1, T] rows from the flat and the hf layout, use_cache off, packloader's labels as
    shift_labels and transformers' unshifted labels equal to the adapter's (`unshifted_labels`, a loop per segment)."""
    from packloader_integrations._common import unshifted_labels

    for layout in ("flat", "hf"):
        for b in list(loader(corpus, context=90, layout=layout))[:6]:
            d = b.to_hf()
            t = b.num_tokens
            assert d["input_ids"].shape == d["position_ids"].shape == d["labels"].shape == (1, t)
            assert d["use_cache"] is False
            assert torch.equal(d["shift_labels"][0], b.labels.reshape(-1))
            assert torch.equal(d["labels"][0], unshifted_labels(b))


def _rank_trainer_run(rank, world, out_dir, resume_from):
    """One DDP rank (gloo) of a 4-step PackedTrainer run checkpointing every 2 steps, or resumed from the
    checkpoint folder `resume_from`; returns {step: [(input ids, loss)]} of the micro-batches this rank trained."""
    from packloader.contracts import ParallelConfig

    torch.set_num_threads(1)
    model = tiny_llama("sdpa").train()
    got: dict[int, list] = {}

    class StepOf(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            got.setdefault(state.global_step + 1, [])
            self.step = state.global_step + 1

    step_of = StepOf()
    model.register_forward_hook(lambda m, a, kw, out: got[step_of.step].append((kw["input_ids"][0].tolist(),
                                                                                  float(out.loss.detach()))),
                                with_kwargs=True)
    cfg = PlanConfig(strategy="wlb", max_tokens=200, context=200, tokens_per_step=600, allow_slicing=False,
                     num_micro_batches=2, parallel=ParallelConfig(dp=world))
    ld = PackedLoader(IterableSource(docs(n=60, seed=5)), config=cfg, num_threads=0, append_eos=False, epochs=None)
    args = one_step_args(out_dir, 2, max_steps=4, save_strategy="steps", save_steps=2, ddp_backend="gloo", seed=0)
    trainer = phf.PackedTrainer(model=model, args=args, packed_loader=ld, callbacks=[step_of])
    # transformers (4.57) loads the optimizer state with map_location=args.device when world > 1, which on CPU DDP
    # is torch.device("cpu:0"), a location torch.load cannot restore: give it plain "cpu" (GPU runs are unaffected)
    args.__dict__["_setup_devices"] = torch.device("cpu")
    trainer.train(resume_from_checkpoint=resume_from)
    return got


@pytest.mark.multiprocess
def test_ddp_trainer_resumes_each_ranks_stream(tmp_path):
    """Two DDP ranks (gloo): every checkpoint holds both ranks' loader states, and two new processes resumed from
    checkpoint-2 train, rank by rank, the micro-batches and losses of steps 3-4 of the uninterrupted run (the same
    max_steps, so the same learning-rate schedule)."""
    pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate (in the hf extra)")
    from helpers.distributed import run_ranks

    whole = run_ranks(_rank_trainer_run, 2, str(tmp_path), None, timeout=400)
    for c in ("checkpoint-2", "checkpoint-4"):
        for r in range(2):
            assert (tmp_path / c / f"packloader_state-rank{r}.pt").is_file()
    resumed = run_ranks(_rank_trainer_run, 2, str(tmp_path), str(tmp_path / "checkpoint-2"), timeout=400)
    assert whole[0][1] != whole[1][1]  # the ranks train different micro-batches
    for r in range(2):
        assert sorted(whole[r]) == [1, 2, 3, 4] and sorted(resumed[r]) == [3, 4]
        for s in (3, 4):
            assert [ids for ids, _ in resumed[r][s]] == [ids for ids, _ in whole[r][s]], (r, s)
            assert [x for _, x in resumed[r][s]] == pytest.approx([x for _, x in whole[r][s]], rel=1e-6), (r, s)
