"""RoPE for sliced plans. Megatron's THD RoPE starts every packed segment at position 0: right for whole
documents and pieces, wrong for a slice, whose queries and keys belong at positions ``start - attend_from``
onwards. `SliceRope` rotates a slice's rows further, by the angle between Megatron's own frequency rows of the
document position and of the position Megatron used; rotations of one frequency compose (R(a)R(b) = R(a+b)), so
the rows end at the unsliced document's angles, and the keys a slice stores for later ones are already right."""

from __future__ import annotations

from typing import Any

import torch

from .._lazy import require

ROPE_ALTERNATIVE = "or plan with PlanConfig(allow_slicing=False)"


def _refuse(setting: str, why: str) -> None:
    from packloader.runtime.slice_check import SlicesNotSupported

    raise SlicesNotSupported(f"{setting}: {why}; the sliced schedules correct position_embedding_type='rope' "
                             f"(RotaryEmbedding, any rotary_percent, rotary_base, rope_scaling, "
                             f"seq_len_interpolation_factor, rotary_interleaved) and position_ids-based embeddings "
                             f"only: change the setting, {ROPE_ALTERNATIVE}")


class SliceRope:
    """What ``PackloaderCoreAttention`` applies to q and k inside a slice context: per row, the rotation from
    Megatron's angle at the segment-local position ``p`` to its angle at ``p + start - attend_from``, both taken
    from the model's ``rotary_pos_emb.get_freqs_non_repeated`` (its inv_freq, scaling and interpolation) and
    differenced in float64, then applied with Megatron's ``_apply_rotary_pos_emb_bshd`` (its interleaving and
    ``rotary_percent`` pass-through). Rows of unsliced segments get angle 0, the identity."""

    def __init__(self, rotary: torch.nn.Module) -> None:
        self.rotary = rotary
        self.interleaved = bool(getattr(rotary, "rotary_interleaved", False))
        self._apply = require("megatron.core.models.common.embeddings.rope_utils")._apply_rotary_pos_emb_bshd
        self._ctx: Any = None
        self._emb: torch.Tensor | None = None

    def _angles(self, ctx: Any, packed_seq_params: Any, rows: int, device: torch.device) -> torch.Tensor | None:
        segs = ctx.segments
        offsets = [s.start - s.attend_from for s in segs]
        if not any(offsets):
            return None
        p = packed_seq_params
        # the rows Megatron's THD RoPE counted positions from (its own choice of cu_seqlens)
        cu = p.cu_seqlens_q_padded if getattr(p, "cu_seqlens_q_padded", None) is not None else p.cu_seqlens_q
        cu = [int(c) for c in cu.tolist()]
        lengths = [b - a for a, b in zip(cu[:-1], cu[1:])]
        if lengths != [s.end - s.start for s in segs] or cu[-1] != rows:
            raise ValueError(f"packed_seq_params' segments (lengths {lengths}) are not the micro-batch's segments "
                             f"({[s.end - s.start for s in segs]}): RoPE positions of its slices cannot be corrected")
        table = self.rotary.get_freqs_non_repeated(max(n + o for n, o in zip(lengths, offsets)))
        table = table.to(device=device, dtype=torch.float64)
        delta = torch.zeros(rows, table.shape[1], dtype=torch.float64, device=device)
        for a, n, o in zip(cu[:-1], lengths, offsets):
            if o:
                delta[a:a + n] = table[o:o + n] - table[:n]
        if self.interleaved:  # Megatron's get_emb layouts
            emb = torch.stack((delta.view(-1, 1), delta.view(-1, 1)), dim=-1).view(rows, -1)
        else:
            emb = torch.cat((delta, delta), dim=-1)
        return emb[:, None, None, :]

    def rotate(self, query: torch.Tensor, key: torch.Tensor, ctx: Any, packed_seq_params: Any):
        """q and k ([t, h, d], already rotated by Megatron) at the document positions of ``ctx``'s segments."""
        if ctx is not self._ctx:  # one table per micro-batch, shared by its layers
            self._ctx, self._emb = ctx, self._angles(ctx, packed_seq_params, query.shape[0], query.device)
        if self._emb is None:
            return query, key
        rot = [self._apply(t.unsqueeze(1), self._emb, rotary_interleaved=self.interleaved).squeeze(1)
               for t in (query, key)]
        return rot[0], rot[1]


def _embedding_owner(model: torch.nn.Module) -> Any:
    return next((m for m in model.modules() if hasattr(m, "position_embedding_type")), None)


def slice_rope_of(model: torch.nn.Module, config: Any) -> SliceRope | None:
    """The RoPE correction the model's sliced attention needs (None: positions come from ``position_ids``), or
    SlicesNotSupported naming a setting whose rotary positions it cannot correct exactly."""
    if getattr(config, "multi_latent_attention", False):
        _refuse("multi_latent_attention=True", "multi-latent attention applies its own rotary embedding inside the "
                "attention, out of PackloaderCoreAttention's reach, so a slice would keep positions from 0")
    owner = _embedding_owner(model)
    kind = getattr(owner, "position_embedding_type", "learned_absolute")
    if kind in ("learned_absolute", "none"):
        return None
    if kind != "rope":
        why = {"yarn": "YaRN multiplies cosine and sine by its concentration factor (mscale), so two rotations do "
                       "not compose into one",
               "mrope": "multimodal RoPE takes its positions per section from position_ids, not from the packed "
                        "segments"}.get(kind, "not a rotary embedding whose positions the slices correct")
        _refuse(f"position_embedding_type={kind!r}", why)
    if getattr(config, "no_rope_freq", None):
        _refuse(f"no_rope_freq={config.no_rope_freq!r}", "layers without RoPE are not told apart")
    yarn = require("megatron.core.models.common.embeddings.yarn_rotary_pos_embedding")
    mscale = yarn._yarn_get_concentration_factor_from_config(config)
    if mscale != 1.0:
        _refuse(f"yarn_rotary_scaling_factor={getattr(config, 'yarn_rotary_scaling_factor', None)!r} "
                f"(mscale {mscale})", "Megatron scales cosine and sine by mscale, so two rotations do not compose")
    rotary = getattr(owner, "rotary_pos_emb", None)
    base = require("megatron.core.models.common.embeddings.rotary_pos_embedding").RotaryEmbedding
    if type(rotary) is not base:
        _refuse(f"rotary_pos_emb of type {type(rotary).__name__}", "only Megatron's RotaryEmbedding's formula is "
                "reproduced")
    if not hasattr(rotary, "get_freqs_non_repeated"):
        _refuse("this megatron-core's RotaryEmbedding (no get_freqs_non_repeated)", "the slices' angles are read "
                "from that method, so that they are the model's own")
    return SliceRope(rotary)
