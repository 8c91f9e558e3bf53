"""DeepSpeed adapter with the real deepspeed package on CPU (2 gloo ranks): a DeepSpeedEngine loop and a
PipelineEngine (one stage, DP=2) trained on packloader batches make the parameter update of the per-token mean
gradient over the global step, computed one document at a time (and, with SFT masks, the mean over the step's
trained targets, read from the rows' masks); DeepSpeed's own UlyssesSPDataLoaderAdapter
shards packloader's rows exactly as `ulysses_batch` does.

DeepSpeed's CPU backend JIT-builds a shared-memory all-reduce op on first use (about 4 minutes on 2 cores); the
ranks mark it unavailable (`disable_shm_comm_op`) so DeepSpeed uses torch.distributed's gloo directly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("deepspeed")

from helpers.distributed import run_ranks  # noqa: E402

VOCAB, HID = 53, 16


def docs(n=50, seed=3, max_len=90):
    rng = np.random.default_rng(seed)
    lengths = np.minimum(rng.pareto(1.1, size=n) * 15 + 2, max_len).astype(int)
    return [rng.integers(0, VOCAB, size=int(k)).astype(np.int32) for k in lengths]


def sft_rows(n=40, seed=5, max_len=90):
    """Pre-tokenized SFT rows: a prompt that does not train, then a completion that does."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        k = int(rng.integers(4, max_len))
        p = int(rng.integers(1, k - 1))
        rows.append({"input_ids": rng.integers(0, VOCAB, k).tolist(), "completion_mask": [0] * p + [1] * (k - p)})
    return rows


def loader(ds, dp_rank, ga, check_ranks=True):
    from packloader.contracts import ParallelConfig, PlanConfig
    from packloader.loader.loader import PackedLoader
    from packloader.sources.base import IterableSource
    from packloader.sources.sft import SftSource

    cfg = PlanConfig(strategy="wlb", parallel=ParallelConfig(dp=2), max_tokens=128, context=128,
                     tokens_per_step=640, num_micro_batches=ga, allow_slicing=False)
    masked = isinstance(ds[0], dict)
    return PackedLoader(SftSource(ds) if masked else IterableSource(ds), config=cfg, dp_rank=dp_rank, num_threads=0,
                        append_eos=False, epochs=None, check_ranks=check_ranks, tokenizer=None)


class Embed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = torch.nn.Embedding(VOCAB, HID)
        self.pos = torch.nn.Embedding(256, HID)

    def forward(self, inputs):
        ids, pos, cu = inputs
        return self.tok(ids) + self.pos(pos), pos, cu


class Attn(torch.nn.Module):
    """One causal attention layer over packed documents through packloader's varlen attention."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(HID, 3 * HID)

    def forward(self, x):
        from packloader.runtime.attention import varlen_attention

        h, pos, cu = x
        q, k, v = self.qkv(h[0]).view(-1, 3, 2, HID // 2).unbind(1)
        m = int(torch.diff(cu).max())
        o = varlen_attention(q, k, v, cu, cu, m, m, causal=True)
        return h + o.reshape(1, -1, HID), pos, cu


class Head(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.out = torch.nn.Linear(HID, VOCAB)

    def forward(self, x):
        return self.out(x[0])


def layers(seed=0):
    torch.manual_seed(seed)
    return [Embed(), Attn(), Head()]


def run(mods, ids, pos, cu):
    x = (ids, pos, cu)
    for m in mods:
        x = m(x)
    return x


def reference_grads(ds, step_batches):
    """Gradient of (sum of next-token losses of every document of the global step) / (its loss tokens), one
    document at a time (cu_seqlens of one segment). SFT rows (dicts): only targets whose mask is 1 count, and the
    count of trained targets comes from the rows' masks."""
    mods = layers()
    ld = step_batches[0][0]
    total = step_batches[0][1][0].loss_tokens_in_step
    loss, counted = 0.0, 0
    for _, mbs in step_batches:
        ids = sorted({s.doc for b in mbs for s in b.segments})
        if isinstance(ds[0], dict):
            rows = [ds[k.row] for k in ld.stream.keys(ids)]
            toks = {d: np.array(r["input_ids"]) for d, r in zip(ids, rows)}
            masks = {d: np.array(r["completion_mask"], bool) for d, r in zip(ids, rows)}
        else:
            toks = dict(zip(ids, ld.stream.read(ids)))
            masks = {d: np.ones(len(t), bool) for d, t in toks.items()}
        for b in mbs:
            for s in b.segments:
                d = torch.from_numpy(toks[s.doc][s.start:s.end]).long()
                out = run(mods, d.unsqueeze(0), torch.arange(s.end - s.start).unsqueeze(0),
                          torch.tensor([0, d.numel()], dtype=torch.int32))
                keep = torch.from_numpy(masks[s.doc][s.start + 1:s.end])
                loss = loss + torch.nn.functional.cross_entropy(out[0, :-1][keep], d[1:][keep], reduction="sum")
                counted += int(keep.sum())
    assert counted == total, (counted, total)
    (loss / total).backward()
    params = [p for m in mods for p in m.parameters()]
    return [p.grad.clone() for p in params], [p.detach().clone() for p in params], float(loss.detach() / total)


def first_step(ds, ga):
    """Each DP rank's micro-batches of step 0 (and the loader that read them)."""
    out = []
    for r in range(2):
        ld = loader(ds, r, ga, check_ranks=False)
        mbs = []
        for b in ld:
            if b.step > 0:
                break
            mbs.append(b)
        out.append((ld, mbs))
    return out


def _ranks(rank, world):
    import os

    os.environ["LOCAL_RANK"] = str(rank)  # what a launcher sets; DeepSpeed's engine asks for it
    import deepspeed

    from packloader_integrations import deepspeed as pds

    pds.disable_shm_comm_op()
    ga, lr = 2, 0.5
    ds = docs()
    results = {}
    ds_cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": ga,
              "optimizer": {"type": "SGD", "params": {"lr": lr}}}
    ref_grads, init, ref_loss = reference_grads(ds, first_step(ds, ga))

    # --- engine loop ---------------------------------------------------------------------------------------------
    model = torch.nn.Sequential(*layers())
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_cfg)

    def loss_sum(eng, b):
        logits = eng(( b["input_ids"], b["position_ids"], b["cu_seqlens"]))
        return torch.nn.functional.cross_entropy(logits[0], b["labels"][0], ignore_index=-100, reduction="sum")

    step = next(pds.steps(loader(ds, rank, ga)))
    local = pds.train_step(engine, step, loss_sum)
    after = [p.detach().clone() for p in model.parameters()]
    results["engine_max_err"] = max(float((a - (i - lr * g)).abs().max()) for a, i, g in zip(after, init, ref_grads))
    results["engine_local_loss"] = local
    results["ref_loss"] = ref_loss
    results["global_steps"] = engine.global_steps

    # --- pipeline engine (one stage, DP=2) ------------------------------------------------------------------------
    from deepspeed.pipe import PipelineModule

    pipe = PipelineModule(layers=layers(), num_stages=1, loss_fn=pds.pipeline_loss_fn, dynamic_shape=True)
    pengine, *_ = deepspeed.initialize(model=pipe, model_parameters=pipe.parameters(), config=ds_cfg)
    it = pds.PipelineBatches(loader(ds, rank, ga), gradient_accumulation_steps=ga)
    inputs, labels = next(pds.PipelineBatches(loader(ds, rank, ga), gradient_accumulation_steps=ga))
    results["pipe_types"] = [(tuple(t.shape), str(t.dtype)) for t in inputs + labels]
    ploss = pengine.train_batch(it)
    after = [p.detach().clone() for p in pipe.parameters()]
    results["pipe_max_err"] = max(float((a - (i - lr * g)).abs().max()) for a, i, g in zip(after, init, ref_grads))
    results["pipe_loss"] = float(ploss)

    # --- SFT masks: the engine loop and the pipeline engine train the step's masked targets only ----------------
    rows = sft_rows()
    sft_grads, sft_init, sft_loss = reference_grads(rows, first_step(rows, ga))
    model = torch.nn.Sequential(*layers())
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_cfg)
    step = next(pds.steps(loader(rows, rank, ga)))
    results["sft_masked"] = sum(int((b.labels == -100).sum()) - len(b.segments) for b in step)
    results["sft_local_loss"] = pds.train_step(engine, step, loss_sum)
    results["sft_ref_loss"] = sft_loss
    after = [p.detach().clone() for p in model.parameters()]
    results["sft_engine_max_err"] = max(float((a - (i - lr * g)).abs().max())
                                        for a, i, g in zip(after, sft_init, sft_grads))
    pipe = PipelineModule(layers=layers(), num_stages=1, loss_fn=pds.pipeline_loss_fn, dynamic_shape=True)
    pengine, *_ = deepspeed.initialize(model=pipe, model_parameters=pipe.parameters(), config=ds_cfg)
    pengine.train_batch(pds.PipelineBatches(loader(rows, rank, ga), gradient_accumulation_steps=ga))
    after = [p.detach().clone() for p in pipe.parameters()]
    results["sft_pipe_max_err"] = max(float((a - (i - lr * g)).abs().max())
                                      for a, i, g in zip(after, sft_init, sft_grads))

    # --- an empty micro-batch on rank 1, last in the step (DeepSpeed all-reduces in that backward) -------------
    # rank 1 runs its two micro-batches' segments as one, then an empty one: the same tokens, so the same update
    step = next(pds.steps(loader(ds, rank, ga)))
    if rank == 1:
        step = with_empty_last(step)
    results["empty_counts"] = [b.num_tokens == 0 for b in step]
    model = torch.nn.Sequential(*layers())
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_cfg)
    pds.train_step(engine, step, loss_sum)
    after = [p.detach().clone() for p in model.parameters()]
    results["engine_empty_max_err"] = max(float((a - (i - lr * g)).abs().max())
                                          for a, i, g in zip(after, init, ref_grads))
    pipe = PipelineModule(layers=layers(), num_stages=1, loss_fn=pds.pipeline_loss_fn, dynamic_shape=True)
    pengine, *_ = deepspeed.initialize(model=pipe, model_parameters=pipe.parameters(), config=ds_cfg)
    pengine.train_batch(pds.PipelineBatches(iter(step), gradient_accumulation_steps=ga))
    after = [p.detach().clone() for p in pipe.parameters()]
    results["pipe_empty_max_err"] = max(float((a - (i - lr * g)).abs().max())
                                        for a, i, g in zip(after, init, ref_grads))

    # --- Ulysses: DeepSpeed's adapter shards packloader rows like ulysses_batch ---------------------------------
    import torch.distributed as dist
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter

    mine = [b for _, b in zip(range(3), loader(ds, rank, ga))]
    theirs = [[b for _, b in zip(range(3), loader(ds, r, ga, check_ranks=False))] for r in range(world)]
    adapter = UlyssesSPDataLoaderAdapter([pds.ulysses_hf_batch(b, world) for b in mine], sp_rank=rank,
                                         sp_group=dist.group.WORLD, sp_world_size=world, device="cpu")
    agree = []
    for i in range(3):
        for src in range(world):  # the adapter serves rank src's batch i, sharded, in rank order
            got = next(adapter)
            want = pds.ulysses_batch(theirs[src][i], world, rank)
            agree.append(torch.equal(got["input_ids"], want["input_ids"])
                         and torch.equal(got["position_ids"], want["position_ids"])
                         and equal_inside(got["shift_labels"], want["labels"], theirs[src][i], world, rank))
    results["ulysses_agree"] = agree
    return results


def with_empty_last(step):
    """The step's micro-batches as two: all their segments in the first, the second empty (collated anew from the
    documents' tokens, so everything else about the step is the same)."""
    from packloader.collate.collate import collate_step

    segs = [s for b in step for s in b.segments]
    docs_ = {}
    for b in step:  # each segment's whole document, rebuilt from the batch (labels carry the next token)
        for s, lo, hi in zip(b.segments, b.cu_seqlens[:-1].tolist(), b.cu_seqlens[1:].tolist()):
            toks = docs_.setdefault(s.doc, {})
            toks.update(zip(range(s.start, s.end), b.input_ids[lo:hi].tolist()))
            lab = b.labels[hi - 1].item()
            if lab != -100:
                toks[s.end] = lab
    arrays = {d: np.array([t[i] for i in range(len(t))], np.int64) for d, t in docs_.items()}
    return list(collate_step([segs, []], arrays, step=step[0].step, loss_tokens_in_step=step[0].loss_tokens_in_step))


def equal_inside(shift_labels, labels, batch, world, rank):
    """DeepSpeed's shift_labels equal packloader's labels except at a piece's last token (target outside row)."""
    T = labels.shape[1]
    ends = set((batch.cu_seqlens[1:].long() - 1 - rank * T).tolist())
    keep = torch.tensor([t not in ends for t in range(T)])
    return torch.equal(shift_labels[0][keep], labels[0][keep])


@pytest.fixture(scope="module")
def results():
    return run_ranks(_ranks, 2, timeout=240)


@pytest.mark.multiprocess
def test_engine_loop_update_is_the_per_token_mean_gradient(results):
    for r in results:
        assert r["global_steps"] == 1
        assert r["engine_max_err"] < 1e-5
    assert sum(r["engine_local_loss"] for r in results) == pytest.approx(results[0]["ref_loss"], rel=1e-5)


@pytest.mark.multiprocess
def test_sft_masks_train_only_the_masked_targets(results):
    for r in results:
        assert r["sft_masked"] > 0  # prompts that do not train are in the step
        assert r["sft_engine_max_err"] < 1e-5
        assert r["sft_pipe_max_err"] < 1e-5
    assert sum(r["sft_local_loss"] for r in results) == pytest.approx(results[0]["sft_ref_loss"], rel=1e-5)


@pytest.mark.multiprocess
def test_pipeline_engine_takes_dynamic_shapes_and_normalises_per_token(results):
    for r in results:
        shapes = [s for s, _ in r["pipe_types"]]
        dtypes = [d for _, d in r["pipe_types"]]
        ids, pos, cu, lab, scale = shapes
        assert ids[0] == 1 and ids == pos == lab and len(cu) == 1 and scale == (1,)
        assert dtypes == ["torch.int64", "torch.int64", "torch.int32", "torch.int64", "torch.float32"]
        assert r["pipe_max_err"] < 1e-5
    # the engine reports the mean over micro-batches and DP ranks of (sum * GA * DP / N): the step's per-token mean
    assert results[0]["pipe_loss"] == pytest.approx(results[0]["ref_loss"], rel=1e-5)


@pytest.mark.multiprocess
def test_an_empty_last_micro_batch_keeps_ranks_in_step_and_adds_nothing(results):
    """Rank 1's step ends with an empty micro-batch: the engine loop and the pipeline engine run the placeholder
    row there (a real forward and backward, so the DP all-reduce of that micro-step happens on both ranks, no
    hang), and the update still equals the reference step's per-token mean gradient."""
    assert results[0]["empty_counts"] == [False, False] and results[1]["empty_counts"] == [False, True]
    for r in results:
        assert r["engine_empty_max_err"] < 1e-5
        assert r["pipe_empty_max_err"] < 1e-5


def test_placeholder_rows_of_an_empty_micro_batch():
    from packloader.collate.collate import collate
    from packloader_integrations import deepspeed as pds

    empty = collate([], {}, loss_tokens_in_step=7)
    d = pds.deepspeed_batch(empty, pad_id=5)
    assert d["input_ids"].tolist() == [[5]] and d["labels"].tolist() == [[-100]] and d["position_ids"].tolist() == [[0]]
    assert d["cu_seqlens"].tolist() == [0, 1] and d["max_seqlen"] == 1 and d["loss_tokens_in_step"] == 7
    (ids, pos, cu), (lab, scale) = next(pds.PipelineBatches(iter([empty]), gradient_accumulation_steps=1,
                                                            dp_world_size=1))
    assert ids.shape == lab.shape == (1, 1) and lab.tolist() == [[-100]] and cu.tolist() == [0, 1]
    for sp in (1, 2, 3):
        shards = [pds.ulysses_batch(empty, sp, r) for r in range(sp)]
        assert all(s["input_ids"].shape == (1, 1) and s["labels"].tolist() == [[-100]] for s in shards)
        assert shards[0]["cu_seqlens"].tolist() == [0, sp]
        assert pds.ulysses_hf_batch(empty, sp)["labels"].tolist() == [[-100] * sp]


@pytest.mark.multiprocess
def test_ulysses_adapter_shards_like_ulysses_batch(results):
    for r in results:
        assert r["ulysses_agree"] and all(r["ulysses_agree"])


def test_ulysses_batch_pads_to_sp_and_resets_positions():
    from packloader.collate.collate import collate
    from packloader.contracts import Segment
    from packloader_integrations import deepspeed as pds

    toks = {0: np.arange(7, dtype=np.int32), 1: np.arange(100, 110, dtype=np.int32)}
    b = collate([Segment(0, 0, 7, 0), Segment(1, 0, 6, 0)], toks)  # 13 tokens
    shards = [pds.ulysses_batch(b, 4, r) for r in range(4)]
    assert [s["input_ids"].shape[1] for s in shards] == [4] * 4 and shards[0]["padding"] == 3
    assert shards[0]["cu_seqlens"].tolist() == [0, 7, 13, 16] and shards[0]["max_seqlen"] == 7
    pos = torch.cat([s["position_ids"][0] for s in shards]).tolist()
    assert pos == list(range(7)) + list(range(6)) + [0, 1, 2]
    lab = torch.cat([s["labels"][0] for s in shards]).tolist()
    # document 0 ends (-100); document 1's piece 0..6 still predicts its 7th token (106); padding -100
    assert lab == [1, 2, 3, 4, 5, 6, -100, 101, 102, 103, 104, 105, 106, -100, -100, -100]
