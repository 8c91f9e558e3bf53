"""Megatron at PP 2 with virtual pipeline stages (vpp 2): a real megatron-core GPTModel of four layers, one per
model stage, built as two model chunks per pipeline rank (Megatron's interleaved placement, or ZB-V's V from
`v_shape_model_chunks`), runs sliced slimpack steps through sliced_pipeline_forward_backward over gloo. Each
rank executes exactly the action lists `packloader plan` writes (W actions included under ZB-V), and the loss and
every parameter gradient equal the unsplit model's over the same documents run whole with dense causal attention;
chunks of the other placement are refused."""

from __future__ import annotations

import pytest
import torch
from helpers.megatron_slices import LENGTHS, VOCAB, _dense_core_attention_cls, _megatron_rope_on_cpu, corpus

from packloader.contracts import ParallelConfig, PlanConfig
from packloader.loader.loader import PackedLoader
from packloader.sources.base import IterableSource

MB = 8  # micro-batches per step: interleaved 1F1B needs a multiple of pp
LAYERS = 4  # pp 2 x vpp 2 model stages, one decoder layer each


def _vpp_loader(schedule, epochs=2):
    cfg = PlanConfig(strategy="slimpack", max_tokens=64, context=256, tokens_per_step=400, num_micro_batches=MB,
                     parallel=ParallelConfig(pp=2, vpp=2), schedule=schedule)
    return PackedLoader(IterableSource(corpus()), config=cfg, num_threads=0, append_eos=False, epochs=epochs)


def _written(plan, schedule):
    """DP rank 0's action lists of the step as `packloader plan` writes them (through JSON and back)."""
    import msgspec

    from packloader.balancers.cost.model import CostModel
    from packloader.balancers.sim.actions import step_actions
    from packloader.contracts import CostProfile, Poly

    linear = CostModel(CostProfile(name="linear", tile=1, attn_fwd=Poly(), attn_bwd=Poly(), lin_fwd=Poly(0, 1.0, 0),
                                   lin_bwd=Poly(0, 2.0, 0)))
    acts = step_actions(plan, linear, ParallelConfig(pp=2, vpp=2), schedule=schedule)
    return msgspec.json.decode(msgspec.json.encode(acts))[0]


def _config(pp, vpp):
    from megatron.core.transformer.transformer_config import TransformerConfig

    extra = dict(pipeline_model_parallel_size=pp, pipeline_dtype=torch.float64,
                 virtual_pipeline_model_parallel_size=vpp) if pp > 1 else {}
    return TransformerConfig(num_layers=LAYERS, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                             ffn_hidden_size=64, use_cpu_initialization=True, calculate_per_token_loss=True,
                             hidden_dropout=0.0, attention_dropout=0.0, **extra)


def _provider(cfg, core):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    def build(pre_process=True, post_process=True, vp_stage=None):
        spec = get_gpt_layer_local_spec()
        spec.submodules.self_attention.submodules.core_attention = core
        torch.manual_seed(0)
        return GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=512,
                        pre_process=pre_process, post_process=post_process, vp_stage=vp_stage).double()

    return build


def _reference(full):
    """Every document whole, on its own, through the unsplit model: summed token loss and gradients."""
    from megatron.core.packed_seq_params import PackedSeqParams

    total = 0.0
    for d in corpus():
        x = torch.from_numpy(d).long().unsqueeze(0)
        n = x.shape[1]
        cu = torch.tensor([0, n], dtype=torch.int32)
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=n, max_seqlen_kv=n)
        labels = torch.cat([x[:, 1:], torch.zeros(1, 1, dtype=torch.long)], 1)
        loss = full(x, torch.arange(n).unsqueeze(0), None, labels=labels, packed_seq_params=params)[0, :-1].sum()
        loss.backward()
        total += float(loss.detach())
    return total, {k: p.grad.numpy().copy() for k, p in full.named_parameters()}


def _global_names(chunk):
    """Chunk state-dict key -> the unsplit model's key (decoder layers at their global numbers)."""
    out = {}
    for k in chunk.state_dict():
        if k.startswith("decoder.layers."):
            i, rest = k[len("decoder.layers."):].split(".", 1)
            out[k] = f"decoder.layers.{chunk.decoder.layers[int(i)].layer_number - 1}.{rest}"
        else:
            out[k] = k
    return out


def _rank_vpp(rank, world, schedule):
    from megatron.core import parallel_state as ps

    from packloader_integrations import megatron as pm

    torch.set_num_threads(1)
    _megatron_rope_on_cpu()
    ps.initialize_model_parallel(1, 1)
    full = _provider(_config(1, 1), _dense_core_attention_cls())()
    state = {k: v.clone() if torch.is_tensor(v) else v for k, v in full.state_dict().items()}
    ref = _reference(full) if rank == 0 else None
    ps.destroy_model_parallel()

    ps.initialize_model_parallel(1, world, virtual_pipeline_model_parallel_size=2)
    pp_rank = ps.get_pipeline_model_parallel_rank()
    build = _provider(_config(world, 2), pm.PackloaderCoreAttention)
    if schedule == "zb-v":
        chunks = pm.v_shape_model_chunks(build)
    else:  # as megatron-core's get_model builds the interleaved chunks
        chunks = [build(pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=c),
                        post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=c), vp_stage=c)
                  for c in range(2)]
    names = [_global_names(c) for c in chunks]
    for chunk, nm in zip(chunks, names):
        chunk.load_state_dict({k: state[n] for k, n in nm.items()})
    it = pm.MegatronDataIterator(_vpp_loader(schedule), num_microbatches=MB, slices=True)
    out = dict(ref=ref, layers=[[int(x.layer_number) for x in c.decoder.layers] for c in chunks], written=[],
               executed=[], kv_left=[], losses=[], tokens=[])
    for step in range(2):  # the first step derives the lists from the schedule, the second runs the written ones
        batches = [next(it) for _ in range(MB)]
        lists = _written(batches[0]["step_plan"], schedule)
        store = pm.sliced_pipeline_forward_backward(forward_step_func=pm.forward_step, data_iterator=iter(batches),
                                                    model=chunks, num_microbatches=MB, seq_length=0,
                                                    micro_batch_size=1, actions=lists if step else None)
        sched = pm.pipeline_schedule_of(chunks)
        out["written"].append(lists[pp_rank])
        out["executed"].append([list(a) for a in sched.executed])
        out["kv_left"].append(sum(len(st.cache) for st in sched._stages))
        out["losses"].append(sum(float(r["lm loss"][0]) for r in store))
        out["tokens"].append(sum(int(r["lm loss"][1]) for r in store))
    out["grads"] = {nm[k]: p.grad.numpy().copy() / 2 for c, nm in zip(chunks, names)
                    for k, p in c.named_parameters() if p.grad is not None}
    other = "interleaved" if schedule == "zb-v" else "zb-v"
    try:  # the chunks of one placement cannot run the other's schedule
        pm.check_chunk_placement(chunks, chunks[0].config, other, world, pp_rank)
        out["refusal"] = None
    except ValueError as e:
        out["refusal"] = str(e)
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("schedule", ["interleaved", "zb-v"])
def test_megatron_vpp_runs_written_lists_like_whole_documents(schedule):
    """PP 2 x vpp 2 (two gloo ranks, float64): interleaved 1F1B on Megatron's chunk placement (rank r: stages r,
    r + 2) and ZB-V on the V (rank 0: stages 0 and 3, rank 1: stages 1 and 2). On each of two sliced steps every
    rank executes exactly the written lists (ZB-V's with W actions), frees its carried KV, and the loss, token
    count and every gradient equal the unsplit model's over whole documents (rtol 1e-5; the loss 1e-6: Megatron's
    loss_func sums in float32)."""
    pytest.importorskip("megatron.core")
    from helpers.distributed import run_ranks

    batches = [b for b in _vpp_loader(schedule, 1)]
    assert len(batches) == MB and any(s.attend_from < s.start for b in batches for s in b.segments)
    res = run_ranks(_rank_vpp, 2, schedule, timeout=300)
    placed = {"interleaved": [[1, 3], [2, 4]], "zb-v": [[1, 4], [2, 3]]}[schedule]  # layer numbers per rank
    assert [[c[0] for c in r["layers"]] for r in res] == placed
    ref_loss, ref_grads = res[0]["ref"]
    last = 0 if schedule == "zb-v" else 1  # the rank holding model stage 3 (the loss)
    for step in (0, 1):
        for r in range(2):
            assert res[r]["executed"][step] == res[r]["written"][step], (step, r)
            assert any(a[0] == "W" for a in res[r]["written"][step]) == (schedule == "zb-v")
            assert {a[2] for a in res[r]["executed"][step]} == {n - 1 for n in placed[r]}
            assert res[r]["kv_left"][step] == 0
        assert res[last]["tokens"][step] == sum(n - 1 for n in LENGTHS)
        assert res[last]["losses"][step] == pytest.approx(ref_loss, rel=1e-6)
    got = {**res[0]["grads"], **res[1]["grads"]}
    assert set(res[0]["grads"]).isdisjoint(res[1]["grads"])
    assert set(got) == set(ref_grads)
    for k, g in ref_grads.items():
        torch.testing.assert_close(torch.from_numpy(got[k]), torch.from_numpy(g), rtol=1e-5, atol=1e-8, msg=k)
    for r in res:
        assert r["refusal"] is not None and "v_shape_model_chunks" in r["refusal"], r["refusal"]


def test_auto_without_a_choice_is_the_default_schedule_at_vpp():
    """A planner that does not choose (slimpack) under schedule "auto": 1F1B at vpp 1, interleaved 1F1B at vpp 2
    (1F1B refuses two chunks per rank), so slimpack's plans at vpp 2 are scored and written; a choice wins."""
    from packloader.balancers.sim.simulator import plan_schedule
    from packloader.contracts import StepPlan

    none, chose = StepPlan(step=0, ranks=[]), StepPlan(step=0, ranks=[], schedule="zb-v")
    assert plan_schedule(none, "auto") == "1f1b"
    assert plan_schedule(none, "auto", 2) == "interleaved"
    assert plan_schedule(chose, "auto", 2) == "zb-v"
    assert plan_schedule(chose, "interleaved", 2) == "interleaved"
    batches = list(_vpp_loader("auto", 1))  # scored at vpp 2 (step metrics simulate the step)
    assert len(batches) == MB and batches[0].step_metrics is not None
