"""The cost model built from the user's model config: real transformers and megatron-core configs give the shape
(checked against the llama3-8b preset's hand-entered numbers, whose cost model must come out identical), the
spec string round-trips, and a loader plans with it."""

from __future__ import annotations

import numpy as np
import pytest

from packloader import PackedLoader, PlanConfig, model_spec, shape_from_config
from packloader.balancers.cost.presets import get_shape
from packloader.balancers.cost.resolve import load_cost_model
from packloader.contracts import ParallelConfig
from packloader.sources.base import IterableSource

LLAMA3_8B = dict(hidden=4096, layers=32, heads=32, kv_heads=8, head_dim=128, ffn=14336, vocab=128256, gated_mlp=True)


def fields(shape) -> dict:
    return dict(hidden=shape.hidden, layers=shape.layers, heads=shape.heads, kv_heads=shape.kv_heads,
                head_dim=shape.head_dim, ffn=shape.ffn, vocab=shape.vocab, gated_mlp=shape.gated_mlp)


def hf_llama3_8b():
    transformers = pytest.importorskip("transformers")
    return transformers.LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                    num_attention_heads=32, num_key_value_heads=8, vocab_size=128256)


def megatron_llama3_8b():
    pytest.importorskip("megatron.core")
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
                             ffn_hidden_size=14336, gated_linear_unit=True)


@pytest.mark.parametrize("which", ["hf", "megatron"])
def test_config_gives_the_preset_and_its_cost_model(which):
    cfg = hf_llama3_8b() if which == "hf" else megatron_llama3_8b()
    kw = {"vocab": 128256} if which == "megatron" else {}
    assert fields(shape_from_config(cfg, **kw)) == LLAMA3_8B
    spec = model_spec(cfg, **kw)
    assert fields(get_shape(spec)) == LLAMA3_8B
    par = ParallelConfig(dp=2, pp=2, tp=2)
    for cost in ("measured", "analytic"):
        mine = load_cost_model(spec, par, cost=cost).profile
        preset = load_cost_model("llama3-8b", par, cost=cost).profile
        for part in ("attn_fwd", "attn_bwd", "lin_fwd", "lin_bwd", "lin_table", "tile"):
            assert getattr(mine, part) == getattr(preset, part), (cost, part)


def test_megatron_config_needs_the_vocabulary():
    with pytest.raises(ValueError, match="vocab="):
        shape_from_config(megatron_llama3_8b())


def test_head_dim_that_is_not_hidden_over_heads_is_kept():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                                   num_attention_heads=8, num_key_value_heads=2, head_dim=256, vocab_size=32000)
    shape = get_shape(model_spec(cfg))
    assert (shape.head_dim, shape.q_dim, shape.kv_dim) == (256, 2048, 512)
    # Q and O are hidden x 2048, K and V hidden x 512, the gated MLP three hidden x ffn
    assert shape.linear_params_per_layer() == 1024 * (2048 + 2 * 512) + 2048 * 1024 + 3 * 1024 * 2816
    # attention prices heads x head_dim: twice the FLOPs per (query, key) pair of a head_dim-128 model
    narrow = get_shape(model_spec(transformers.LlamaConfig(
        hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
        vocab_size=32000)))
    a = load_cost_model(shape.spec(), cost="analytic").profile.attn_fwd.a
    b = load_cost_model(narrow.spec(), cost="analytic").profile.attn_fwd.a
    assert a == pytest.approx(2 * b, rel=1e-12)


@pytest.mark.parametrize("bad", ["shape:x:hidden=1", "shape:x:hidden=a,layers=2", "shape:nope"])
def test_bad_spec_is_named(bad):
    with pytest.raises(KeyError, match="hidden"):
        get_shape(bad)


def test_loader_plans_with_the_users_model():
    transformers = pytest.importorskip("transformers")
    small = transformers.LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                                     num_attention_heads=4, num_key_value_heads=2, vocab_size=1024)
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 1000, size=int(n)).astype(np.int32) for n in rng.integers(5, 300, size=40)]
    cfg = PlanConfig(strategy="fixed", max_tokens=512, context=512, tokens_per_step=1024, model=model_spec(small))
    batches = list(PackedLoader(IterableSource(docs), config=cfg, num_threads=0, append_eos=False))
    assert sum(b.num_tokens for b in batches) == sum(len(d) for d in docs)
    assert all(b.step_metrics.cost_model.startswith("llama") for b in batches)
