"""Part 7, the loader keeps up: `PackedLoader` over Parquet token shards of a long-tail corpus, three ways:

* the loader alone: tokens/s it delivers (collated batches, pinned and copied to the device);
* the training step alone: tokens/s the device consumes (forward + backward of an embedding and a few Llama
  layers on the same batches, prefetched);
* both together: the step runs on each batch as the loader yields it; tokens/s, and the share of the wall time
  spent waiting for the next batch (0 when the loader keeps up).

A full model consumes fewer tokens/s than the timed layers: `consumed_tokens_per_s_full_model` scales the step
alone to all the model's layers, the rate the loader must beat on one GPU without pipeline stages. So the model
is one that fits one GPU: Llama-3.2-1B's layers (the 7B does not fit at TP 1 with 16K-token micro-batches, its
weights and optimizer state alone fill an H100), planned for that model (`ModelShape.spec()`, as
`packloader.model_spec` gives a user's model) on the device file of the GPU present (gpu_plan.device_name); the
planner's warnings, none expected, are kept with the figures."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from gpu_common import SHAPE_1B, SHAPE_TINY, Budget, Ctx, long_tail_lengths
from gpu_model import Layers, Pack
from gpu_plan import device_name, planner_warnings

from packloader import PackedLoader
from packloader.balancers.cost.presets import ModelShape
from packloader.contracts import PlanConfig

LAYERS = 2
VOCAB = 32000


def write_shards(folder: Path, lengths: np.ndarray, seed: int, shards: int = 4) -> list[str]:
    rng = np.random.default_rng(seed)
    paths = []
    for i, part in enumerate(np.array_split(lengths, shards)):
        offsets = np.concatenate([[0], np.cumsum(part)]).astype(np.int32)
        values = rng.integers(0, VOCAB - 1, int(offsets[-1]), dtype=np.int32)
        table = pa.table({"tokens": pa.ListArray.from_arrays(pa.array(offsets), pa.array(values)),
                          "length": pa.array(part.astype(np.int32))})
        path = folder / f"shard-{i:02d}.parquet"
        pq.write_table(table, path, compression="zstd", use_dictionary=False)
        paths.append(str(path))
    return paths


class Step:
    """Embedding + Layers, forward and backward of one micro-batch (the loss: the outputs' mean square)."""

    def __init__(self, ctx: Ctx) -> None:
        self.ctx, shape = ctx, model_shape(ctx)
        torch.manual_seed(ctx.seed)
        self.emb = torch.nn.Embedding(VOCAB, shape.hidden).to(ctx.device, ctx.dtype)
        self.layers = Layers(shape, LAYERS).to(ctx.device, ctx.dtype)

    def __call__(self, batch) -> int:
        dev = self.ctx.device
        ids = batch.input_ids.to(dev, non_blocking=True)
        q = [s.end - s.start for s in batch.segments]
        pack = Pack(q, [0] * len(q), dev, self.ctx.backend)
        y = self.layers(self.emb(ids), batch.position_ids.to(dev, non_blocking=True), pack)
        y.float().pow(2).mean().backward()
        return int(ids.numel())


def model_shape(ctx: Ctx):
    """The layer the step runs: one whose whole model fits one GPU (the dry run's tiny one on CPU)."""
    return SHAPE_TINY if ctx.dry_run else SHAPE_1B


def plan_model(ctx: Ctx) -> str:
    """PlanConfig.model for that model: its shape as a spec string (the data's vocabulary prices the head)."""
    s = model_shape(ctx)
    return ModelShape(name=s.name, hidden=s.hidden, layers=s.layers or LAYERS, heads=s.heads, kv_heads=s.kv_heads,
                      ffn=s.ffn, vocab=s.vocab or VOCAB, head_size=s.head_dim).spec()


def _loader(paths, cfg) -> PackedLoader:
    return PackedLoader(paths, tokenizer=None, config=cfg, seed=0, num_threads=2, prefetch=4, append_eos=False)


def _rate(it, consume, n: int, sync) -> tuple[float, float, int]:
    """(tokens/s, share of wall time spent in next(it), batches) over the first `n` items."""
    waited, tokens, done = 0.0, 0, 0
    t0 = time.perf_counter()
    while done < n:
        w = time.perf_counter()
        try:
            b = next(it)
        except StopIteration:
            break
        waited += time.perf_counter() - w
        tokens += consume(b)
        done += 1
    sync()
    wall = time.perf_counter() - t0
    return tokens / wall, waited / wall, done


def run(ctx: Ctx, budget: Budget, out_dir) -> dict:
    dry = ctx.dry_run
    cap, tps, n = (64, 512, 6) if dry else (16384, 131072, 64)
    lengths = np.minimum(long_tail_lengths(20000 if dry else 60000, ctx.seed, scale=1 / 256 if dry else 1.0), cap * 4)
    cfg = PlanConfig(strategy="auto", max_tokens=cap, context=cap, tokens_per_step=tps, allow_slicing=False,
                     model=plan_model(ctx), device=device_name(ctx))
    step = Step(ctx)
    with tempfile.TemporaryDirectory() as tmp, planner_warnings() as warnings:
        paths = write_shards(Path(tmp), lengths, ctx.seed)
        alone = _rate(iter(_loader(paths, cfg)), lambda b: b.input_ids.to(ctx.device).numel(), n, ctx.sync)
        budget.check("loader alone")
        batches = [b for _, b in zip(range(n), iter(_loader(paths, cfg)))]
        step(batches[0])  # warm-up
        ctx.sync()
        gpu = _rate(iter(batches), step, len(batches), ctx.sync)
        budget.check("step alone")
        both = _rate(iter(_loader(paths, cfg)), step, n, ctx.sync)
    layers_full = model_shape(ctx).layers or LAYERS
    return {"model": model_shape(ctx).name, "plan_model": cfg.model, "device": cfg.device,
            "plan_warnings": sorted(set(warnings))[:20], "micro_batch_tokens": cap, "batches": n, "layers_timed": LAYERS,
            "loader_tokens_per_s": alone[0], "consumed_tokens_per_s": gpu[0],
            "consumed_tokens_per_s_full_model": gpu[0] * LAYERS / layers_full,
            "together_tokens_per_s": both[0], "together_wait_share": both[1],
            "keeps_up": bool(alone[0] > gpu[0] * LAYERS / layers_full)}
