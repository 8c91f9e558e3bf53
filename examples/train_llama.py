"""Train a small Llama-style model on CPU from Parquet token shards through packloader, once per planner and
seed, and compare held-out loss against the `fixed` baseline.

    python examples/train_llama.py --out runs/llama --seeds 0,1,2          # fixed, auto, wlb: ~40 s a run on 2 cores
    python examples/train_llama.py --out /tmp/tiny --tiny                  # CI size, well under a minute
    python examples/train_llama.py --out /tmp/cp --tiny --planners fixed --cp 2   # Zeppelin CP over 2 gloo ranks
    python examples/train_llama.py --out /tmp/dc --tiny --planners fixed --cp 2 --dp 2   # 2 DP x 2 CP, 4 ranks
    python examples/train_llama.py --out /tmp/pp --tiny --pp 2                    # 2 pipeline stages, sliced plans
    python examples/train_llama.py --out /tmp/zb --tiny --pp 2 --schedule zb-h1   # the same, zero-bubble ZB-H1
    python examples/train_llama.py --out /tmp/zv --tiny --pp 2 --vpp 2 --schedule zb-v  # two chunks a rank, ZB-V

Data: the Python standard library's source files (no download), cut into top-level definitions (a long-tailed
mix of short and long documents), tokenized with packloader's default tokenizer (tekken) by
``packloader.sources.pretokenize.tokenize_to_parquet`` into train and held-out Parquet shards (split by
``--data-seed``, the same for every seed). The model's vocabulary is the ``--vocab`` - 1 most frequent token ids of
the training shards plus one id for all others (a 131k-entry output layer would dominate CPU time); this is a fixed
relabelling of the same tokens for every run.

Model: ``transformers.LlamaConfig`` at random init (seeded), attention through packloader's runtime
``varlen_attention`` (registered with transformers as ``packloader_varlen``; the CPU reference backend here), fed the
packed batches with ``cu_seq_lens``. Loss: summed over tokens and divided by the loss tokens of the whole step,
one AdamW step per packloader step.

A fair comparison: every run trains whole epochs (``--epochs``; the loader flushes what a planner still holds at an
epoch's end), so every planner trains exactly the same tokens, each once per epoch; the LR schedule (warmup, cosine)
is a function of tokens trained, not of steps; the held-out loss is measured at the end. For one seed, every planner
run starts from the same init and draws the same documents in the same order; only the packing (and, for wlb, the
outlier delay, which also changes how many steps the epoch takes) differs. Outputs in ``--out``: ``curves.json``
(per run: per-step loss and tokens, held-out loss; per planner: mean and spread over seeds and the paired
difference to `fixed`), ``curves.png``, and the shards.

``--cp N`` trains with Zeppelin's hierarchical context parallelism over N gloo processes (started with
``torch.distributed.run``): every rank reads the same micro-batches, runs the linear layers on its equal share of
the tokens and attention in the hierarchical layout (``packloader.runtime.zeppelin``: short documents whole on one
rank, long ones sharded, activations remapped by all-to-all), and the ranks' gradient shares are summed before
each optimizer step; ``--cp-mode`` picks the attention layout (hierarchical, document, sequence) and
``--cp-threshold`` the length from which hierarchical shards a document. Same data, init and LR schedule as the
single-process run, so the loss curves agree up to float32 summation order. With ``--dp M`` as well, the
``M x N`` processes form M data-parallel replicas (each its own loader shard, ``dp_rank``) of N CP ranks each; the
CP groups are created once through ``packloader.runtime.groups.ProcessGroupCache`` (every rank, the same order)
and each micro-batch's ``ZeppelinContext`` runs over this rank's group. Since the loss is normalised by the loss
tokens of the whole global step, the gradient shares of every rank (CP shares and DP replicas alike) are summed
over the world. ``--dp M`` alone is plain data parallelism, the reference a ``--cp N --dp M`` run must match.

``--pp N`` trains through N pipeline stages on N gloo processes (``packloader.runtime.pipeline``): the loader plans
with ``ParallelConfig(pp=N)`` and slicing allowed (default planner ``slimpack``), the decoder layers are split
evenly over the stages (embedding on the first, norm and LM head on the last), each stage's attention runs the
micro-batch's slice context (a later slice reads the earlier slices' keys from the stage's carried KV), and a step's
micro-batches run through ``PlanPipelineSchedule`` in the order the planner's simulator scored (the plan's
backward order, from ``batch.plan``; rank 0's executed order per step is in ``pipeline_orders``); the
loss is normalised over the step's loss tokens, and each stage takes one AdamW step per packloader step (tied embedding gradient summed between the first and last stage,
gradient-norm clip over all stages). Every rank builds the whole model from the seed and keeps its stage, so the
init is the single-process run's. ``--pp N --pp-whole`` is the unsliced run it must match: one process, the same
plans, each step's documents rejoined from their slices and run whole through the unsplit model. ``--schedule``
(``1f1b``, ``zb-h1``, ``auto``) is the plans' ``PlanConfig.schedule``: each step runs exactly the action lists
``packloader plan`` writes for it (``planned_actions``; under ZB-H1 a "B" is the input gradient and a "W" the
weight gradient; rank 0's written and executed lists per step, and the schedule each step ran, are in
``pipeline_actions``). ``--pp N --vpp 2`` gives each rank two model chunks (``ParallelConfig(vpp=2)``, the
layers split over 2N stages): ``--schedule interleaved`` (the default there), ``zb-h1`` (interleaved zero
bubble), ``zb-v`` or ``auto``. Interleaved schedules place stages r and N + r on rank r, ZB-V stages r and
2N-1-r; each rank builds the stages of the placement a step's schedule needs, so ``auto`` may switch per step,
and every rank keeps the whole model in step (gradients summed over the ranks, the same AdamW step everywhere).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from pathlib import Path

import numpy as np
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# ----------------------------------------------------------------------------------------------- data


def stdlib_definitions(max_files: int, min_chars: int = 40) -> list[str]:
    """Top-level definitions (and the module text between them) of the first `max_files` stdlib files."""
    from packloader import stdlib_corpus

    src = stdlib_corpus()
    texts: list[str] = []
    files = 0
    for shard, info in enumerate(src.shards):
        for text in src.read(shard, np.arange(info.num_rows)):
            parts = re.split(r"\n(?=(?:def|class|async def) )", text)
            texts.extend(p for p in parts if len(p) >= min_chars)
            files += 1
            if files >= max_files:
                return texts
    return texts


def write_shards(out: Path, max_files: int, valid_fraction: float, seed: int) -> tuple[list[str], list[str]]:
    """Tokenize the corpus into train/ and valid/ Parquet shards (reused when present)."""
    from packloader.sources.base import IterableSource
    from packloader.sources.pretokenize import tokenize_to_parquet
    from packloader.sources.tokenizers import get_tokenizer

    train_dir, valid_dir = out / "shards" / "train", out / "shards" / "valid"
    if not (train_dir.exists() and any(train_dir.glob("part-*.parquet"))):
        texts = stdlib_definitions(max_files)
        rng = np.random.default_rng(seed)
        is_valid = rng.random(len(texts)) < valid_fraction
        tok = get_tokenizer()
        for d, sel in ((train_dir, ~is_valid), (valid_dir, is_valid)):
            docs = [t for t, s in zip(texts, sel) if s]
            tokenize_to_parquet(IterableSource(docs), tok, d, overwrite=True, progress=False)
    return (sorted(str(p) for p in train_dir.glob("part-*.parquet")),
            sorted(str(p) for p in valid_dir.glob("part-*.parquet")))


def vocab_map(paths: list[str], size: int) -> np.ndarray:
    """Tokenizer id -> model id: the `size` - 1 most frequent ids of `paths` get 1..size-1, every other id 0."""
    import pyarrow.parquet as pq

    counts: dict[int, int] = {}
    for p in paths:
        col = pq.read_table(p, columns=["tokens"]).column("tokens").combine_chunks()
        ids, c = np.unique(col.values.to_numpy(), return_counts=True)
        for i, k in zip(ids.tolist(), c.tolist()):
            counts[i] = counts.get(i, 0) + k
    top = sorted(counts, key=lambda i: (-counts[i], i))[: size - 1]
    table = np.zeros(max(counts) + 1 if counts else 1, dtype=np.int64)
    table[np.array(top, dtype=np.int64)] = np.arange(1, len(top) + 1)
    return table


# ----------------------------------------------------------------------------------------------- model


def build_model(args, vocab: int):
    import transformers

    from packloader_integrations.hf import register_packloader_attention

    name = register_packloader_attention()
    torch.manual_seed(args.seed)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 3,
                                   num_hidden_layers=args.layers, num_attention_heads=args.heads,
                                   num_key_value_heads=max(1, args.heads // 2), max_position_embeddings=args.context,
                                   use_cache=False, tie_word_embeddings=True)
    return transformers.LlamaForCausalLM._from_config(cfg, attn_implementation=name, dtype=torch.float32)


def remap(t: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    ok = t >= 0
    out = t.clone()
    out[ok] = table[t[ok].clamp(max=table.numel() - 1)]
    out[ok & (t >= table.numel())] = 0
    return out


def micro_batch_loss_sum(model, batch, table: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Summed next-token loss of one packed micro-batch (packloader's labels) and its loss-token count."""
    from packloader_integrations.hf import hf_batch

    inputs = hf_batch(batch, attention="varlen")
    labels = remap(inputs.pop("shift_labels"), table)
    inputs.pop("labels")
    inputs["input_ids"] = remap(inputs["input_ids"], table)
    logits = model(**inputs).logits[0]
    loss = torch.nn.functional.cross_entropy(logits, labels[0], ignore_index=-100, reduction="sum")
    return loss, int((labels != -100).sum())


def cp_micro_batch_loss_sum(model, batch, table: torch.Tensor, args) -> tuple[torch.Tensor, int]:
    """This CP rank's share of a micro-batch's summed loss under Zeppelin's layout remapping: its linear-layout
    tokens through the model, attention remapped (packloader's transformers attention runs the context)."""
    from packloader.runtime.zeppelin import ZeppelinContext

    opts = {"hierarchical_threshold": args.cp_threshold} if args.cp_mode == "hierarchical" and args.cp_threshold else {}
    ctx = ZeppelinContext(batch.segments, group=_DIST.get("cp_group"), mode=args.cp_mode, **opts)
    ids = remap(ctx.local(batch.input_ids), table)
    labels = remap(ctx.local(batch.labels), table)
    with ctx.active():
        logits = model(input_ids=ids[None], position_ids=ctx.local(batch.position_ids)[None], use_cache=False).logits[0]
    loss = torch.nn.functional.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")
    return loss, int((labels != -100).sum())


class LlamaStage(torch.nn.Module):
    """Decoder layers lo..hi-1 of a transformers Llama as one pipeline stage, token-major (`[T, hidden]` between
    stages): the embedding on the first stage, norm and LM head on the last. The modules are the full model's
    own (same parameters); attention goes through packloader's transformers attention, which runs the
    micro-batch's slice context (`SlicedPipelineStage` activates it) with the layer's global index as the key."""

    def __init__(self, model, lo: int, hi: int, first: bool, last: bool):
        super().__init__()
        inner = model.model
        self.first, self.last = first, last
        self.embed = inner.embed_tokens if first else None
        self.layers = torch.nn.ModuleList(inner.layers[lo:hi])
        self.rotary = inner.rotary_emb
        self.norm = inner.norm if last else None
        self.head = model.lm_head if last else None

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.embed(x)
        h, pos = x[None], position_ids[None]
        pe = self.rotary(h, pos)
        for layer in self.layers:
            h = layer(h, position_ids=pos, position_embeddings=pe, use_cache=False)
            h = h[0] if isinstance(h, tuple) else h
        if self.last:
            return self.head(self.norm(h[0]))
        return h[0].clone()  # not a view: a split backward (ZB) detaches a middle stage's output in place


def stage_cuts(layers: int, pp: int) -> list[tuple[int, int]]:
    """Decoder layers per stage, as even as possible; every stage needs one (its slices' keys live there)."""
    if layers < pp:
        raise ValueError(f"{pp} pipeline stages (--pp x --vpp) need at least {pp} decoder layers (--layers "
                         f"{layers}): every stage runs attention")
    cuts = np.linspace(0, layers, pp + 1).round().astype(int)
    return [(int(cuts[i]), int(cuts[i + 1])) for i in range(pp)]


def whole_documents(micro_batches) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """A step's micro-batches with every sliced document rejoined: (input ids, labels, position ids, cu_seqlens,
    max length) of one packed sequence of whole documents (and context pieces), in order of first appearance. A
    slice belongs to the piece it attends from (`(doc, attend_from)`); its pieces must tile it without gaps."""
    parts: dict[tuple[int, int], list] = {}
    for b in micro_batches:
        cu = b.cu_seqlens.long().tolist()
        for i, s in enumerate(b.segments):
            sl = slice(cu[i], cu[i + 1])
            parts.setdefault((s.doc, s.attend_from), []).append(
                (s.start, s.end, b.input_ids[sl], b.labels[sl], b.position_ids[sl]))
    ids, labels, pos, lens = [], [], [], []
    for (doc, attend_from), ps in parts.items():
        ps.sort(key=lambda p: p[0])
        at = attend_from
        for start, end, *_ in ps:
            if start != at:
                raise ValueError(f"document {doc}: its slices in this step leave tokens {at}..{start - 1} out")
            at = end
        ids += [p[2] for p in ps]
        labels += [p[3] for p in ps]
        pos += [p[4] for p in ps]
        lens.append(at - attend_from)
    cu = torch.tensor([0] + np.cumsum(lens).tolist(), dtype=torch.int32)
    return torch.cat(ids), torch.cat(labels), torch.cat(pos), cu, max(lens)


def whole_step_loss_sum(model, micro_batches, table: torch.Tensor) -> torch.Tensor:
    """Summed next-token loss of a step's documents run whole (slices rejoined) through the unsplit model: plain
    varlen attention, no KV carry, no pipeline."""
    ids, labels, pos, cu, longest = whole_documents(micro_batches)
    logits = model(input_ids=remap(ids, table)[None], position_ids=pos[None], cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                   max_length_q=longest, max_length_k=longest, use_cache=False).logits[0]
    return torch.nn.functional.cross_entropy(logits, remap(labels, table), ignore_index=-100, reduction="sum")


def planned_rank_plan(micro_batches, dp_rank: int = 0):
    """The RankPlan the pipeline runs for one step: this rank's non-empty micro-batches with the backward order
    the planner chose and its simulator scored (`batch.plan`, None: the simulator's default), restricted
    to them (an empty slot has no work on any stage, so dropping it keeps the others' relative order)."""
    from packloader.contracts import MicroBatch, RankPlan

    keep = [j for j, b in enumerate(micro_batches) if b.num_tokens]
    mbs = [MicroBatch(segments=list(micro_batches[j].segments)) for j in keep]
    plan = micro_batches[0].plan if micro_batches else None
    if plan is None:
        return RankPlan(micro_batches=mbs)
    rp = plan.ranks[dp_rank]
    if len(rp.micro_batches) != len(micro_batches) or any(
            list(rp.micro_batches[j].segments) != list(micro_batches[j].segments) for j in keep):
        raise ValueError(f"step {plan.step}: the micro-batches are not those the plan gives DP rank {dp_rank}")
    if rp.backward_order is None:
        return RankPlan(micro_batches=mbs)
    at = {j: i for i, j in enumerate(keep)}
    return RankPlan(micro_batches=mbs, backward_order=[at[j] for j in rp.backward_order if j in at])


def planned_actions(micro_batches, config, dp_rank: int = 0) -> list:
    """The action lists `packloader plan` writes for this step and DP rank (per pipeline rank [[op, micro_batch,
    stage], ...], "W" under ZB-H1 or where `auto` chose it), empty slots dropped and the others renumbered as in
    `planned_rank_plan` (an empty slot's actions are no work on any stage; the rest keep their order)."""
    from packloader.balancers.cost.lookup import cost_model_for
    from packloader.balancers.sim.actions import step_actions

    plan = micro_batches[0].plan
    lists = step_actions(plan, cost_model_for(config), config.parallel, schedule=config.schedule)[dp_rank]
    at = {j: i for i, j in enumerate(j for j, b in enumerate(micro_batches) if b.num_tokens)}
    return [[[op, at[u], st] for op, u, st in lst if u in at] for lst in lists]


class PipelineRun:
    """This process's pipeline stages of the `--pp` run: its share of the full model (built whole with the seed on
    every rank, so each stage's parameters are exactly the single-process run's), the engine stages and the
    plan schedule. At vpp 1 the rank owns its stage: the tied embedding / LM head weight lives on the first and
    last stage, its two gradient shares summed between them (as Megatron's embedding group does). At `--vpp 2`
    the rank runs two model chunks, placed as the step's schedule wants (interleaved and interleaved zero bubble:
    stages r and pp + r; ZB-V: r and 2*pp-1-r, so `auto` may switch per step); every rank then keeps the whole
    model in step: each parameter's gradient is summed over the ranks (only the ranks that ran it add to it)
    and every rank takes the same AdamW step."""

    def __init__(self, model, args):
        import torch.distributed as dist

        self.model, self.pp, self.vpp, self.rank = model, args.pp, args.vpp, dist.get_rank()
        self.cuts = stage_cuts(args.layers, args.pp * args.vpp)
        self._runs: dict[bool, tuple] = {}
        self.stage, self.schedule = self._placement(False)[0][0], self._placement(False)[1]
        if self.vpp > 1:  # the whole model, synchronised every step
            self.params = list(dict.fromkeys(model.parameters()))
            self.tied = None
        else:
            self.module = self.stage.submod
            self.params = list(dict.fromkeys(self.module.parameters()))
            self.tied = model.lm_head.weight if model.config.tie_word_embeddings else None
        self.tied_group = dist.new_group([0, args.pp - 1]) if self.tied is not None else None
        # owner of every parameter of the full model at vpp 1 (the tied weight: the first stage), for gather()
        self.owner = {}
        for r, (lo, hi) in enumerate(self.cuts):
            for i in range(lo, hi):
                for q in model.model.layers[i].parameters():
                    self.owner[q] = r
        for q in model.model.norm.parameters():
            self.owner[q] = args.pp - 1
        for q in model.lm_head.parameters():
            self.owner[q] = args.pp - 1
        for q in model.model.embed_tokens.parameters():
            self.owner[q] = 0
        self.sliced_steps = 0
        self.orders: list[list] = []  # per step, this stage's executed (F/B, micro-batch, chunk) order
        self.written: list[list] = []  # per step, this stage's written action list ([op, micro_batch, stage])
        self.executed: list[list] = []  # per step, what this stage ran, in the same form
        self.schedules: list[str] = []  # per step, the schedule it ran

    def _placement(self, v_shape: bool):
        """This rank's stages and their schedule for one placement (built on first use, the same step on every
        rank: the plans are the same everywhere)."""
        from packloader.runtime.pipeline import PlanPipelineSchedule, SlicedPipelineStage
        from packloader.runtime.pipeline_actions import rank_stages

        got = self._runs.get(v_shape)
        if got is None:
            n = self.pp * self.vpp
            hidden = self.model.config.hidden_size
            stages = []
            for st in rank_stages(self.rank, self.pp, self.vpp, v_shape):
                first, last = st == 0, st == n - 1
                out = self.model.config.vocab_size if last else hidden
                stages.append(SlicedPipelineStage(
                    LlamaStage(self.model, *self.cuts[st], first, last), st, n, "cpu",
                    input_example=torch.zeros(1, dtype=torch.long) if first else torch.zeros(1, hidden),
                    output_example=torch.zeros(1, out)))
            default = "1f1b" if self.vpp == 1 else ("zb-v" if v_shape else "interleaved")
            got = self._runs[v_shape] = (stages, PlanPipelineSchedule(stages, self._loss, schedule=default))
        return got

    @staticmethod
    def _loss(logits, target):
        labels, n_step = target
        return torch.nn.functional.cross_entropy(logits, labels, ignore_index=-100, reduction="sum") / n_step

    def step(self, micro_batches, table: torch.Tensor, n_step: int, config) -> float:
        """Forward and backward of one packloader step through the pipeline (the plan's micro-batches run as the
        action lists `packloader plan` writes for `config.schedule`: 1F1B, ZB-H1, interleaved, ZB-V or `auto`'s
        choice; slices carrying their keys per stage); the step's summed loss / `n_step`, on every rank."""
        import torch.distributed as dist

        from packloader.balancers.sim.simulator import plan_schedule

        mbs = [b for b in micro_batches if b.num_tokens]  # an empty slot has nothing to run on any stage
        self.sliced_steps += any(s.attend_from < s.start for b in mbs for s in b.segments)
        losses: list = []
        lists = planned_actions(micro_batches, config)
        chosen = plan_schedule(micro_batches[0].plan, config.schedule, self.vpp)
        self.schedule = self._placement(chosen == "zb-v")[1]
        self.schedule.schedule = chosen
        self.schedule.step_plan(planned_rank_plan(micro_batches), actions=lists,
                                arg_mbs=[(remap(b.input_ids, table),) for b in mbs],
                                kwarg_mbs=[{"position_ids": b.position_ids} for b in mbs],
                                target_mbs=[(remap(b.labels, table), n_step) for b in mbs], losses=losses)
        self.orders.append([list(a) for a in self.schedule.order])
        self.written.append(lists[self.rank])
        self.executed.append([list(a) for a in self.schedule.executed])
        self.schedules.append(chosen)
        if self.vpp > 1:  # every rank gets the whole model's gradient (each share from the ranks that ran it)
            grads = [q.grad if q.grad is not None else torch.zeros_like(q) for q in self.params]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat)
            for q, g in zip(self.params, flat.split([g.numel() for g in grads])):
                q.grad = g.view_as(q).clone()
        elif self.tied is not None and self.pp > 1:
            if self.tied.grad is None:
                self.tied.grad = torch.zeros_like(self.tied)
            dist.all_reduce(self.tied.grad, group=self.tied_group)
        t = torch.tensor([sum(float(l.detach()) for l in losses)], dtype=torch.float64)
        dist.all_reduce(t)  # only the last stage holds losses
        return float(t)

    def clip_grad_norm_(self, max_norm: float) -> None:
        """`torch.nn.utils.clip_grad_norm_` over the whole model: every stage's squared norm summed, the tied
        weight counted once (at vpp > 1 every rank holds the whole gradient)."""
        import torch.distributed as dist

        if self.vpp > 1:
            torch.nn.utils.clip_grad_norm_(self.params, max_norm)
            return
        own = [q for q in self.params if q.grad is not None and self.owner[q] == self.rank]
        sq = torch.tensor([sum(float(q.grad.double().pow(2).sum()) for q in own)], dtype=torch.float64)
        dist.all_reduce(sq)
        coef = min(1.0, max_norm / (math.sqrt(float(sq)) + 1e-6))
        for q in self.params:
            if q.grad is not None:
                q.grad.mul_(coef)

    def gather(self) -> None:
        """Every rank's copy of the full model gets each stage's trained parameters (for the held-out loss); at
        vpp > 1 they are already the same everywhere."""
        import torch.distributed as dist

        if self.vpp > 1:
            return
        for q in dict.fromkeys(self.model.parameters()):
            dist.broadcast(q.data, src=self.owner[q])


def make_loader(paths, args, strategy: str, epochs, *, train: bool = True):
    from packloader import PackedLoader, PlanConfig
    from packloader.contracts import ParallelConfig

    pp, dp = (args.pp, args.dp) if train else (1, 1)  # every rank evaluates the whole held-out set
    cfg = PlanConfig(strategy=strategy, max_tokens=args.max_tokens, context=args.context,
                     tokens_per_step=args.tokens_per_step, allow_slicing=pp > 1,
                     parallel=ParallelConfig(pp=pp, dp=dp, vpp=args.vpp if pp > 1 else 1),
                     schedule=args.schedule if pp > 1 else "1f1b",
                     model=args.cost_model, seed=args.seed)
    return PackedLoader(paths, config=cfg, epochs=epochs, num_threads=0, seed=args.seed,
                        dp_rank=_DIST.get("dp_rank", 0) if train else 0)


def evaluate(model, paths, args, table) -> float:
    model.eval()
    total, n = 0.0, 0
    with torch.no_grad():
        for b in make_loader(paths, args, "fixed", epochs=1, train=False):
            if b.num_tokens == 0:
                continue
            loss, k = micro_batch_loss_sum(model, b, table)
            total, n = total + float(loss), n + k
    model.train()
    return total / max(1, n)


def lr_factor(args, progress: float) -> float:
    """LR multiplier at `progress` (fraction of the run's tokens trained): linear warmup over the first
    `warmup_frac`, then cosine decay to 0.1. A function of tokens, not steps, so runs whose steps hold different
    token counts (a planner that delays documents) follow the same schedule per token."""
    warm = min(1.0, progress / args.warmup_frac) if args.warmup_frac > 0 else 1.0
    return warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def shard_tokens(paths: list[str]) -> int:
    """Tokens in the shards: what one epoch trains (each token once, whatever the packing)."""
    import pyarrow.parquet as pq

    return sum(int(pq.read_table(p, columns=["tokens"]).column("tokens").combine_chunks().value_lengths().to_numpy().sum())
               for p in paths)


def train(args, strategy: str, train_paths, valid_paths, table) -> dict:
    """Whole epochs (the loader flushes what a planner holds at each epoch's end, so every run trains exactly the
    shards' tokens `epochs` times), one AdamW step per packloader step, LR by tokens trained; held-out loss at
    the end."""
    from packloader_integrations.deepspeed import steps

    model = build_model(args, args.vocab)
    pipe = PipelineRun(model, args) if args.pp > 1 and not args.pp_whole else None
    params = pipe.params if pipe else list(model.parameters())
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    total_tokens = args.epochs * shard_tokens(train_paths)
    loader = make_loader(train_paths, args, strategy, epochs=args.epochs)
    curve = []
    skipped = empty_mbs = trained = sliced_steps = 0
    t0 = time.perf_counter()
    for step, micro_batches in enumerate(steps(loader)):
        if args.steps and step >= args.steps:
            break
        n_step = micro_batches[0].loss_tokens_in_step
        step_tokens = sum(b.num_tokens for b in micro_batches)
        empty_mbs += sum(b.num_tokens == 0 for b in micro_batches)
        if n_step == 0:  # nothing to learn from in this step (e.g. only empty micro-batch slots on this rank)
            skipped += 1
            trained += step_tokens
            continue
        for g in opt.param_groups:  # the schedule at the middle of this step's tokens
            g["lr"] = args.lr * lr_factor(args, (trained + step_tokens / 2) / total_tokens)
        opt.zero_grad(set_to_none=True)
        total = 0.0
        if pipe is not None:  # the step through the pipeline stages, slices included
            total = pipe.step(micro_batches, table, n_step, loader.config) * n_step
        elif args.pp_whole:  # the unsliced reference: the step's documents whole, one process
            sliced_steps += any(s.attend_from < s.start for b in micro_batches for s in b.segments)
            loss = whole_step_loss_sum(model, micro_batches, table)
            (loss / n_step).backward()
            total = float(loss.detach())
        else:
            for b in micro_batches:
                if b.num_tokens == 0:  # a planner may leave a micro-batch slot empty: nothing to run
                    continue
                if args.cp > 1:
                    loss, _ = cp_micro_batch_loss_sum(model, b, table, args)
                else:
                    loss, _ = micro_batch_loss_sum(model, b, table)
                (loss / n_step).backward()
                total += float(loss.detach())
        if args.cp > 1 or args.dp > 1:  # each rank holds its tokens' share of the gradient and of the loss
            from packloader.runtime.zeppelin import reduce_gradients

            reduce_gradients(model.parameters())  # over the world: CP shares and DP replicas alike
            t = torch.tensor([total], dtype=torch.float64)
            torch.distributed.all_reduce(t)
            total = float(t)
        trained += step_tokens
        if pipe is not None:
            pipe.clip_grad_norm_(1.0)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        curve.append({"step": step, "loss": total / n_step, "tokens": step_tokens, "trained": trained,
                      "micro_batches": len(micro_batches), "seconds": time.perf_counter() - t0})
        if args.verbose and step % 25 == 0:
            print(f"[{strategy} seed {args.seed}] step {step:4d} loss {total / n_step:.4f} tokens {trained}/{total_tokens} "
                  f"({time.perf_counter() - t0:.1f}s)", file=sys.stderr)
    loader.close()
    orders = actions = None
    if pipe is not None:
        pipe.gather()
        sliced_steps = pipe.sliced_steps
        orders = pipe.orders
        actions = {"written": pipe.written, "executed": pipe.executed, "schedules": pipe.schedules}
    # every rank evaluates its gathered full model (the loader's start is collective over the process group)
    held_out = evaluate(model, valid_paths, args, table) if valid_paths else float("nan")
    return {"strategy": strategy, "seed": args.seed, "curve": curve, "held_out_loss": held_out,
            "sliced_steps": sliced_steps, "pipeline_orders": orders, "pipeline_actions": actions,
            "skipped_empty_steps": skipped, "empty_micro_batches": empty_mbs, "tokens_trained": trained,
            "epoch_tokens": total_tokens // args.epochs, "seconds": time.perf_counter() - t0}


def summarise(runs: list[dict], window: int) -> dict:
    """Per run (key "strategy/seed"): final train loss (mean of the last `window` steps, with the standard error
    of that mean), held-out loss, tokens, steps, micro-batches."""
    out = {}
    for r in runs:
        last = np.array([c["loss"] for c in r["curve"][-window:]])
        out[f"{r['strategy']}/{r['seed']}"] = {
            "strategy": r["strategy"], "seed": r["seed"],
            "final_train_loss": float(last.mean()),
            "final_train_loss_sem": float(last.std(ddof=1) / math.sqrt(len(last))) if len(last) > 1 else float("nan"),
            "first_loss": r["curve"][0]["loss"],
            "held_out_loss": r["held_out_loss"],
            "tokens_trained": r["tokens_trained"],
            "steps": len(r["curve"]) + r["skipped_empty_steps"],
            "micro_batches": sum(c["micro_batches"] for c in r["curve"]),
            "empty_micro_batches": r["empty_micro_batches"],
            "seconds": r["seconds"],
        }
    return out


def compare(runs: list[dict], baseline: str = "fixed") -> dict:
    """Held-out loss per strategy over seeds (mean, sample std) and, against `baseline`, the paired difference
    per seed (mean, std, standard error, t): the gap is "within noise" when |mean difference| is below the
    baseline's own seed-to-seed std and below 2 standard errors of the paired difference."""
    by: dict[str, dict[int, float]] = {}
    for r in runs:
        by.setdefault(r["strategy"], {})[r["seed"]] = r["held_out_loss"]
    out = {}
    base = by.get(baseline, {})
    base_std = float(np.std(list(base.values()), ddof=1)) if len(base) > 1 else float("nan")
    for name, vals in by.items():
        v = np.array(list(vals.values()))
        entry = {"mean": float(v.mean()), "std": float(v.std(ddof=1)) if len(v) > 1 else float("nan"), "seeds": len(v)}
        common = sorted(set(vals) & set(base))
        if name != baseline and common:
            d = np.array([vals[k] - base[k] for k in common])
            sd = float(d.std(ddof=1)) if len(d) > 1 else float("nan")
            se = sd / math.sqrt(len(d)) if len(d) > 1 else float("nan")
            entry.update(diff_mean=float(d.mean()), diff_std=sd, diff_se=se, diffs=d.tolist(),
                         t=float(d.mean() / se) if se and se > 0 else float("nan"),
                         within_noise=bool(abs(d.mean()) <= base_std and abs(d.mean()) <= 2 * se) if len(d) > 1 else None)
        out[name] = entry
    out["_baseline_seed_std"] = base_std
    return out


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    colors = {}
    for r in runs:
        c = colors.setdefault(r["strategy"], f"C{len(colors)}")
        first = r["seed"] == min(x["seed"] for x in runs if x["strategy"] == r["strategy"])
        ax.plot([p["trained"] for p in r["curve"]], [p["loss"] for p in r["curve"]], color=c, lw=1.0, alpha=0.8,
                label=r["strategy"] if first else None)
    ax.set_xlabel("tokens trained")
    ax.set_ylabel("train loss (per token, whole step)")
    ax.set_title("Llama-style model on stdlib definitions, packloader planners (all seeds)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="output directory (shards, curves.json, curves.png)")
    p.add_argument("--planners", default=None,
                   help="comma-separated strategies (default: fixed,auto,wlb; slimpack with --pp, which slices)")
    p.add_argument("--seeds", default="0", help="comma-separated seeds (model init and document order), e.g. 0,1,2")
    p.add_argument("--tiny", action="store_true", help="CI size: few files, a tiny model, one short epoch")
    p.add_argument("--files", type=int, default=40, help="stdlib files to read")
    p.add_argument("--epochs", type=int, default=1, help="whole epochs to train (every run: the same tokens)")
    p.add_argument("--steps", type=int, default=None, help="stop after this many steps (default: whole epochs)")
    p.add_argument("--tokens-per-step", type=int, default=2048)
    p.add_argument("--max-tokens", type=int, default=1024, help="tokens per micro-batch")
    p.add_argument("--context", type=int, default=1024, help="longer documents are cut into pieces")
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup-frac", type=float, default=0.05, help="warmup, as a fraction of the run's tokens")
    p.add_argument("--data-seed", type=int, default=0, help="train / held-out split (the same for every seed)")
    p.add_argument("--cost-model", default="llama3-8b", help="planner cost model preset")
    p.add_argument("--valid-fraction", type=float, default=0.05)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--quiet", dest="verbose", action="store_false")
    p.add_argument("--cp", type=int, default=1, help="Zeppelin context parallelism over this many gloo processes")
    p.add_argument("--cp-mode", default="hierarchical", choices=["hierarchical", "document", "sequence"],
                   help="attention layout under --cp")
    p.add_argument("--cp-threshold", type=int, default=None,
                   help="hierarchical: shard documents of at least this many tokens (default: by cost estimate)")
    p.add_argument("--dp", type=int, default=1,
                   help="data-parallel replicas (gloo processes; with --cp N, N CP ranks each)")
    p.add_argument("--pp", type=int, default=1,
                   help="pipeline parallelism over this many gloo processes (plans pipeline-aware, slices allowed)")
    p.add_argument("--vpp", type=int, default=1,
                   help="with --pp N: model chunks per pipeline rank (virtual pipeline stages; 2 runs interleaved "
                        "1F1B, interleaved zero bubble and ZB-V)")
    p.add_argument("--schedule", default=None, choices=["1f1b", "zb-h1", "interleaved", "zb-v", "auto"],
                   help="with --pp N: the pipeline schedule the plans are scored and run with (PlanConfig.schedule; "
                        "zb-h1 splits each backward into input- and weight-gradient actions, interleaved and zb-v "
                        "need --vpp 2, auto lets the planner choose per step; default 1f1b, interleaved at --vpp 2)")
    p.add_argument("--pp-whole", action="store_true",
                   help="with --pp N: one process, the same plans, each step's documents rejoined and run whole "
                        "through the unsplit model (the unsliced run --pp N must match)")
    args = p.parse_args(argv)
    if args.planners is None:
        args.planners = "slimpack" if args.pp > 1 else "fixed,auto,wlb"
    if args.pp > 1 and (args.cp > 1 or args.dp > 1):
        raise SystemExit("--pp with --cp or --dp is not supported by this example")
    if args.vpp > 1 and args.pp == 1:
        raise SystemExit("--vpp needs --pp N (N > 1)")
    if args.schedule is None:
        args.schedule = "1f1b" if args.vpp == 1 else "interleaved"
    if (args.vpp == 1 and args.schedule in ("interleaved", "zb-v")) or (args.vpp > 1 and args.schedule == "1f1b") \
            or (args.schedule == "zb-v" and args.vpp != 2):
        raise SystemExit(f"--schedule {args.schedule} with --vpp {args.vpp}: 1f1b runs one model chunk per rank, "
                         "interleaved two or more (--vpp), zb-v exactly two (--vpp 2)")
    if args.tiny:
        args.files, args.epochs, args.tokens_per_step = 12, 1, 1024
        args.max_tokens = args.context = 512
        args.vocab, args.hidden, args.layers, args.heads, args.warmup_frac = 512, 32, 1, 2, 0.2
        args.lr = 1e-2
        args.valid_fraction = 0.1
        args.layers = max(args.layers, args.pp * args.vpp)  # one decoder layer per stage
    return args


_DIST: dict = {}  # this process's dp_rank and CP process group (set up once per process)


def setup_data_and_context_parallel(args, rank: int) -> None:
    """Rank r is CP rank r % cp of DP replica r // cp. The CP groups are created once, on every rank in the same
    order (``new_group`` is a collective of the whole world), by packloader's process-group cache."""
    from packloader.runtime.groups import ProcessGroupCache

    dp_rank, _ = divmod(rank, args.cp)
    _DIST["dp_rank"] = dp_rank
    if args.cp > 1:
        groups = ProcessGroupCache()
        members = [[d * args.cp + c for c in range(args.cp)] for d in range(args.dp)]
        groups.create(members)
        _DIST["cp_group"] = groups.get(members[dp_rank])


def launch(args, argv, nproc: int) -> dict:
    """Run this script on `nproc` gloo processes (torch.distributed.run) and return rank 0's result."""
    import subprocess

    argv = list(sys.argv[1:] if argv is None else argv)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(Path(__file__).resolve()), *argv]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    subprocess.run(cmd, check=True, env=env)
    return json.loads((args.out / "curves.json").read_text())


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    train_paths, valid_paths = write_shards(args.out, args.files, args.valid_fraction, args.data_seed)
    nproc = args.cp * args.dp if args.pp == 1 else (1 if args.pp_whole else args.pp)
    if nproc > 1 and "RANK" not in os.environ:
        return launch(args, argv, nproc)
    rank = 0
    if nproc > 1:
        torch.distributed.init_process_group("gloo")
        if torch.distributed.get_world_size() != nproc:
            flag = f"--cp {args.cp} --dp {args.dp}" if args.pp == 1 else f"--pp {args.pp}"
            raise ValueError(f"{flag} but the process group has {torch.distributed.get_world_size()} ranks")
        rank = torch.distributed.get_rank()
        if args.pp == 1:
            setup_data_and_context_parallel(args, rank)
        args.verbose = args.verbose and rank == 0
    table = torch.from_numpy(vocab_map(train_paths, args.vocab))
    runs = []
    for seed in [int(x) for x in args.seeds.split(",") if x.strip()]:
        args.seed = seed
        runs += [train(args, s.strip(), train_paths, valid_paths, table) for s in args.planners.split(",") if s.strip()]
    del args.seed
    window = max(2, min(len(r["curve"]) for r in runs) // 10)
    result = {
        "command": " ".join(["python", "examples/train_llama.py"] + (sys.argv[1:] if argv is None else list(argv))),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "summary": summarise(runs, window),
        "comparison": compare(runs),
        "runs": runs,
    }
    if nproc > 1:
        torch.distributed.destroy_process_group()
        if rank != 0:
            return result
    (args.out / "curves.json").write_text(json.dumps(result, indent=1))
    plot(runs, args.out / "curves.png")
    if args.verbose:
        for name, s in result["summary"].items():
            print(f"{name:>10}: final train loss {s['final_train_loss']:.4f} +- {s['final_train_loss_sem']:.4f} "
                  f"(last {window} steps), held-out {s['held_out_loss']:.4f}, {s['tokens_trained']} tokens, "
                  f"{s['steps']} steps, {s['micro_batches']} micro-batches ({s['empty_micro_batches']} empty), "
                  f"{s['seconds']:.0f}s", file=sys.stderr)
        for name, c in result["comparison"].items():
            if not name.startswith("_"):
                one = c["seeds"] < 2  # one seed: no spread to show (the std and t would print as nan)
                extra = "" if "diff_mean" not in c else (
                    f"; vs fixed {c['diff_mean']:+.4f}" + (" (one seed: no noise estimate)" if one else
                                                           f" (std {c['diff_std']:.4f}, t {c['t']:.2f}, within noise: "
                                                           f"{c['within_noise']})"))
                spread = "" if one else f" +- {c['std']:.4f}"
                print(f"{name:>10}: held-out {c['mean']:.4f}{spread} over {c['seeds']} seed{'' if one else 's'}{extra}",
                      file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
