"""Zeppelin's hierarchical context parallelism for one model: linear layers in the linear layout, attention in the
attention layout, one micro-batch at a time.

Every rank of the CP group (``group``: the world by default; with data parallelism around it, one group per DP
replica, e.g. from ``packloader.runtime.groups.ProcessGroupCache``) gets the same packed micro-batch. ``ZeppelinContext(segments)`` builds its two layouts
(``packloader.runtime.remap.micro_batch_layouts``: equal contiguous token counts for the linear layers; Zeppelin's
hierarchical sharding for attention, short documents whole on one rank and long ones in 2 x CP chunks) and this
rank's ``Remapper``. The rank runs the model on its linear-layout tokens only (``ctx.local(tensor)``: input ids,
position ids, labels), and each attention layer calls ``ctx.attention(q, k, v)`` on its local rows: queries, keys and
values move to the attention layout (all-to-all), this rank's shard runs as in ``cp_attention`` (keys and values of
sharded documents all-gathered, each query run's keys selected), and the output moves back. Both moves and the all-gather are autograd operations, so each
rank's backward gives its share of the gradient; ``reduce_gradients`` sums those shares over the group (the ranks
hold different tokens of one micro-batch, so their gradients add, not average).

Layers find the context with ``current_zeppelin_context()`` inside ``with ctx.active():`` (packloader's transformers
attention, ``packloader_integrations.hf.packloader_attention_forward``, does). Slices are refused by the layouts.
"""

from __future__ import annotations

import contextvars
from typing import Any, Iterable, Sequence

import torch
import torch.distributed as dist

from packloader.contracts import Segment
from packloader.runtime.scoped import scoped

__all__ = ["ZeppelinContext", "current_zeppelin_context", "reduce_gradients"]

_CURRENT: contextvars.ContextVar["ZeppelinContext | None"] = contextvars.ContextVar("packloader_zeppelin",
                                                                                    default=None)


def current_zeppelin_context() -> "ZeppelinContext | None":
    """The ZeppelinContext of the micro-batch being run (None outside one)."""
    return _CURRENT.get()


class ZeppelinContext:
    """One micro-batch's layouts, remapper and attention shard on this rank of `group` (see the module)."""

    def __init__(self, segments: Sequence[Segment], *, group: Any = None, mode: str = "hierarchical",
                 cost_model: Any = None, method: str = "auto", backend: str | None = None,
                 **shard_options: Any) -> None:
        from packloader.runtime.remap import Remapper, micro_batch_layouts

        on = dist.is_available() and dist.is_initialized()
        world = dist.get_world_size(group) if on else 1
        self.rank = dist.get_rank(group) if on else 0
        self.group, self.backend = group, backend
        self.linear, self.layout = micro_batch_layouts(list(segments), world, mode=mode, cost_model=cost_model,
                                                       **shard_options)
        self.remapper = Remapper(self.linear, self.layout, group=group, method=method)
        self.shard = self.layout.shards[self.rank]
        self.index = torch.as_tensor(self.linear.indices[self.rank])
        if len(self.index) == 0:
            raise ValueError(f"micro-batch of {self.linear.num_tokens} tokens over {world} CP ranks leaves rank "
                             f"{self.rank} no token in the linear layout; use fewer CP ranks or larger micro-batches")

    def local(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's linear-layout tokens of a `[T]` or `[1, T]` per-token tensor of the micro-batch (`[n]`)."""
        return t.reshape(-1)[self.index.to(t.device)]

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: Any = None,
                  softmax_scale: float | None = None, **kwargs: Any) -> torch.Tensor:
        """Causal attention of this rank's local rows (`q [n, Hq, D]`, `k/v [n, Hkv, D]`, linear layout)."""
        from packloader.runtime.cp_attention import cp_attention

        rm = self.remapper
        out = cp_attention(rm.to_attention(q), rm.to_attention(k), rm.to_attention(v), self.shard, self.group,
                           causal=True, softmax_scale=softmax_scale, backend=self.backend, **kwargs)
        return rm.to_linear(out)

    def active(self):
        """Make this the current Zeppelin context inside the block."""
        return scoped(_CURRENT, self)


def reduce_gradients(params: Iterable[torch.nn.Parameter], group: Any = None) -> None:
    """Sum every parameter's gradient over the CP group (each rank holds its tokens' share)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return
    for p in params:
        if p.requires_grad:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, group=group)
