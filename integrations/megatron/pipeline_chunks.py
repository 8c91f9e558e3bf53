"""Which model stage each of a rank's Megatron model chunks is, under the schedule a step runs: Megatron's
interleaved placement (chunk c on pipeline rank r is stage c*pp + r: interleaved 1F1B and interleaved zero
bubble) or ZB-V's V (chunk 0 is stage r, chunk 1 stage 2*pp-1-r), and `v_shape_model_chunks`, which builds the
V's chunks with megatron-core's own model provider."""

from __future__ import annotations

from typing import Any, Callable

import torch

from .._lazy import require


def placement_stages(schedule: str, pp: int, rank: int, vpp: int) -> list[int]:
    """The model stage of each model chunk of pipeline rank `rank`, in chunk order."""
    if schedule == "zb-v":
        return [rank, 2 * pp - 1 - rank]
    return [c * pp + rank for c in range(vpp)]


def _layer_numbers(chunk: torch.nn.Module) -> list[int]:
    decoder = require("megatron.core.utils").get_attr_wrapped_model(chunk, "decoder")
    return [int(layer.layer_number) for layer in getattr(decoder, "layers", [])]


def check_chunk_placement(chunks: list[torch.nn.Module], config: Any, schedule: str, pp: int, rank: int) -> None:
    """Refuse chunks whose decoder layers (Megatron numbers them over the whole model) are not the stages the
    schedule places on this rank: a model built for the interleaved placement cannot run ZB-V, nor the V's chunks
    an interleaved schedule (under PlanConfig.schedule="auto" at vpp 2 the planner may pick either)."""
    stages = len(chunks) * pp
    per = config.num_layers // stages
    if per == 0 or config.num_layers % stages:
        return  # an uneven layout: nothing to infer the stages from
    want = placement_stages(schedule, pp, rank, len(chunks))
    for c, (chunk, stage) in enumerate(zip(chunks, want)):
        nums = _layer_numbers(chunk)
        expected = list(range(stage * per + 1, (stage + 1) * per + 1))
        if nums and nums != expected:
            other = "the V (v_shape_model_chunks)" if schedule != "zb-v" else "Megatron's interleaved placement"
            raise ValueError(
                f"schedule {schedule!r} runs model stage {stage} (layers {expected[0]}..{expected[-1]}) as model "
                f"chunk {c} of pipeline rank {rank}, but that chunk holds layers {nums[0]}..{nums[-1]} (built for "
                f"{other}): build the chunks for the schedule the plan runs ({_HOW}), and under "
                f"PlanConfig.schedule='auto' at vpp 2 plan with the one placement your model has (schedule "
                f"'interleaved' or 'zb-h1', or 'zb-v')")


_HOW = ("'interleaved' and 'zb-h1': model_provider(vp_stage=c) per chunk as megatron-core builds them; 'zb-v': "
        "v_shape_model_chunks(model_provider)")


def v_shape_model_chunks(model_provider: Callable[..., torch.nn.Module], *, pp: int | None = None,
                         rank: int | None = None) -> list[torch.nn.Module]:
    """ZB-V's two model chunks for this pipeline rank r (stages r and 2*pp-1-r), built by a megatron-core model
    provider ``model_provider(pre_process=..., post_process=..., vp_stage=...)`` with
    ``virtual_pipeline_model_parallel_size=2``: chunk 0 is Megatron's own chunk 0 of rank r; chunk 1 holds the
    layers Megatron gives chunk 1 of rank pp-1-r (its layers renumbered after construction: megatron-core places
    chunk 1 on rank r), the LM head and loss on rank 0. Megatron's distributed checkpointing, which recomputes
    layer offsets from the interleaved placement, does not know this renumbering: save and load chunk 1 by its
    layers' numbers."""
    ps = require("megatron.core.parallel_state")
    pp = ps.get_pipeline_model_parallel_world_size() if pp is None else pp
    rank = ps.get_pipeline_model_parallel_rank() if rank is None else rank
    first = model_provider(pre_process=rank == 0, post_process=False, vp_stage=0)
    second = model_provider(pre_process=False, post_process=rank == 0, vp_stage=1)
    nums = _layer_numbers(second)
    if nums:
        per = len(nums)
        shift = (2 * pp - 1 - rank - (pp + rank)) * per  # from Megatron's stage pp + r to the V's 2*pp-1-r
        if nums[0] != (pp + rank) * per + 1:
            raise ValueError(f"v_shape_model_chunks: the provider's chunk 1 holds layers {nums[0]}..{nums[-1]}, not "
                             f"Megatron's interleaved chunk 1 of rank {rank}: set "
                             "virtual_pipeline_model_parallel_size=2 with an even layer split")
        for m in second.modules():  # the layer, its attention and core attention carry the number
            if isinstance(getattr(m, "layer_number", None), int):
                m.layer_number += shift
    return [first, second]
