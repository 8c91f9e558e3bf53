"""PackedTrainer's checkpoints and logs: the loader state in every Trainer checkpoint, resume from it, the data's
epoch, throughput in tokens and the loader's per-step metrics.

Resume: the Trainer's own resume skips the batches it already trained by re-reading them (accelerate's
``skip_first_batches``), which needs a ``DataLoader`` and would replay a packloader stream from its start. Instead
every checkpoint folder holds each process's loader state (``packloader_state-rank{R}.pt``, written before the
Trainer's own files, so ``trainer_state.json`` still marks a finished checkpoint), ``train(resume_from_checkpoint=...)``
loads it into the loader before training starts, and the Trainer's data skip is switched off
(``args.ignore_data_skip = True``): the loader continues where the checkpoint left it. Each state file is bound to
its checkpoint's global step and run, and a state of another checkpoint is refused (``hf_checkpoint``).

Logs: the Trainer's ``epoch`` counts optimizer steps against ``max_steps``; PackedTrainer logs the data's epoch
instead (completed epochs plus the share of this epoch's documents drawn, from the loader's stats). The end of
``train()`` reports ``train_tokens`` and ``train_tokens_per_second`` (tokens of all processes' micro-batches,
padding rows left out) in place of ``train_samples_per_second`` (micro-batches), and every periodic log adds
``packloader/tokens_per_second`` since the previous log and the last step's ``StepMetrics`` fields as
``packloader/<field>`` where the loader computes them (``batch.step_metrics``).
"""

from __future__ import annotations

import os
import time
from typing import Any

import msgspec
import torch

from ._lazy import require
from .hf_checkpoint import RUN_KEY, bind, checkpoint_identity, new_run, unbind
from .state_file import read_state_file

STATE_FILE = "packloader_state-rank{rank}.pt"
LOG_PREFIX = "packloader/"


def state_path(checkpoint_dir: str, rank: int) -> str:
    return os.path.join(checkpoint_dir, STATE_FILE.format(rank=rank))


def save_loader_state(loader: Any, checkpoint_dir: str, rank: int, *, global_step: int | None = None,
                      run: str | None = None) -> str:
    """Write `loader.state_dict()` into the checkpoint folder (atomically: a killed save leaves no partial file),
    bound to the checkpoint's `global_step` and `run` where given (`hf_checkpoint`)."""
    if not callable(getattr(loader, "state_dict", None)):
        raise ValueError(
            f"PackedTrainer cannot checkpoint its packed_loader ({type(loader).__name__}): it has no state_dict(), so "
            "a resumed run could not continue its token stream. Pass a PackedLoader or PackedDataset, or "
            "TrainingArguments(save_strategy='no')")
    os.makedirs(checkpoint_dir, exist_ok=True)
    path = state_path(checkpoint_dir, rank)
    tmp = f"{path}.tmp"
    state = loader.state_dict()
    torch.save(bind(state, global_step, run or "") if global_step is not None else state, tmp)
    os.replace(tmp, path)
    return path


def load_loader_state(loader: Any, checkpoint_dir: str, rank: int) -> None:
    path = state_path(checkpoint_dir, rank)
    if not os.path.isfile(path):
        found = sorted(f for f in os.listdir(checkpoint_dir) if f.startswith("packloader_state-")) \
            if os.path.isdir(checkpoint_dir) else []
        raise FileNotFoundError(
            f"checkpoint {checkpoint_dir} holds no packloader loader state for process {rank} (expected {path}; "
            f"found {found or 'none'}): it was not written by PackedTrainer, or by a run with another number of "
            "processes. Resuming without it would replay or skip data")
    loader.load_state_dict(unbind(read_state_file(path), checkpoint_dir, path))


def resolve_checkpoint(resume_from_checkpoint: str | bool | None, output_dir: str) -> str | None:
    """The folder `Trainer.train(resume_from_checkpoint=...)` resumes from (True: the output_dir's last one)."""
    if resume_from_checkpoint is True:
        last = require("transformers.trainer_utils").get_last_checkpoint(output_dir)
        if last is None:
            raise ValueError(f"No valid checkpoint found in output directory ({output_dir})")
        return last
    return resume_from_checkpoint or None


def data_epoch(meta: dict, docs_per_epoch: int | None) -> float:
    """Completed epochs plus the share of the current epoch's documents drawn, after the step of `meta`."""
    epoch, documents = meta.get("epoch", 0), meta.get("documents")
    if documents is None or not docs_per_epoch:
        return float(epoch)
    # documents counts every epoch's draws since the start: epoch e's step holds e * docs_per_epoch + its share
    return max(float(epoch), min(documents / docs_per_epoch, epoch + 1.0))


def metric_logs(record: Any) -> dict[str, float]:
    """A StepMetrics record's numeric fields as log entries (``packloader/<field>``)."""
    if record is None:
        return {}
    fields = msgspec.structs.asdict(record) if isinstance(record, msgspec.Struct) else dict(record)
    return {LOG_PREFIX + k: v for k, v in fields.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)}


class _ResumeMixin:
    """The checkpoint and log overrides of PackedTrainer (see the module docstring)."""

    def _pl_resume_init(self) -> None:
        self.args.ignore_data_skip = True  # the loader state resumes the stream; the Trainer must not skip too
        # the Trainer would count tokens by iterating the training data before training (and consume the stream):
        # PackedTrainer reports tokens per second itself
        self.args.include_tokens_per_second = False
        self._pl_tokens = 0  # this process's tokens since train() started
        self._pl_logged = (0, time.time())  # all processes' tokens and the time at the last periodic log
        self._pl_last_meta: dict | None = None
        self.add_callback(_data_epoch_callback(self))

    def _pl_note_window(self, metas: list[dict]) -> None:
        """One optimizer step's micro-batches were drawn (called from get_batch_samples)."""
        self._pl_tokens += sum(int(m.get("num_tokens", 0)) for m in metas)
        if metas:
            self._pl_last_meta = metas[-1]

    def _pl_global_tokens(self) -> int:
        t = torch.tensor([self._pl_tokens], dtype=torch.int64, device=self.args.device)
        if self.accelerator.num_processes > 1:
            torch.distributed.all_reduce(t)
        return int(t.item())

    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None, **kwargs):
        checkpoint = resolve_checkpoint(resume_from_checkpoint, self.args.output_dir)
        run = checkpoint_identity(checkpoint)[1] if checkpoint is not None else None
        self._pl_run = run or new_run(self.accelerator.num_processes)
        if checkpoint is not None:
            load_loader_state(self.packed_loader, checkpoint, self.args.process_index)
        self._pl_tokens = 0
        self._pl_logged = (0, time.time())
        return super().train(resume_from_checkpoint=checkpoint, trial=trial,
                             ignore_keys_for_eval=ignore_keys_for_eval, **kwargs)

    def _save_checkpoint(self, model, trial):
        folder = f"{require('transformers.trainer_utils').PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        run = getattr(self, "_pl_run", None) or ""
        save_loader_state(self.packed_loader, os.path.join(self._get_output_dir(trial=trial), folder),
                          self.args.process_index, global_step=self.state.global_step, run=run)
        self.state.stateful_callbacks[RUN_KEY] = {"args": {"run": run}, "attributes": {}}  # in trainer_state.json
        super()._save_checkpoint(model, trial)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "train_runtime" in logs:  # the end of train(); update in place: train() returns this dict as metrics
            tokens, runtime = self._pl_global_tokens(), logs["train_runtime"]
            logs.pop("train_samples_per_second", None)  # micro-batches, not samples
            logs["train_tokens"] = tokens
            logs["train_tokens_per_second"] = round(tokens / runtime, 3) if runtime > 0 else 0.0
        elif "loss" in logs:  # a periodic training log (every process calls it)
            tokens, now = self._pl_global_tokens(), time.time()
            before, then = self._pl_logged
            self._pl_logged = (tokens, now)
            logs[LOG_PREFIX + "tokens_per_second"] = round((tokens - before) / max(now - then, 1e-9), 3)
            logs.update(metric_logs((self._pl_last_meta or {}).get("step_metrics")))
        super().log(logs, start_time)


def _data_epoch_callback(trainer):
    """Sets the Trainer's epoch to the data's after every optimizer step (logged and saved with it)."""
    transformers = require("transformers")

    class DataEpoch(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if trainer._pl_last_meta is not None:
                stream = getattr(trainer.packed_loader, "stream", None)
                state.epoch = data_epoch(trainer._pl_last_meta, getattr(stream, "num_docs", None))

    return DataEpoch()
