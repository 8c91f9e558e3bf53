"""Sliced plans in the adapters. PackedTrainer runs a SlimPack plan (documents cut into slices over micro-batches)
through SliceExecutor with a real transformers Llama (float64, CPU): the step's loss and every parameter gradient
equal those of the same documents run whole, one at a time; so do Megatron-core's GPTModel at PP 1
(sliced_forward_backward) and split into 2 pipeline stages over gloo (sliced_pipeline_forward_backward), with
learned absolute positions and with RoPE (each slice turned to its document positions). Settings
the Megatron pipeline path cannot honour, and DeepSpeed, refuse with the setting to change."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.hf_trainer import first_grads_callback, one_step_args
from helpers.megatron_slices import LENGTHS, VOCAB, _dense_core_attention_cls, _megatron_rope_on_cpu, corpus

transformers = pytest.importorskip("transformers")

from packloader.contracts import PlanConfig  # noqa: E402
from packloader.loader.loader import PackedLoader  # noqa: E402
from packloader.sources.base import IterableSource  # noqa: E402
from packloader_integrations import hf as phf  # noqa: E402

MB = 7  # micro-batches per step: what slimpack picks for these documents at 64 tokens per micro-batch


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
    trainer = phf.PackedTrainer(model=model, args=one_step_args(tmp_path, MB),
                                packed_loader=sliced_loader(docs, epochs=None),
                                callbacks=[first_grads_callback(model, grads)])
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


# ------------------------------------------------------------------------------------------- HF under DDP


MB2 = 4  # micro-batches per step and DP rank


def _dp2_loader(ds, dp_rank, epochs):
    from packloader.contracts import ParallelConfig

    # the analytic model's plan: one rank's step holds slices and the other's does not (the case under test)
    cfg = PlanConfig(strategy="slimpack", max_tokens=64, context=256, tokens_per_step=400, num_micro_batches=MB2,
                     parallel=ParallelConfig(dp=2), cost="analytic")
    return PackedLoader(IterableSource(ds), config=cfg, num_threads=0, append_eos=False, dp_rank=dp_rank,
                        epochs=epochs)


def _rank_ddp_trainer(rank, world, out_dir):
    from packloader_integrations import hf as phf

    docs = corpus()
    segs = [(s.doc, s.start, s.end, s.attend_from) for b in _dp2_loader(docs, rank, 1) if b.step == 0 for s in b.segments]
    model = tiny_llama(phf.register_packloader_attention())
    grads = {}
    tr = phf.PackedTrainer(model=model, args=one_step_args(out_dir, MB2, ddp_backend="gloo"),
                           packed_loader=_dp2_loader(docs, rank, None), callbacks=[first_grads_callback(model, grads)])
    tr.train()
    return segs, {n: g.numpy() for n, g in grads.items()}


@pytest.mark.multiprocess
def test_packed_trainer_runs_a_sliced_plan_under_ddp(tmp_path):
    """2 DP ranks (gloo, DDP): one rank's step holds the slices, the other's does not, so both take the
    SliceExecutor path (a collective flag) and the gradients are averaged once; each rank's gradient equals the
    per-token mean gradient of all the documents run whole."""
    pytest.importorskip("accelerate")
    from helpers.distributed import run_ranks

    docs = corpus()
    ref = tiny_llama("eager")
    ref.train()
    _, ref_grads = whole_document_reference(ref, docs)
    res = run_ranks(_rank_ddp_trainer, 2, str(tmp_path))
    allsegs = res[0][0] + res[1][0]
    assert [any(a < s for _, s, _, a in r[0]) for r in res].count(True) == 1  # one rank's step holds the slices
    assert sum(e - s for _, s, e, _ in allsegs) == sum(LENGTHS)
    for _, grads in res:
        for n, g in ref_grads.items():
            torch.testing.assert_close(torch.from_numpy(grads[n]), g, rtol=1e-5, atol=1e-8, msg=n)


# ------------------------------------------------------------------------------------------------ Megatron


# RoPE settings the slices are checked under: Megatron's defaults, and interleaved pairs over half the head dims
ROPE = {"rope": ({}, {}),
        "rope-interleaved-half": ({"rotary_interleaved": True}, {"rotary_percent": 0.5, "rotary_base": 500})}


def _rank_megatron_sliced(rank, world, *positions):
    """One process, one result per position embedding (each a fresh model and reference)."""
    from megatron.core import parallel_state as ps

    _megatron_rope_on_cpu()
    ps.initialize_model_parallel(1, 1)
    return [_megatron_sliced_run(pos) for pos in positions]


def _megatron_sliced_run(pos):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.transformer_config import TransformerConfig

    from packloader_integrations import megatron as pm

    cfg_kw, model_kw = ROPE.get(pos, ({}, {}))
    cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                            ffn_hidden_size=64, use_cpu_initialization=True, calculate_per_token_loss=True,
                            hidden_dropout=0.0, attention_dropout=0.0, **cfg_kw)

    def gpt(core):
        spec = get_gpt_layer_local_spec()
        spec.submodules.self_attention.submodules.core_attention = core
        torch.manual_seed(0)
        # learned_absolute reads position_ids; RoPE (Megatron's THD path: each packed segment from position 0) is
        # turned to the slices' document positions by PackloaderCoreAttention
        return GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=512,
                        position_embedding_type="rope" if pos in ROPE else pos, **model_kw).double()

    model, ref = gpt(pm.PackloaderCoreAttention), gpt(_dense_core_attention_cls())
    ref.load_state_dict(model.state_dict())
    docs = corpus()

    # reference: every document whole, on its own; the summed token loss and its gradients
    ref_loss = 0.0
    for d in docs:
        x = torch.from_numpy(d).long().unsqueeze(0)
        n = x.shape[1]
        cu = torch.tensor([0, n], dtype=torch.int32)
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=n, max_seqlen_kv=n)
        labels = torch.cat([x[:, 1:], torch.zeros(1, 1, dtype=torch.long)], 1)
        per_tok = ref(x, torch.arange(n).unsqueeze(0), None, labels=labels, packed_seq_params=params)
        loss = per_tok[0, :-1].sum()
        loss.backward()
        ref_loss += float(loss.detach())
    ref_grads = {k: p.grad.clone() for k, p in ref.named_parameters()}

    it = pm.MegatronDataIterator(sliced_loader(docs, epochs=1), num_microbatches=MB, slices=True)
    store = pm.sliced_forward_backward(forward_step_func=pm.forward_step, data_iterator=it, model=model,
                                       num_microbatches=MB, seq_length=0, micro_batch_size=1)
    got_loss = sum(float(r["lm loss"][0]) for r in store)
    got_tokens = sum(int(r["lm loss"][1]) for r in store)
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    sliced = any(s.attend_from < s.start for b in sliced_loader(docs, epochs=1) for s in b.segments)
    return ref_loss, got_loss, got_tokens, {k: g.numpy() for k, g in ref_grads.items()}, \
        {k: g.numpy() for k, g in grads.items()}, sliced


@pytest.mark.multiprocess
@pytest.mark.parametrize("positions", [("learned_absolute",), tuple(ROPE)], ids=["learned_absolute", "rope"])
def test_megatron_sliced_forward_backward_equals_whole_documents(positions):
    """Megatron-core's GPTModel (local layer spec, CPU, float64) on a sliced slimpack step through
    sliced_forward_backward, megatron's forward_step_calc_loss included: summed loss, token count and every
    parameter gradient equal the same model run on each whole document with dense causal attention. With RoPE
    the reference is Megatron's own THD RoPE over each whole document (positions 0..n-1), so a slice left at
    Megatron's segment-local positions would show: without the correction the worst gradient is off by 8e-3 of its
    largest entry (the loss only by 3e-7, inside its float32 tolerance), with it by under 1e-9."""
    pytest.importorskip("megatron.core")
    from helpers.distributed import run_ranks

    for pos, (ref_loss, loss, tokens, ref_grads, grads, sliced) in zip(
            positions, run_ranks(_rank_megatron_sliced, 1, *positions)[0]):
        assert sliced
        assert tokens == sum(n - 1 for n in LENGTHS)
        # the model runs in float64, the adapter's loss_func sums in float32 (as Megatron's pretrain_gpt does); RoPE's
        # cos/sin come from Megatron's float32 angle table (the slices' extra turn from float64 differences of it)
        assert loss == pytest.approx(ref_loss, rel=1e-6), pos
        assert set(grads) == set(ref_grads)
        for k, g in ref_grads.items():
            torch.testing.assert_close(torch.from_numpy(grads[k]), torch.from_numpy(g), rtol=1e-5, atol=1e-8,
                                       msg=f"{pos}: {k}")


def _rank_megatron_rope_refusals(rank, world):
    """What the sliced schedules answer for rotary settings they cannot correct, before reading any batch."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_config import TransformerConfig

    from packloader.runtime.slice_check import SlicesNotSupported
    from packloader_integrations import megatron as pm

    _megatron_rope_on_cpu()
    ps.initialize_model_parallel(1, 1)

    class Untouched:
        def __next__(self):
            raise AssertionError("the batches were read before the refusal")

    def cfg(**kw):
        return TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                                 ffn_hidden_size=64, use_cpu_initialization=True, calculate_per_token_loss=True,
                                 hidden_dropout=0.0, attention_dropout=0.0, **kw)

    out = []
    for pos, kw, core in (("mrope", dict(mrope_section=[2, 1, 1]), pm.PackloaderCoreAttention),
                          ("rope", dict(no_rope_freq=2), pm.PackloaderCoreAttention),
                          ("rope", {}, _dense_core_attention_cls())):
        model = _gpt(cfg(**kw), core, pos)
        for run in (pm.sliced_forward_backward, pm.sliced_pipeline_forward_backward):
            try:
                run(forward_step_func=pm.forward_step, data_iterator=Untouched(), model=model, num_microbatches=MB,
                    seq_length=0, micro_batch_size=1)
                out.append(None)
            except ValueError as e:
                out.append((isinstance(e, SlicesNotSupported), str(e)))
    return out


@pytest.mark.multiprocess
def test_megatron_sliced_schedules_refuse_rotary_settings_they_cannot_correct():
    """Multimodal RoPE and layers without RoPE are refused by both sliced schedules as SlicesNotSupported naming the
    setting, before any batch is read; RoPE without PackloaderCoreAttention (nowhere to correct) too."""
    import re

    pytest.importorskip("megatron.core")
    from helpers.distributed import run_ranks

    got = run_ranks(_rank_megatron_rope_refusals, 1)[0]
    assert None not in got
    expected = [(True, r"position_embedding_type='mrope'.*PlanConfig\(allow_slicing=False\)")] * 2 + \
        [(True, r"no_rope_freq=\[0, 1\].*PlanConfig\(allow_slicing=False\)")] * 2 + \
        [(False, r"core_attention.*PackloaderCoreAttention.*PlanConfig\(allow_slicing=False\)")] * 2
    for (is_slices, msg), (want, pattern) in zip(got, expected):
        assert is_slices == want, msg
        assert re.search(pattern, msg), msg


def test_megatron_iterator_refuses_slices_without_the_sliced_schedules():
    pytest.importorskip("megatron.core")
    from packloader_integrations import megatron as pm

    it = pm.MegatronDataIterator(sliced_loader(corpus(), epochs=1), slices=True, pipeline_parallel_size=2)
    assert sum(any(s.attend_from < s.start for s in next(it)["segments"]) for _ in range(MB)) > 0  # passed on
    it = pm.MegatronDataIterator(sliced_loader(corpus(), epochs=1), pipeline_parallel_size=2)
    with pytest.raises(ValueError, match=r"pipeline_model_parallel_size=2.*step 0, micro-batch \d: document \d+.*"
                                         r"slices=True.*sliced_pipeline_forward_backward.*allow_slicing=False"):
        for _ in range(MB):
            next(it)
    it = pm.MegatronDataIterator(sliced_loader(corpus(), epochs=1))
    with pytest.raises(ValueError, match=r"slices=True.*sliced_forward_backward.*allow_slicing=False"):
        for _ in range(MB):
            next(it)


# ------------------------------------------------------------------------------------------------ DeepSpeed


def test_deepspeed_refuses_sliced_batches_naming_the_setting_and_the_alternative():
    """DeepSpeed's engine loop, pipeline engine and Ulysses run each micro-batch on its own: a sliced batch is
    refused with the step, micro-batch and document, PlanConfig(allow_slicing=False) and the trainers that do run
    slices."""
    from packloader.runtime.slices import SlicesNotSupported
    from packloader_integrations import deepspeed as pds

    step0 = first_step(sliced_loader(corpus(), epochs=1))
    b = next(b for b in step0 if any(s.attend_from < s.start for s in b.segments))
    doc = next(s.doc for s in b.segments if s.attend_from < s.start)
    expected = (rf"step 0, micro-batch {b.index_in_step} holds a slice of document {doc} .*"
                r"PlanConfig\(allow_slicing=False\).*PackedTrainer.*sliced_forward_backward")
    for call in (lambda: pds.deepspeed_batch(b), lambda: pds.ulysses_batch(b, 2, 0),
                 lambda: pds.ulysses_hf_batch(b, 2),
                 lambda: next(pds.PipelineBatches(iter([b]), gradient_accumulation_steps=b.micro_batches_in_step,
                                                  dp_world_size=1))):
        with pytest.raises(SlicesNotSupported, match=expected):
            call()


def test_refusals_point_to_the_pipeline_schedule_where_it_is_installed(monkeypatch):
    import importlib.util

    pytest.importorskip("megatron.core")
    from packloader_integrations import deepspeed as pds
    from packloader_integrations import megatron as pm

    real = importlib.util.find_spec
    for present in (False, True):
        monkeypatch.setattr(importlib.util, "find_spec",
                            lambda name, *a: (object() if present else None) if name == "packloader.runtime.pipeline"
                            else real(name, *a))
        b = next(b for b in first_step(sliced_loader(corpus(), epochs=1)) if any(s.attend_from < s.start for s in b.segments))
        for call in (lambda: pds.deepspeed_batch(b),
                     lambda: next(pm.MegatronDataIterator(iter([b]), pipeline_parallel_size=2))):
            with pytest.raises(ValueError) as e:
                call()
            assert ("packloader.runtime.pipeline.PlanPipelineSchedule" in str(e.value)) == present, str(e.value)


# ----------------------------------------------------------------------------------------- Megatron PP > 1


def _pp2_loader(ds, epochs, schedule="1f1b"):
    from packloader.contracts import ParallelConfig

    cfg = PlanConfig(strategy="slimpack", max_tokens=64, context=256, tokens_per_step=400, num_micro_batches=MB,
                     parallel=ParallelConfig(pp=2), schedule=schedule)
    return PackedLoader(IterableSource(ds), config=cfg, num_threads=0, append_eos=False, epochs=epochs)


def _written_lists(plan, schedule):
    """DP rank 0's action lists of the step as `packloader plan` writes them (through JSON and back)."""
    import msgspec

    from packloader.balancers.cost.model import CostModel
    from packloader.balancers.sim.actions import step_actions
    from packloader.contracts import CostProfile, ParallelConfig, Poly

    # the lists' order follows the schedule's rule, not the costs: any cost model writes the same lists
    linear = CostModel(CostProfile(name="linear", tile=1, attn_fwd=Poly(), attn_bwd=Poly(), lin_fwd=Poly(0, 1.0, 0),
                                   lin_bwd=Poly(0, 2.0, 0)))
    acts = step_actions(plan, linear, ParallelConfig(pp=2), schedule=schedule)
    return msgspec.json.decode(msgspec.json.encode(acts))[0]


def _megatron_config(pp, tp=1):
    from megatron.core.transformer.transformer_config import TransformerConfig

    extra = dict(pipeline_model_parallel_size=pp, pipeline_dtype=torch.float64) if pp > 1 else {}
    if tp > 1:
        extra["tensor_model_parallel_size"] = tp
    return TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                             ffn_hidden_size=64, use_cpu_initialization=True, calculate_per_token_loss=True,
                             hidden_dropout=0.0, attention_dropout=0.0, **extra)


def _gpt(cfg, core, pos="learned_absolute", vocab=VOCAB, **kw):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec()
    spec.submodules.self_attention.submodules.core_attention = core
    torch.manual_seed(0)
    return GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=vocab, max_sequence_length=512,
                    position_embedding_type=pos, **kw).double()


def _reversed_backward(plan):
    """The step plan with DP rank 0's backward order reversed (valid: a sliced document's last slice still goes
    first), not the simulator's default, so that running the default order instead would show."""
    import msgspec

    rp = plan.ranks[0]
    return msgspec.structs.replace(plan, ranks=[msgspec.structs.replace(
        rp, backward_order=list(range(len(rp.micro_batches)))[::-1])] + list(plan.ranks[1:]))


def _rank_megatron_pipeline(rank, world, pos="learned_absolute", steps=2, tp=1, schedule="1f1b", written=False):
    """Rank `rank` of a Megatron GPTModel in world / tp pipeline stages of `tp` tensor-parallel ranks each (gloo,
    CPU, float64) running `steps` sliced steps through sliced_pipeline_forward_backward; rank 0 also runs the
    unsplit model over whole documents (the reference). `pos`: the model's position_embedding_type. At TP > 1
    the result names the dimension each split tensor is cut along (`split`) and this rank's TP index. `schedule`:
    the loader's PlanConfig.schedule; `written`: record each step's action lists as `packloader plan` writes them
    (through JSON; `written`) beside what ran (`executed`), and pass them to the second step."""
    from megatron.core import parallel_state as ps
    from megatron.core.packed_seq_params import PackedSeqParams

    from packloader_integrations import megatron as pm

    torch.set_num_threads(1)
    _megatron_rope_on_cpu()
    vocab = -(-VOCAB // tp) * tp  # Megatron splits the vocabulary evenly over the TP ranks
    ps.initialize_model_parallel(1, 1)
    full = _gpt(_megatron_config(1), _dense_core_attention_cls(), pos, vocab=vocab)
    state = {k: v.clone() if torch.is_tensor(v) else v for k, v in full.state_dict().items()}
    docs = corpus()
    ref = None
    if rank == 0:  # every document whole, on its own, through the unsplit model: summed token loss and gradients
        ref_loss = 0.0
        for d in docs:
            x = torch.from_numpy(d).long().unsqueeze(0)
            n = x.shape[1]
            cu = torch.tensor([0, n], dtype=torch.int32)
            params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=n,
                                     max_seqlen_kv=n)
            labels = torch.cat([x[:, 1:], torch.zeros(1, 1, dtype=torch.long)], 1)
            loss = full(x, torch.arange(n).unsqueeze(0), None, labels=labels, packed_seq_params=params)[0, :-1].sum()
            loss.backward()
            ref_loss += float(loss.detach())
        ref = ref_loss, {k: p.grad.numpy().copy() for k, p in full.named_parameters()}
    ps.destroy_model_parallel()

    pp = world // tp
    ps.initialize_model_parallel(tp, pp)
    pp_rank, tp_rank = ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()
    stage = _gpt(_megatron_config(pp, tp), pm.PackloaderCoreAttention, pos, pre_process=pp_rank == 0,
                 post_process=pp_rank == pp - 1, vocab=vocab)
    # the stage's layers are the full model's layers at their global numbers
    names = {}
    for k in stage.state_dict():
        if k.startswith("decoder.layers."):
            i, rest = k[len("decoder.layers."):].split(".", 1)
            names[k] = f"decoder.layers.{stage.decoder.layers[int(i)].layer_number - 1}.{rest}"
        else:
            names[k] = k
    # at TP > 1 a split tensor is this rank's contiguous chunk of the full one, along the dimension that differs
    # (Megatron's fused QKV rows are grouped by query group, so a chunk holds whole groups)
    split = {}
    for k, v in stage.state_dict().items():
        if torch.is_tensor(v) and v.shape != state[names[k]].shape:
            split[names[k]] = next(d for d, (a, b) in enumerate(zip(v.shape, state[names[k]].shape)) if a != b)
    stage.load_state_dict({k: state[n].chunk(tp, split[n])[tp_rank] if n in split else state[n]
                           for k, n in names.items()})
    # two epochs of one step each: the second step reuses the stage and schedule (buffers re-sized, a new plan)
    it = pm.MegatronDataIterator(_pp2_loader(docs, 2, schedule), num_microbatches=MB, slices=True)
    it = (dict(b, step_plan=_reversed_backward(b["step_plan"])) for b in it)
    out = dict(ref=ref, orders=[], kv_left=[], losses=[], tokens=[], written=[], executed=[])
    for step in range(steps):
        batches = [next(it) for _ in range(MB)]
        lists = _written_lists(batches[0]["step_plan"], schedule) if written else None
        store = pm.sliced_pipeline_forward_backward(forward_step_func=pm.forward_step, data_iterator=iter(batches),
                                                    model=[stage], num_microbatches=MB, seq_length=0,
                                                    micro_batch_size=1, actions=lists if step % 2 else None)
        sched = pm.pipeline_schedule_of(stage)
        out["written"].append(lists[pp_rank] if written else None)
        out["executed"].append([list(a) for a in sched.executed])
        out["orders"].append(list(sched.order))
        out["kv_left"].append(len(sched._stages[0].cache))
        out["losses"].append(sum(float(r["lm loss"][0]) for r in store))
        out["tokens"].append(sum(int(r["lm loss"][1]) for r in store))
    out["grads"] = {names[k]: p.grad.numpy().copy() / steps for k, p in stage.named_parameters() if p.grad is not None}
    out["split"], out["tp_rank"] = split, tp_rank
    return out


@pytest.mark.multiprocess
def test_megatron_pipeline_runs_a_sliced_plan_like_whole_documents():
    """A real Megatron-core GPTModel split into 2 pipeline stages (pre_process / post_process, one layer each, gloo,
    float64) runs a sliced slimpack step through sliced_pipeline_forward_backward: the summed loss, its token count
    and every parameter gradient equal the unsplit model's over the same documents run whole with dense causal
    attention (rtol 1e-5 / 1e-6 for the loss: Megatron's loss_func sums in float32), on each of two steps (the second
    reusing the stage and schedule); each stage executes the order the simulator scores for the plan's backward
    order (here reversed, not the default), and frees its carried KV."""
    pytest.importorskip("megatron.core")
    from helpers.distributed import run_ranks

    from packloader.balancers.sim.simulator import default_backward_order, simulate_rank, slice_edges_of
    from packloader.contracts import ParallelConfig

    batches = list(_pp2_loader(corpus(), 2))
    plans = []
    for step in (0, 1):  # each epoch is one step holding every document, sliced
        mbs = [b for b in batches if b.step == step]
        assert len(mbs) == MB and sum(b.num_tokens for b in mbs) == sum(LENGTHS)
        assert any(s.attend_from < s.start for b in mbs for s in b.segments)
        rank_plan = _reversed_backward(mbs[0].plan).ranks[0]
        edges, _ = slice_edges_of(rank_plan.micro_batches)
        assert list(rank_plan.backward_order) != default_backward_order(MB, edges).tolist()
        plans.append(rank_plan)

    res = run_ranks(_rank_megatron_pipeline, 2)
    ref_loss, ref_grads = res[0]["ref"]
    for step, rank_plan in enumerate(plans):
        sim = simulate_rank(rank_plan, None, ParallelConfig(pp=2), schedule="1f1b", use_plan_costs=True)
        for r in range(2):
            assert res[r]["orders"][step] == sim.order(r), (step, r)
            assert res[r]["kv_left"][step] == 0
        assert res[1]["tokens"][step] == sum(n - 1 for n in LENGTHS)
        assert res[1]["losses"][step] == pytest.approx(ref_loss, rel=1e-6)
    got = {**res[0]["grads"], **res[1]["grads"]}  # two steps accumulated, halved
    assert set(res[0]["grads"]).isdisjoint(res[1]["grads"])
    assert set(got) == set(ref_grads)
    for k, g in ref_grads.items():
        torch.testing.assert_close(torch.from_numpy(got[k]), torch.from_numpy(g), rtol=1e-5, atol=1e-8, msg=k)


@pytest.mark.multiprocess
def test_megatron_pipeline_runs_zb_h1_written_lists_like_1f1b_and_whole_documents():
    """PlanConfig(schedule="zb-h1") at PP 2 through sliced_pipeline_forward_backward: the first step runs the
    schedule the iterator passes from the loader's config, the second the action lists `packloader plan` writes
    (JSON, this DP rank's); each stage executes exactly the written ZB-H1 lists (split "B"/"W", which 1F1B would
    not run), frees its carried KV, and the loss and every gradient equal the whole-document reference (as the
    1F1B test above, same tolerances)."""
    pytest.importorskip("megatron.core")
    from helpers.distributed import run_ranks

    res = run_ranks(_rank_megatron_pipeline, 2, "learned_absolute", 2, 1, "zb-h1", True)
    ref_loss, ref_grads = res[0]["ref"]
    for step in (0, 1):
        for r in range(2):
            lists = res[r]["written"][step]
            assert any(a[0] == "W" for a in lists), (step, r)
            assert res[r]["executed"][step] == lists, (step, r)
            assert res[r]["kv_left"][step] == 0
        assert res[1]["tokens"][step] == sum(n - 1 for n in LENGTHS)
        assert res[1]["losses"][step] == pytest.approx(ref_loss, rel=1e-6)
    got = {**res[0]["grads"], **res[1]["grads"]}
    assert set(got) == set(ref_grads)
    for k, g in ref_grads.items():
        torch.testing.assert_close(torch.from_numpy(got[k]), torch.from_numpy(g), rtol=1e-5, atol=1e-8, msg=k)


def test_megatron_pipeline_schedule_is_the_plans_hand_worked():
    """The schedule sliced_pipeline_forward_backward runs: the planner's choice for the step (StepPlan.schedule,
    set under "auto"), else the configured one, else 1F1B (also for "auto" with no choice recorded)."""
    pytest.importorskip("megatron.core")
    from packloader.contracts import StepPlan
    from packloader_integrations.megatron.pipeline import step_schedule

    chose = StepPlan(step=0, ranks=[], schedule="zb-h1")
    none = StepPlan(step=0, ranks=[])
    assert step_schedule(chose, "auto") == "zb-h1"
    assert step_schedule(none, "zb-h1") == "zb-h1"
    assert step_schedule(none, "auto") == step_schedule(none, None) == step_schedule(None, None) == "1f1b"
    assert step_schedule(none, "gpipe") == "gpipe"
    assert step_schedule(none, "auto", 2) == step_schedule(none, None, 2) == "interleaved"  # vpp 2: auto's default
    assert step_schedule(StepPlan(step=0, ranks=[], schedule="zb-v"), "auto", 2) == "zb-v"


@pytest.mark.multiprocess
def test_megatron_pipeline_runs_a_sliced_plan_with_rope_like_whole_documents():
    """The same 2-stage split with position_embedding_type="rope", one step: each stage's PackloaderCoreAttention
    turns the slices' queries and keys to their document positions, so the loss and every gradient equal the
    unsplit model's over whole documents through Megatron's own THD RoPE (positions 0..n-1)."""
    pytest.importorskip("megatron.core")
    from helpers.distributed import run_ranks

    res = run_ranks(_rank_megatron_pipeline, 2, "rope", 1)
    ref_loss, ref_grads = res[0]["ref"]
    assert res[1]["tokens"][0] == sum(n - 1 for n in LENGTHS)
    assert res[1]["losses"][0] == pytest.approx(ref_loss, rel=1e-6)
    assert res[0]["kv_left"][0] == res[1]["kv_left"][0] == 0
    got = {**res[0]["grads"], **res[1]["grads"]}
    assert set(got) == set(ref_grads)
    for k, g in ref_grads.items():
        torch.testing.assert_close(torch.from_numpy(got[k]), torch.from_numpy(g), rtol=1e-5, atol=1e-8, msg=k)


@pytest.mark.multiprocess
def test_megatron_pipeline_with_tensor_parallelism_runs_a_sliced_plan_like_whole_documents():
    """TP 2 x PP 2 (four ranks, Megatron's own rank layout) with RoPE: each rank runs its quarter of the model
    (attention heads, MLP and vocabulary split over the TP pair) through sliced_pipeline_forward_backward, and
    every gradient shard equals the same shard of the unsplit model's gradient over whole documents (rtol 1e-5,
    atol 1e-6 of the tensor's largest entry: Megatron's loss is float32); both TP ranks of the last stage see the
    reference loss, and each stage runs the simulator's order."""
    pytest.importorskip("megatron.core")
    from helpers.distributed import run_ranks

    from packloader.balancers.sim.simulator import simulate_rank
    from packloader.contracts import ParallelConfig

    rank_plan = _reversed_backward(next(iter(_pp2_loader(corpus(), 1))).plan).ranks[0]
    sim = simulate_rank(rank_plan, None, ParallelConfig(pp=2), schedule="1f1b", use_plan_costs=True)
    res = run_ranks(_rank_megatron_pipeline, 4, "rope", 1, 2, timeout=300)
    ref_loss, ref_grads = res[0]["ref"]
    assert "decoder.layers.0.self_attention.linear_qkv.weight" in res[0]["split"]
    assert "output_layer.weight" in res[2]["split"]
    for first, last in ((0, 2), (1, 3)):  # each TP index: its two stages hold every parameter once
        assert set(res[first]["grads"]) | set(res[last]["grads"]) == set(ref_grads)
    for r in range(4):
        assert res[r]["orders"][0] == sim.order(r // 2), r
        assert res[r]["kv_left"][0] == 0
        split, tp_rank = res[r]["split"], res[r]["tp_rank"]
        for k, got in res[r]["grads"].items():  # float32 loss terms: 3e-8 of a tensor's largest entry measured
            g = np.array_split(ref_grads[k], 2, axis=split[k])[tp_rank] if k in split else ref_grads[k]
            torch.testing.assert_close(torch.from_numpy(got), torch.from_numpy(g), rtol=1e-5,
                                       atol=1e-6 * float(np.abs(g).max()), msg=f"rank {r}: {k}")
    for r in (2, 3):
        assert res[r]["tokens"][0] == sum(n - 1 for n in LENGTHS)
        assert res[r]["losses"][0] == pytest.approx(ref_loss, rel=1e-6)


def test_megatron_pipeline_refuses_settings_it_cannot_honour():
    pytest.importorskip("megatron.core")
    from megatron.core.model_parallel_config import ModelParallelConfig

    from packloader_integrations import megatron as pm

    vpp = ModelParallelConfig(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2,
                              pipeline_dtype=torch.float32)
    with pytest.raises(ValueError, match=r"1 model chunk\(s\) with virtual_pipeline_model_parallel_size=2"):
        pm.check_sliced_pipeline_config(vpp)
    pm.check_sliced_pipeline_config(vpp, num_model_chunks=2)  # runs: tests/test_megatron_vpp.py
    with pytest.raises(ValueError, match=r"2 model chunk\(s\) with virtual_pipeline_model_parallel_size=None"):
        pm.check_sliced_pipeline_config(ModelParallelConfig(), num_model_chunks=2)
    sp = ModelParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True)
    with pytest.raises(ValueError, match=r"sequence_parallel=True.*sequence_parallel=False"):
        pm.check_sliced_pipeline_config(sp)
    with pytest.raises(ValueError, match=r"context_parallel_size=2"):
        pm.check_sliced_pipeline_config(ModelParallelConfig(context_parallel_size=2))
    cfg = _megatron_config(1)
    cfg.calculate_per_token_loss = False
    with pytest.raises(ValueError, match=r"calculate_per_token_loss=True"):
        pm.check_sliced_pipeline_config(cfg)
    pm.check_sliced_pipeline_config(_megatron_config(1))
