"""Memory model: how many tokens a micro-batch may hold on one rank (Hydraulis's MaxLen), and per-rank cost
models and caps for heterogeneous data-parallel groups.

Activation bytes per token per layer (bf16, flash attention so no q x k score matrix is kept; Korthikanti et
al.'s accounting adapted to grouped-query attention and a SwiGLU MLP, with tensor + sequence parallelism
dividing everything by tp):

* ``none``: the layer input and first norm (2h), the normed input to QKV (2h), Q, K, V (2(h + 2 kv)), the
  attention output (2h), the second norm's input and output (4h), gate and up (4 ffn), the SwiGLU product
  (2 ffn): about 32h for Llama-2-7B (Megatron's 34h also counts dropout masks, which Llama has none of).
* ``selective``: the SwiGLU product is recomputed from gate and up (2 ffn fewer); the default.
* ``full``: only the layer input (2h) is kept; one layer's full set is live again while it is recomputed.

Context parallelism divides a micro-batch's tokens by cp. Pipeline stage s of a 1F1B schedule holds the
activations of min(pp - s, m) micro-batches at its peak, GPipe all m, interleaved 1F1B (vpp chunks per rank)
``((pp - 1) * 2 + (vpp - 1) * pp + 1) / vpp`` stage-equivalents on the first rank. The last stage also holds
one micro-batch's logits (bf16 and an fp32 copy for the loss). Static memory: bf16 weights, fp32 gradients,
fp32 master weights and two Adam moments (18 bytes a parameter; with the distributed optimizer the 12 bytes of
optimizer state are sharded over dp).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Literal

import msgspec

from packloader.balancers.cost.devices import DEFAULT_DEVICE, load_device
from packloader.balancers.cost.presets import ModelShape, get_shape
from packloader.balancers.cost.profile_io import PROFILES_DIR
from packloader.balancers.cost.schedules import schedule_spec
from packloader.contracts import ParallelConfig, PlanConfig

Recompute = Literal["none", "selective", "full"]
GiB = 1024**3


def activation_bytes_per_token_per_layer(shape: ModelShape, parallel: ParallelConfig | None = None, recompute: Recompute = "selective") -> float:
    """Bytes one token's activations take in one layer on one GPU between its forward and its backward."""
    parallel = parallel or ParallelConfig()
    h, kv, f = shape.hidden, shape.kv_dim, shape.ffn
    mlp_saved = (2 * f * 2 + 2 * f) if shape.gated_mlp else (2 * f + 2 * f)
    full = 2 * h + 2 * h + 2 * (h + 2 * kv) + 2 * h + 4 * h + mlp_saved
    if recompute == "none":
        per = full
    elif recompute == "selective":
        per = full - (2 * f if shape.gated_mlp else 0)
    elif recompute == "full":
        per = 2 * h
    else:
        raise ValueError(f"unknown recompute {recompute!r}; expected none, selective or full")
    return per / parallel.tp


def full_layer_bytes_per_token(shape: ModelShape, parallel: ParallelConfig | None = None) -> float:
    return activation_bytes_per_token_per_layer(shape, parallel, "none")


def in_flight_micro_batches(parallel: ParallelConfig, stage: int = 0, schedule: str = "1f1b", num_micro_batches: int | None = None) -> float:
    """Micro-batches (in units of one full stage's activations) a stage holds at its peak."""
    pp, vpp = parallel.pp, parallel.vpp
    m = num_micro_batches if num_micro_batches is not None else math.inf
    profile = schedule_spec(schedule).memory if schedule != "auto" else "1f1b"
    if profile == "gpipe":
        k = m if m != math.inf else pp
    elif profile == "interleaved" and vpp > 1:
        chunks = (pp - 1) * 2 + (vpp - 1) * pp + 1 - 2 * stage
        k = min(chunks, m * vpp) / vpp
    else:
        k = min(pp - stage, m)
    return float(k)


def static_bytes(shape: ModelShape, parallel: ParallelConfig | None = None, stage: int = 0, distributed_optimizer: bool = True) -> float:
    """Weights, gradients and optimizer state of one pipeline stage on one GPU."""
    parallel = parallel or ParallelConfig()
    params = shape.params_per_layer() * shape.layers / parallel.pp
    if stage == 0:
        params += shape.vocab * shape.hidden  # embedding
    if stage == parallel.pp - 1:
        params += shape.vocab * shape.hidden + shape.hidden  # LM head and final norm
    params /= parallel.tp
    per_param = 6.0 + (12.0 / parallel.dp if distributed_optimizer else 12.0)
    return params * per_param


def logits_bytes_per_token(shape: ModelShape, parallel: ParallelConfig | None = None) -> float:
    parallel = parallel or ParallelConfig()
    return shape.vocab * (2 + 4) / parallel.tp


@dataclass(frozen=True)
class MemoryModel:
    """Per-stage memory of a model under a parallel layout on one device."""

    shape: ModelShape
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    memory_gib: float = 80.0
    recompute: Recompute = "selective"
    schedule: str = "1f1b"
    distributed_optimizer: bool = True
    usable_fraction: float = 0.92  # allocator fragmentation and CUDA context
    reserve_gib: float = 2.0  # NCCL buffers, workspaces, temporaries

    @classmethod
    def for_preset(cls, name: str, parallel: ParallelConfig | None = None, **kw) -> "MemoryModel":
        return cls(get_shape(name), parallel or ParallelConfig(), **kw)

    def layers(self, stage: int = 0) -> float:
        return self.shape.layers / self.parallel.pp

    def activation_bytes_per_token(self, stage: int = 0) -> float:
        """Bytes one token of a micro-batch (before CP sharding) keeps alive on one GPU of `stage` from its
        forward to its backward."""
        per_layer = activation_bytes_per_token_per_layer(self.shape, self.parallel, self.recompute)
        return per_layer * self.layers(stage) / self.parallel.cp

    def transient_bytes_per_token(self, stage: int = 0) -> float:
        """Bytes per token live only while one micro-batch runs: logits on the last stage, one layer's
        recomputed activations under full recompute."""
        t = 0.0
        if stage == self.parallel.pp - 1:
            t += logits_bytes_per_token(self.shape, self.parallel)
        if self.recompute == "full":
            t += full_layer_bytes_per_token(self.shape, self.parallel)
        return t / self.parallel.cp

    def kv_grad_bytes_per_token(self, stage: int = 0) -> float:
        """Bytes of the key/value gradients (bf16 dK and dV) one prefix token of a slice needs on one GPU of
        `stage` between the later slice's backward and the earlier slice's."""
        return 2 * self.shape.kv_dim * 2 / self.parallel.tp * self.layers(stage) / self.parallel.cp

    def static_bytes(self, stage: int = 0) -> float:
        return static_bytes(self.shape, self.parallel, stage, self.distributed_optimizer)

    def limit_bytes(self) -> float:
        """Bytes one GPU may use in all (the usable share less the reserve): what a simulated peak, static
        memory included, must stay under."""
        return self.memory_gib * GiB * self.usable_fraction - self.reserve_gib * GiB

    def budget_bytes(self, stage: int = 0) -> float:
        """Bytes left for activations on `stage`."""
        return self.memory_gib * GiB * self.usable_fraction - self.reserve_gib * GiB - self.static_bytes(stage)

    def tokens_that_fit(self, num_micro_batches: int | None = None, tile: int = 128, user_cap: int | None = None) -> int:
        """Most tokens one micro-batch may hold so that no stage runs out of memory at its peak (0 when even
        the weights do not fit), rounded down to the tile, and at most `user_cap`."""
        best = math.inf
        for s in range(self.parallel.pp):
            k = in_flight_micro_batches(self.parallel, s, self.schedule, num_micro_batches)
            per_token = self.activation_bytes_per_token(s) * k + self.transient_bytes_per_token(s)
            best = min(best, self.budget_bytes(s) / per_token)
        n = max(0, int(best))
        if tile > 1:
            n = n // tile * tile
        if user_cap is not None:
            n = min(n, int(user_cap))
        return n

    def peak_bytes(self, tokens_per_micro_batch: int, stage: int = 0, num_micro_batches: int | None = None) -> float:
        """Peak bytes on one GPU of `stage` when every micro-batch holds `tokens_per_micro_batch` tokens."""
        k = in_flight_micro_batches(self.parallel, stage, self.schedule, num_micro_batches)
        per_token = self.activation_bytes_per_token(stage) * k + self.transient_bytes_per_token(stage)
        return self.static_bytes(stage) + per_token * tokens_per_micro_batch


def memory_model_for(model_spec: str, parallel: ParallelConfig | None = None, schedule: str = "1f1b", device: str = DEFAULT_DEVICE,
                     memory_gib: float | None = None) -> "MemoryModel | None":
    """The memory model of a preset name on `device` (a device profile name: its memory and usable share; default
    recompute; `memory_gib` overrides the device's memory, PlanConfig.memory_gib), or None when `model_spec` is a
    calibration profile (a JSON path or a bundled profile), whose model shape and so memory are unknown."""
    from pathlib import Path

    text = str(model_spec)
    if text.endswith(".json") or Path(text).exists() or (PROFILES_DIR / f"{text}.json").exists():
        return None
    try:
        shape = get_shape(text)
    except KeyError:
        return None
    dev = load_device(device)
    return MemoryModel(shape, parallel or ParallelConfig(), memory_gib=memory_gib or dev.memory_gib, schedule=schedule,
                       usable_fraction=dev.usable_fraction, reserve_gib=dev.reserve_gib)


def memory_limit_bytes(memory: "MemoryModel | None") -> float | None:
    """Bytes a GPU may use (MemoryModel.limit_bytes), None without a memory model."""
    return None if memory is None else memory.limit_bytes()


def max_tokens_for_memory(
    shape: ModelShape | str,
    parallel: ParallelConfig | None = None,
    *,
    memory_gib: float = 80.0,
    recompute: Recompute = "selective",
    schedule: str = "1f1b",
    num_micro_batches: int | None = None,
    tile: int = 128,
    user_cap: int | None = None,
    distributed_optimizer: bool = True,
    usable_fraction: float = 0.92,
    reserve_gib: float = 2.0,
) -> int:
    """Hydraulis's MaxLen: the most tokens a micro-batch may hold for a parallel configuration, or the user's
    cap when that is lower."""
    if isinstance(shape, str):
        shape = get_shape(shape)
    mm = MemoryModel(
        shape, parallel or ParallelConfig(), memory_gib=memory_gib, recompute=recompute, schedule=schedule,
        distributed_optimizer=distributed_optimizer, usable_fraction=usable_fraction, reserve_gib=reserve_gib,
    )
    return mm.tokens_that_fit(num_micro_batches, tile, user_cap)


def fit_advice(memory: MemoryModel, max_tokens: int, context: int | None, tile: int = 128) -> str:
    """What to change so a step fits `memory`'s device: the largest max_tokens (and context, when pieces are
    longer and cannot be sliced; None when they can) that fits this layout, and the smallest tp (up to 8, dividing the heads) at which today's max_tokens
    fits. The memory model's uniform estimate, a starting point for the simulated check, not a guarantee."""
    fit = memory.tokens_that_fit(tile=tile)
    parts = []
    if 0 < fit < max_tokens:
        parts.append(f"max_tokens <= {fit:,} (now {max_tokens:,})")
        if context is not None and context > fit:
            parts.append(f"context <= {fit:,} (now {context:,}), or slicing allowed")
    elif fit == 0:
        parts.append("the weights and optimizer state alone do not fit: more tp, pp or dp (distributed optimizer)")
    p = memory.parallel
    for tp in (2, 4, 8):
        if tp <= p.tp or memory.shape.heads % tp:
            continue
        wider = dataclasses.replace(memory, parallel=msgspec.structs.replace(p, tp=tp))
        if wider.tokens_that_fit(tile=tile) >= max(tile, min(max_tokens, context or max_tokens)):
            parts.append(f"tp {tp} (now {p.tp})")
            break
    parts.append(f"more pp (now {p.pp})")
    return "; ".join(parts)



def over_memory_text(memory: MemoryModel, cfg: PlanConfig, peak: float, device: str) -> str:
    """The warning when no plan fits: the peak against the usable memory, the layout, and `fit_advice`."""
    p, limit = cfg.parallel, memory.limit_bytes()
    return (f"no candidate plan fits in memory: the lowest simulated peak, {peak / GiB:.1f} GiB, is {peak / limit:.2f}x "
            f"the {limit / GiB:.1f} GiB usable of the {memory.memory_gib:g} GiB {device.upper()} ({cfg.model}, dp "
            f"{p.dp}, pp {p.pp}, cp {p.cp}, tp {p.tp}, max_tokens {cfg.max_tokens:,}, context {cfg.context:,}). "
            f"Change: {fit_advice(memory, cfg.max_tokens, None if cfg.allow_slicing else cfg.context)}")
