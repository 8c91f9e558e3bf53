"""`PackedDataset`: the same pipeline as `PackedLoader` as a map of DataLoader workers, each planning its own
contiguous part of every epoch (see `loader.py`)."""

from __future__ import annotations

from typing import Any

from torch.utils.data import IterableDataset

from packloader.collate.batch import PackedBatch
from packloader.contracts import PlanConfig
from packloader.loader.graph import LoaderPipeline, StepGraph
from packloader.loader.state import STATE_FORMAT, check_state, fingerprint, validate_config
from packloader.loader.state_check import StateContext, check_state_values, source_lengths
from packloader.sources.order import split_range


class _StepIterator:
    """A worker's iterator over its steps, with state_dict/load_state_dict (torchdata's Stateful protocol, which
    StatefulDataLoader uses to save and restore each worker). The graph starts on the first step asked for, so
    restoring a worker never starts threads only to replace them."""

    def __init__(self, dataset: "PackedDataset", worker: int, workers: int) -> None:
        p = dataset._p
        n = p.stream.num_docs
        self.span = split_range(0, n, workers, worker)
        self.dataset, self.worker, self.workers = dataset, worker, workers
        self.start_epoch = dataset._epoch
        self.max_epochs = None if p.options.epochs is None else self.start_epoch + p.options.epochs
        self._graph: StepGraph | None = None
        self._position: dict | None = None  # StepNode state after the last step returned (None: the start)

    def __iter__(self):
        return self

    def __next__(self) -> list[PackedBatch]:
        if self._graph is None:
            span = self.span
            self._graph = self.dataset._p.build(span=lambda epoch: span, exchange=None, max_epochs=self.max_epochs,
                                                start_epoch=self.start_epoch, step_stride=self.workers,
                                                step_offset=self.worker, start_state=self._position)
        while True:
            step = self._graph.next()
            self._position = step.state_after
            if step.batches:
                return step.batches

    def _fingerprint(self) -> dict:
        p = self.dataset._p
        return fingerprint(config=p.config, options=p.options, source=p.source, tokenizer_name=p.tokenizer_name(),
                           dp_rank=p.dp_rank, eos_appended=p.stream.eos_appended, span=self.span)

    def state_dict(self) -> dict:
        return {"format": STATE_FORMAT, "fingerprint": self._fingerprint(), "next_epoch": None, "pass_left": None,
                "pass_open": False, "stats": None, "loader": {"step_state": self._position, "skip": 0}}

    def load_state_dict(self, state: dict) -> None:
        check_state(state, self._fingerprint())
        p = self.dataset._p
        check_state_values(state, StateContext(
            num_docs=p.stream.num_docs, span=self.span, step_offset=self.worker, step_stride=self.workers,
            loader=False, max_epochs=self.max_epochs, doc_lengths=source_lengths(p.stream)))
        self.close()
        self._position = state["loader"]["step_state"]

    def close(self) -> None:
        """Stop this iterator's threads."""
        if self._graph is not None:
            self._graph.close()
            self._graph = None


class PackedDataset(IterableDataset):
    """The loader as a torch IterableDataset for `DataLoader(ds, batch_size=None, num_workers=W)`.

    Each item is one whole step for this rank: a list of its PackedBatch micro-batches (a list, so that the
    DataLoader's round-robin over workers keeps each step's micro-batches together). Documents are split by
    worker: worker w of W plans the w-th contiguous part of each epoch's order (`split_range`), so every document
    is in exactly one worker's steps. Worker w's k-th step is numbered `k * W + w`: numbers are unique and, as
    the DataLoader visits workers in turn, increasing (a worker that runs out of steps first leaves gaps).
    All ranks must use the same number of workers; the rank check runs only in PackedLoader (workers have no
    process group). `set_epoch(e)` picks the first epoch of the next pass; a pass yields `epochs` epochs.
    With torchdata's StatefulDataLoader, each worker's position is saved and restored (same num_workers).
    """

    def __init__(self, source, *, tokenizer: Any = "tekken", config: PlanConfig | dict, dp_rank: int | None = None,
                 seed: int | None = None, column: str | None = None, planner=None, **options) -> None:
        super().__init__()
        options.setdefault("num_threads", 1)
        options.setdefault("lengths", "auto")
        if options.get("lengths") == "gather":
            options["lengths"] = "local"  # workers have no process group to gather through
        cfg = validate_config(config)
        self._p = LoaderPipeline(source, tokenizer=tokenizer, config=cfg, dp_rank=dp_rank, column=column, planner=planner,
                            seed=cfg.seed if seed is None else seed, check_ranks=False, **options)
        self._epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self._epoch = int(epoch)

    def __iter__(self) -> _StepIterator:
        from torch.utils.data import get_worker_info

        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        return _StepIterator(self, worker, workers)
