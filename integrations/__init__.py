"""Adapters for Megatron-core, DeepSpeed and Hugging Face (install the matching extra)."""
