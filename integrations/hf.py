"""Hugging Face adapter: packloader micro-batches on transformers models' packed path, and a Trainer that trains
from a packloader loader with the loss normalised per token over the whole optimizer step.

Batches (``hf_batch``), all ``[1, T]``:

* ``input_ids``, ``position_ids`` (restart at 0 at every document and every independent piece of a document
  longer than the context), ``shift_labels`` (packloader's labels: the target of every token, -100 at a
  document's last token; a piece's last token predicts the next piece's first) and ``labels`` in the Hugging Face
  convention (unshifted, -100 at each segment's first token and on padding), for code that shifts labels itself;
  they cannot hold a piece's last target, which lies outside the row. transformers' causal-LM loss uses
  ``shift_labels`` when it is given.
* ``attention="position_ids"`` (default): nothing else. transformers (>= 4.53) detects packed sequences from
  position ids that do not increase by one (``find_packed_sequence_indices``) and masks attention per document with
  sdpa, eager and flex attention, but only without a KV cache: the batch carries ``use_cache=False`` (with
  ``config.use_cache=True`` Llama creates a cache even in training, and the packed detection is silently skipped:
  attention then crosses documents). This needs every segment boundary to show in the positions; ``hf_batch`` checks
  that: every segment starts at position 0 (transformers' flash-attention path starts a sequence exactly where a
  position is 0, ``prepare_fa_kwargs_from_position_ids``) and is followed by one that does not continue it (the
  sdpa/eager/flex path, ``find_packed_sequence_indices``); a batch where either inference misses a boundary is
  refused.
* ``attention="varlen"``: also ``cu_seq_lens_q/k`` (int32) and ``max_length_q/k`` (ints), the flash-attention
  varlen keyword arguments of transformers' ``flash_attention_2`` path, and of the ``"packloader_varlen"``
  attention that ``register_packloader_attention()`` adds (packloader's ``varlen_attention``: any device, CPU
  reference backend included).

``PackedTrainer(model=..., args=..., packed_loader=loader)`` is a ``transformers.Trainer`` whose training data are
the loader's micro-batches. One packloader step is one optimizer step: ``gradient_accumulation_steps`` must equal
the micro-batches per step (``PlanConfig(num_micro_batches=...)``, checked every step), and the loss of every
micro-batch is its token-loss sum divided by the step's loss tokens over all ranks (``loss_tokens_in_step``),
which makes the step's gradient the per-token mean over the global step. ``args.max_steps`` must be set (the
loader has no length).

Checkpoints hold each process's loader state and ``train(resume_from_checkpoint=...)`` continues the stream from it
(the Trainer's own batch skip is off); the logs carry the data's epoch, tokens per second and the loader's step
metrics: ``hf_resume``.

Empty micro-batches: planners give every DP rank the same number of micro-batches per step, so a rank with fewer
pieces than the fullest one gets empty slots. ``hf_batch`` turns one into a one-token padding row with no loss
target, which PackedTrainer runs like any other: zero loss and zero gradient, but a real forward and backward, so
under DDP this rank still joins the gradient all-reduce at the end of the accumulation window (skipping it would
leave the other ranks waiting in that all-reduce).

Sliced plans (SlimPack: a document longer than a micro-batch cut into slices whose later slices attend to the
earlier ones' keys and values, ``Segment.attend_from < start``): ``PackedTrainer`` runs a step holding slices
through ``packloader.runtime.slices.SliceExecutor`` (forward in order with a KV cache of the earlier slices,
backward in reverse with recomputation), so the step's gradient is that of the documents run whole. The model's
attention must be ``register_packloader_attention()``'s (``packloader_attention_forward`` routes every layer's
attention through the executor's ``SliceContext``); the check names the setting otherwise. Single process or DDP
(the executor's gradients are averaged over ranks once per step, as DDP would); not with FSDP, DeepSpeed or fp16
loss scaling, which are refused with the setting to change. ``hf_batch`` alone still refuses slices: a model
called on one micro-batch cannot see another micro-batch's keys.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import torch

from packloader.collate.batch import PackedBatch

from ._common import check_micro_batches, flat, placeholder_batch, refuse_dp_merge, refuse_slices, unshifted_labels
from ._lazy import require
from .entry_loss import token_entries
from .hf_entry_loss import _EntryLossMixin
from .hf_resume import _ResumeMixin

SEGMENTS_KEY = "segments"  # in META_KEY: the segments of a micro-batch of a sliced step (for SliceExecutor)
ALL_SEGMENTS_KEY = "all_segments"  # in META_KEY: the segments of a micro-batch of a step without slices

ATTENTION_MODES = ("position_ids", "varlen")
META_KEY = "packloader_meta"
ATTN_NAME = "packloader_varlen"

__all__ = ["hf_batch", "register_packloader_attention", "packloader_attention_forward", "HFBatches", "PackedTrainer"]  # noqa: F822 (PackedTrainer: module __getattr__, built when transformers loads)


def _boundaries_from_positions(pos: torch.Tensor) -> torch.Tensor:
    """Segment starts as transformers' mask path infers them: where the position does not increase by one."""
    starts = torch.ones_like(pos, dtype=torch.bool)
    if pos.numel() > 1:
        starts[1:] = torch.diff(pos) != 1
    return torch.nonzero(starts).view(-1)


def _starts_at_zero(pos: torch.Tensor) -> torch.Tensor:
    """Segment starts as transformers' flash-attention path infers them: where the position is 0."""
    return torch.nonzero(pos == 0).view(-1)


def hf_batch(batch: PackedBatch, *, attention: str = "position_ids", include_meta: bool = False,
             pad_id: int = 0) -> dict[str, Any]:
    """One PackedBatch -> keyword arguments of a transformers causal LM on its packed path (see the module). An
    empty micro-batch becomes a one-token row of `pad_id` without a loss target (`placeholder_batch`)."""
    if attention not in ATTENTION_MODES:
        raise ValueError(f"attention must be one of {ATTENTION_MODES}, got {attention!r}")
    refuse_slices(batch, "a transformers model")
    refuse_dp_merge(batch, "a transformers model (hf_batch, PackedTrainer)")
    tokens = batch.num_tokens
    if tokens == 0:
        batch = placeholder_batch(batch, 1, pad_id)
    ids, pos = flat(batch.input_ids), flat(batch.position_ids)
    out: dict[str, Any] = {
        "input_ids": ids.unsqueeze(0),
        "position_ids": pos.unsqueeze(0),
        "labels": unshifted_labels(batch).unsqueeze(0),
        "shift_labels": flat(batch.labels).unsqueeze(0),
        # transformers only looks for packed sequences when no KV cache exists, and a model with
        # config.use_cache=True creates one even in training
        "use_cache": False,
    }
    offsets = batch.cu_seqlens_padded if batch.cu_seqlens_padded is not None else batch.cu_seqlens
    if attention == "position_ids":
        expected = offsets[:-1].long()
        expected = expected[torch.diff(offsets.long()) > 0]
        for got in (_boundaries_from_positions(pos), _starts_at_zero(pos)):
            if not torch.equal(got, expected):
                raise ValueError(
                    f"step {batch.step}, micro-batch {batch.index_in_step}: segment starts {expected.tolist()} cannot "
                    f"be recovered from position_ids (they give {got.tolist()}): a segment does not start at "
                    "position 0 or continues the previous one's positions. Use hf_batch(..., attention='varlen') "
                    "with a varlen attention implementation"
                )
    else:
        out["cu_seq_lens_q"] = offsets.to(torch.int32)
        out["cu_seq_lens_k"] = offsets.to(torch.int32)
        out["max_length_q"] = int(batch.max_seqlen)
        out["max_length_k"] = int(batch.max_seqlen_k)
    if include_meta:
        out[META_KEY] = _meta(batch, tokens)
    return out


def _meta(batch: PackedBatch, tokens: int) -> dict[str, Any]:
    """What PackedTrainer needs to know of a micro-batch besides its tensors: its place in the step, the step's
    loss normaliser, its `tokens` (0 for an empty slot's padding row), the data's epoch and the step's metrics."""
    stats = batch.stats
    return {"step": batch.step, "index_in_step": batch.index_in_step,
            "micro_batches_in_step": batch.micro_batches_in_step, "loss_tokens_in_step": batch.loss_tokens_in_step,
            "num_loss_tokens": batch.num_loss_tokens, "num_tokens": tokens, "epoch": batch.epoch,
            "documents": None if stats is None else stats.documents, "entry_names": batch.entry_names,
            "token_entries": token_entries(batch),  # a mixture's entry of each token (packloader/loss/<entry> logs)
            "step_metrics": getattr(batch, "step_metrics", None)}  # the loader's StepMetrics, where it has them


def packloader_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """A transformers attention function running packloader's ``varlen_attention``: ``query [1, H, T, D]``,
    ``key/value [1, Hkv, T, D]`` -> ``([1, T, H, D], None)``. Segments from ``cu_seq_lens_q/k`` when given, else from
    ``position_ids`` (a new segment wherever positions do not increase by one). Inside a ``SliceExecutor`` step
    (``current_slice_context()`` set) the executor's context runs it instead, with the earlier slices' keys and
    values, the layer identified by ``module.layer_idx``; inside a ``packloader.runtime.zeppelin.ZeppelinContext``
    the rows are this rank's linear-layout tokens and the context runs Zeppelin's remapped CP attention."""
    from packloader.runtime.attention import varlen_attention
    from packloader.runtime.slices import current_slice_context
    from packloader.runtime.zeppelin import current_zeppelin_context

    ctx = current_slice_context() or current_zeppelin_context()
    if ctx is not None:
        if query.shape[0] != 1:
            raise ValueError(f"packed attention takes batch size 1 ([1, T] inputs), got {query.shape[0]}")
        out = ctx.attention(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
                            getattr(module, "layer_idx", None), softmax_scale=scaling)
        return out.unsqueeze(0), None

    if query.shape[0] != 1:
        raise ValueError(f"packed attention takes batch size 1 ([1, T] inputs), got {query.shape[0]}")
    if attention_mask is not None and attention_mask.dim() == 2 and not bool(attention_mask.all()):
        raise ValueError("packloader_varlen attention takes packed inputs without padding masks")
    T = query.shape[2]
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is None:
        pos = kwargs.get("position_ids")
        if pos is None:
            cu_q = torch.tensor([0, T], dtype=torch.int32, device=query.device)
        else:
            starts = _boundaries_from_positions(pos.reshape(-1))
            cu_q = torch.cat([starts, torch.tensor([T], device=starts.device)]).to(torch.int32)
        cu_k = cu_q
        max_q = max_k = int(torch.diff(cu_q).max()) if cu_q.numel() > 1 else 0
    else:
        cu_k = cu_q if cu_k is None else cu_k
        max_q = int(kwargs.get("max_length_q") or int(torch.diff(cu_q).max()))
        max_k = int(kwargs.get("max_length_k") or int(torch.diff(cu_k).max()))
    q = query[0].transpose(0, 1)
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    out = varlen_attention(q, k, v, cu_q.to(query.device, torch.int32), cu_k.to(query.device, torch.int32),
                           max_q, max_k, causal=True, softmax_scale=scaling)
    return out.unsqueeze(0), None


def register_packloader_attention(name: str = ATTN_NAME) -> str:
    """Register ``packloader_attention_forward`` with transformers as `name`; returns the name, for
    ``from_config(..., attn_implementation=name)`` or ``model.set_attn_implementation(name)``. No mask function is
    registered under the name, so transformers builds no mask: segments come from the batch."""
    tf = require("transformers")
    tf.AttentionInterface.register(name, packloader_attention_forward)
    return name


def _has_slices(batch: PackedBatch) -> bool:
    return any(s.attend_from < s.start for s in batch.segments)


def _sliced_step_batch(batch: PackedBatch) -> dict[str, Any]:
    """A micro-batch of a step that holds slices, for PackedTrainer's SliceExecutor path: the tokens, positions
    and labels of ``hf_batch`` (no attention metadata: the executor's SliceContext supplies the segments) and the
    metadata with the segments."""
    refuse_dp_merge(batch, "PackedTrainer")
    out: dict[str, Any] = {
        "input_ids": flat(batch.input_ids).unsqueeze(0),
        "position_ids": flat(batch.position_ids).unsqueeze(0),
        "labels": unshifted_labels(batch).unsqueeze(0),
        "shift_labels": flat(batch.labels).unsqueeze(0),
        "use_cache": False,
    }
    out[META_KEY] = {**_meta(batch, batch.num_tokens), SEGMENTS_KEY: list(batch.segments)}
    return out


class HFBatches:
    """A loader's micro-batches as ``hf_batch`` dicts (metadata included for PackedTrainer); iterable once per
    pass like the loader, with ``state_dict``/``load_state_dict`` passed through. With ``slices=True`` (what
    PackedTrainer uses) every micro-batch of a step that holds a slice carries its segments in the metadata for
    the trainer's SliceExecutor instead of being refused (a step is read whole before it is yielded)."""

    def __init__(self, loader: Iterable[PackedBatch], *, attention: str = "position_ids",
                 include_meta: bool = True, slices: bool = False) -> None:
        self.loader = loader
        self.attention = attention
        self.include_meta = include_meta
        self.slices = slices

    def _convert(self, step: list[PackedBatch]) -> Iterator[dict[str, Any]]:
        if self.slices and any(_has_slices(b) for b in step):
            yield from (_sliced_step_batch(b) for b in step)
            return
        for b in step:
            d = hf_batch(b, attention=self.attention, include_meta=self.include_meta)
            if self.slices and self.include_meta:  # another DP rank's step may hold slices: see PackedTrainer
                d[META_KEY][ALL_SEGMENTS_KEY] = list(b.segments)
            yield d

    def __iter__(self) -> Iterator[dict[str, Any]]:
        if not self.slices:
            for b in self.loader:
                yield hf_batch(b, attention=self.attention, include_meta=self.include_meta)
            return
        step: list[PackedBatch] = []
        for b in self.loader:
            if step and b.step != step[0].step:
                yield from self._convert(step)
                step = []
            step.append(b)
            if len(step) == b.micro_batches_in_step:
                yield from self._convert(step)
                step = []
        if step:
            yield from self._convert(step)

    def state_dict(self) -> dict:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state)


def _trainer_base():
    return require("transformers").Trainer


class _PackedTrainerMixin:
    """The packloader parts of PackedTrainer (kept apart so the class is only built when transformers exists)."""

    def _pl_init(self, packed_loader, attention: str) -> None:
        from .hf_setup import accumulation_fix, check_accumulation, price_for_model

        price_for_model(packed_loader, self.model)  # the default cost model prices an 8B model on an H100
        check_accumulation(packed_loader, self.args.gradient_accumulation_steps)
        self._pl_fix = lambda got: accumulation_fix(packed_loader, self.args.gradient_accumulation_steps, got)
        self.packed_loader = packed_loader
        self.packed_batches = HFBatches(packed_loader, attention=attention, include_meta=True, slices=True)
        if self.args.max_steps is None or self.args.max_steps <= 0:
            raise ValueError("PackedTrainer needs TrainingArguments(max_steps=N): the packloader loader has no length")
        if not self.args.average_tokens_across_devices:
            # our normaliser is already the global step's count; the loss must be multiplied back by the world size
            self.args.average_tokens_across_devices = True
        if not self.model_accepts_loss_kwargs:
            raise ValueError(f"{type(self.model).__name__}.forward does not take loss kwargs (num_items_in_batch, "
                             "shift_labels): PackedTrainer's per-token normalisation needs a transformers causal LM")
        self._pl_resume_init()

    def get_train_dataloader(self):
        return self.packed_batches

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device):
        """The loss tokens of the whole packloader step (all micro-batches, all DP ranks), after checking that the
        gradient-accumulation window is exactly that step."""
        if not batch_samples:
            return None
        metas = [b[META_KEY] for b in batch_samples]
        ga = self.args.gradient_accumulation_steps
        first = metas[0]
        check_micro_batches(first["step"], first["micro_batches_in_step"], ga, "Trainer(gradient_accumulation_steps)",
                            fix=self._pl_fix(first["micro_batches_in_step"]))
        if len({m["step"] for m in metas}) != 1 or [m["index_in_step"] for m in metas] != list(range(len(metas))):
            raise ValueError(f"a gradient-accumulation window holds micro-batches {[(m['step'], m['index_in_step']) for m in metas]}"
                             "; expected all micro-batches of one packloader step, in order")
        # a step without loss tokens has only empty micro-batches (zero losses): avoid dividing by 0
        return torch.tensor(max(1, first["loss_tokens_in_step"]), device=device)

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        if self.state.global_step >= self.state.max_steps:
            # resumed from the checkpoint at max_steps: the Trainer (epochs unknown without a length) would train one
            # step more, on data the uninterrupted run never saw
            self.control.should_training_stop = True
            return [], None
        samples, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        self._pl_note_window([s[META_KEY] for s in samples if META_KEY in s])
        self._pl_window, self._pl_window_losses = samples, None  # a sliced step runs whole at its first micro-batch
        if self.accelerator.num_processes > 1 and samples:
            # every DP rank must take the same path (the sliced one syncs gradients itself, DDP's at the window's
            # end): if any rank's step holds slices, all run the step through SliceExecutor
            sliced = any(s.get(META_KEY, {}).get(SEGMENTS_KEY) is not None for s in samples)
            flag = torch.tensor([int(sliced)], device=device)
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
            if int(flag) and not sliced:
                for s in samples:
                    s[META_KEY][SEGMENTS_KEY] = s[META_KEY][ALL_SEGMENTS_KEY]
        return samples, num_items

    def training_step(self, model, inputs, num_items_in_batch=None):
        if inputs.get(META_KEY, {}).get(SEGMENTS_KEY) is not None:
            return self._pl_sliced_training_step(model, inputs, num_items_in_batch)
        return super().training_step(model, inputs, num_items_in_batch)

    def _pl_check_sliced_setup(self, model) -> None:
        from accelerate.utils import DistributedType

        impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
        fn = require("transformers.modeling_utils").ALL_ATTENTION_FUNCTIONS.get(impl) if impl else None
        if fn is not packloader_attention_forward:
            raise ValueError(
                f"this packloader step holds sliced documents (PlanConfig(allow_slicing=True)), which PackedTrainer runs "
                f"through SliceExecutor; the model's attention implementation is {impl!r}, which cannot read the "
                "earlier slices' keys. Build the model with attn_implementation=register_packloader_attention() (or "
                "call model.set_attn_implementation(register_packloader_attention())), or plan with "
                "PlanConfig(allow_slicing=False)")
        dt = self.accelerator.distributed_type
        if dt not in (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU) or \
                self.accelerator.scaler is not None:
            raise ValueError(
                f"PackedTrainer runs sliced plans single-process or under DDP without fp16 loss scaling; this run uses "
                f"{dt.value}{' with fp16 loss scaling' if self.accelerator.scaler is not None else ''}. Plan with "
                "PlanConfig(allow_slicing=False), or use bf16 / DDP")

    def _pl_sliced_training_step(self, model, inputs, num_items_in_batch=None):
        """One micro-batch of a step holding slices: the first runs the whole step (window) through SliceExecutor,
        gradients included; every micro-batch returns its own loss, as ``training_step`` would."""
        import types

        from packloader.runtime.slices import SliceExecutor

        window = getattr(self, "_pl_window", None) or []
        idx = next((i for i, w in enumerate(window) if w is inputs), None)
        if idx is None:
            raise RuntimeError("PackedTrainer: a micro-batch of a sliced step arrived outside its accumulation window")
        if self._pl_window_losses is None:
            if idx != 0:
                raise RuntimeError("PackedTrainer: a sliced step must start at its first micro-batch")
            net = self.accelerator.unwrap_model(model)
            self._pl_check_sliced_setup(net)
            metas = [w[META_KEY] for w in window]
            check_micro_batches(metas[0]["step"], metas[0]["micro_batches_in_step"], len(window),
                                "Trainer(gradient_accumulation_steps)", fix=self._pl_fix(metas[0]["micro_batches_in_step"]))
            net.train()
            if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
                self.optimizer.train()
            losses = [torch.zeros((), device=self.args.device) for _ in window]
            run = [types.SimpleNamespace(segments=m[SEGMENTS_KEY], i=i, inputs=w)
                   for i, (m, w) in enumerate(zip(metas, window)) if m[SEGMENTS_KEY]]  # empty slots: nothing to run

            def step_fn(mb, ctx):
                batch = self._prepare_inputs(mb.inputs)
                with self.compute_loss_context_manager():
                    loss = self.compute_loss(net, batch, num_items_in_batch=num_items_in_batch)
                losses[mb.i] = loss.detach()
                # what accelerator.backward divides by (Trainer keeps it 1 and accumulates itself)
                return loss / self.accelerator.gradient_accumulation_steps

            SliceExecutor(rank=self.args.process_index).run(run, step_fn, step=metas[0]["step"])
            if self.accelerator.num_processes > 1:
                # the executor ran the unwrapped module (several forwards per backward, which DDP's reducer does not
                # allow), so average the gradients over ranks once here, as DDP's all-reduce would
                world = self.accelerator.num_processes
                for p in net.parameters():
                    if p.requires_grad:
                        if p.grad is None:
                            p.grad = torch.zeros_like(p)
                        torch.distributed.all_reduce(p.grad)
                        p.grad.div_(world)
            self._pl_window_losses = losses
        return self._pl_window_losses[idx]

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        inputs = {k: v for k, v in inputs.items() if k != META_KEY}
        return super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)


def _build_trainer_class():
    Trainer = _trainer_base()

    class PackedTrainer(_EntryLossMixin, _PackedTrainerMixin, _ResumeMixin, Trainer):
        """transformers.Trainer fed by a packloader loader (see the module docstring)."""

        def __init__(self, *args: Any, packed_loader: Iterable[PackedBatch], attention: str = "position_ids",
                     **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._pl_init(packed_loader, attention)

    return PackedTrainer


_CLASSES: dict[str, type] = {}


def __getattr__(name: str):
    """PackedTrainer is built on first access, so importing this module does not import transformers."""
    if name == "PackedTrainer":
        if name not in _CLASSES:
            _CLASSES[name] = _build_trainer_class()
        return _CLASSES[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
