"""Adapters for Megatron-core, DeepSpeed and Hugging Face (install the matching extra).

`packloader_integrations.megatron`, `.deepspeed` and `.hf` import their framework only when a function needs it;
a missing framework raises `MissingExtraError` naming the extra to install. See docs/integrations.md.
"""
