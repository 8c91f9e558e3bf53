"""The cost model of the user's own model: a Hugging Face `PretrainedConfig` or a Megatron-core
`TransformerConfig` to a `ModelShape` (heads, KV heads, head dim, hidden, FFN, layers, vocabulary), and to the
`PlanConfig.model` string that prices plans with it (`model_spec`). Neither library is imported: the configs are
read by their attribute names, so this works with whichever version the user has."""

from __future__ import annotations

from typing import Any

from packloader.balancers.cost.presets import ModelShape

# Hugging Face model types whose MLP is gated (gate, up and down projections) whatever their activation is named
GATED_TYPES = {"llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma", "gemma2",
               "gemma3_text", "phi3", "olmo", "olmo2", "granite", "cohere", "deepseek_v3", "internlm2", "yi"}


def _is_megatron(config: Any) -> bool:
    return hasattr(config, "num_layers") and hasattr(config, "ffn_hidden_size")


def shape_from_config(config: Any, *, vocab: int | None = None, name: str | None = None) -> ModelShape:
    """A ModelShape from an HF PretrainedConfig or a Megatron TransformerConfig. Megatron's config holds no
    vocabulary size: pass `vocab` (Megatron's padded vocabulary); it overrides an HF config's too."""
    if _is_megatron(config):
        heads = int(config.num_attention_heads)
        if vocab is None:
            raise ValueError("a Megatron TransformerConfig has no vocabulary size: pass vocab= (the padded vocabulary "
                             "size, args.padded_vocab_size), which prices the LM head")
        return ModelShape(
            name=name or "megatron", hidden=int(config.hidden_size), layers=int(config.num_layers), heads=heads,
            kv_heads=int(config.num_query_groups or heads), ffn=int(config.ffn_hidden_size), vocab=int(vocab),
            gated_mlp=bool(config.gated_linear_unit),
            head_size=int(config.kv_channels or config.hidden_size // heads),
        )
    try:
        hidden, layers = int(config.hidden_size), int(config.num_hidden_layers)
        heads = int(config.num_attention_heads)
    except AttributeError as e:
        raise TypeError(f"expected a Hugging Face PretrainedConfig or a Megatron TransformerConfig, got "
                        f"{type(config).__name__} ({e})") from None
    kv = getattr(config, "num_key_value_heads", None) or heads
    ffn = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * hidden
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    model_type = getattr(config, "model_type", "") or ""
    gated = model_type in GATED_TYPES or getattr(config, "hidden_act", "") in ("silu", "swish", "swiglu")
    vocab = int(vocab if vocab is not None else config.vocab_size)
    return ModelShape(name=name or model_type or "hf", hidden=hidden, layers=layers, heads=heads, kv_heads=int(kv),
                      ffn=int(ffn), vocab=vocab, gated_mlp=gated, head_size=int(head_dim))


def model_spec(config: Any, *, vocab: int | None = None, name: str | None = None) -> str:
    """`PlanConfig(model=model_spec(model.config))`: plans priced for the user's model (see `shape_from_config`)."""
    return shape_from_config(config, vocab=vocab, name=name).spec()
