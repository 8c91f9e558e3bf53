"""The documents and Megatron pieces the sliced-plan tests share (tests/test_integration_slices.py and
tests/test_megatron_vpp.py): a fixed small corpus, the whole-document reference attention, and Megatron's RoPE on a
machine without CUDA."""

from __future__ import annotations

import numpy as np
import torch

VOCAB = 61
LENGTHS = [150, 20, 30, 12, 45, 8, 60, 25, 33, 9]


def corpus():
    rng = np.random.default_rng(0)
    return [rng.integers(0, VOCAB, size=n).astype(np.int32) for n in LENGTHS]


def _dense_core_attention_cls():
    """The reference's core attention: causal softmax attention of one whole document by an explicit mask."""

    class Dense(torch.nn.Module):
        def __init__(self, config, layer_number, *a, softmax_scale=None, **k):
            super().__init__()
            self.scale = (config.hidden_size // config.num_attention_heads) ** -0.5

        def forward(self, q, k, v, attention_mask=None, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None, **kw):
            q, k, v = (t.squeeze(1) if t.dim() == 4 else t for t in (q, k, v))
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
            n = q.shape[0]
            s = torch.einsum("qhd,khd->hqk", q, k) * self.scale
            s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
            return torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v).reshape(n, -1)

    return Dense


def _megatron_rope_on_cpu():
    """Megatron's RotaryEmbedding moves its inv_freq to ``torch.cuda.current_device()`` at every forward; on a
    machine without CUDA (this rank process only) that device is the CPU. Megatron's rotary code runs unchanged."""
    if not torch.cuda.is_available():
        torch.cuda.current_device = lambda: "cpu"
