"""`PackedDataset`: the same pipeline as `PackedLoader` as a map of DataLoader workers, each planning its own
contiguous part of every epoch (see `loader.py`)."""

from __future__ import annotations

from typing import Any

from torch.utils.data import IterableDataset

from packloader.collate.batch import PackedBatch
from packloader.contracts import PlanConfig
from packloader.loader.elastic import drawn_fields, same_layout
from packloader.loader.graph import LoaderPipeline, StepGraph
from packloader.loader.state import check_fingerprint, check_state_shape, fingerprint, saved_state, upgraded
from packloader.loader.state_check import StateContext, check_state_values, source_lengths
from packloader.loader.worker_resume import PARTS_FORMAT
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
        self._parts: list[_StepIterator] | None = None  # resumed from another worker count: the saved workers'
        self._turn = 0  # the part whose step comes next

    def __iter__(self):
        return self

    def __next__(self) -> list[PackedBatch]:
        if self._parts is not None:
            return self._next_part()
        if self._graph is None:
            span = self.span
            self._graph = self.dataset._p.build(span=lambda epoch: span, exchange=None, max_epochs=self.max_epochs,
                                                start_epoch=self.start_epoch, step_stride=self.workers,
                                                step_offset=self.worker, start_state=self._position)
        while True:
            try:
                step = self._graph.next()
            except StopIteration:
                raise
            except Exception:  # the graph closed itself: a next call starts a new one where this one stood
                self._graph = None
                raise
            self._position = step.state_after
            if step.batches:
                return step.batches

    def _next_part(self) -> list[PackedBatch]:
        """The parts' steps in turn, as the saving DataLoader visited its workers; a finished part drops out."""
        while self._parts:
            self._turn %= len(self._parts)
            part = self._parts[self._turn]
            try:
                out = next(part)
            except StopIteration:
                part.close()
                del self._parts[self._turn]  # nothing left of it to resume
                continue
            self._turn += 1
            return out
        raise StopIteration

    def _fingerprint(self) -> dict:
        p = self.dataset._p
        return fingerprint(config=p.config, options=p.options, source=p.source, tokenizer_name=p.tokenizer_name(),
                           dp_rank=p.dp_rank, eos_appended=p.stream.eos_appended, span=self.span)

    def state_dict(self) -> dict:
        if self._parts is not None:
            return {"format": PARTS_FORMAT, "parts": [q.state_dict() for q in self._parts], "turn": self._turn}
        return saved_state(fingerprint=self._fingerprint(), step_state=self._position, skip=0, worker=self.worker,
                           workers=self.workers)

    def load_state_dict(self, state: dict) -> None:
        """A state of this worker (of this worker count), or parts dealt by `worker_resume.dataloader_state_for`;
        either may come from another layout (dp, micro-batch count, ...): a worker state is a step boundary."""
        if isinstance(state, dict) and state.get("format") == PARTS_FORMAT:
            if not isinstance(state.get("parts"), list) or not isinstance(state.get("turn"), int):
                raise ValueError("this PackedDataset worker state is incomplete or damaged: expected 'parts' (a list "
                                 "of worker states) and 'turn' (an int), as dataloader_state_for writes them")
            parts = []
            for st in state["parts"]:
                part = _StepIterator(self.dataset, int(st["worker"]), int(st["workers"]))
                part.load_state_dict(st)
                parts.append(part)
            self.close()
            self._parts, self._turn = parts, int(state["turn"])
            return
        state = upgraded(state)  # a state saved before a config field existed: the field as it was then
        check_state_shape(state)
        if (state.get("worker", self.worker), state.get("workers", self.workers)) != (self.worker, self.workers):
            raise ValueError(
                f"this is the state of DataLoader worker {state['worker']} of {state['workers']}, loaded into worker "
                f"{self.worker} of {self.workers}; to resume with another num_workers, load "
                "packloader.dataloader_state_for(state, num_workers) into the StatefulDataLoader")
        saved, now = state["fingerprint"], self._fingerprint()
        if not same_layout(saved, now):  # another layout: only what is drawn must match
            saved, now = drawn_fields(saved), drawn_fields(now)
        check_fingerprint(saved, now)
        p = self.dataset._p
        check_state_values(state, StateContext(
            num_docs=p.stream.num_docs, span=self.span, step_offset=self.worker, step_stride=self.workers,
            loader=False, max_epochs=self.max_epochs, doc_lengths=source_lengths(p.stream)))
        self.close()
        self._parts, self._position = None, state["loader"]["step_state"]

    def close(self) -> None:
        """Stop this iterator's threads."""
        for part in self._parts or []:
            part.close()
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
    With torchdata's StatefulDataLoader, each worker's position is saved and restored; at another num_workers or
    layout, load `dataloader_state_for(state, num_workers)` (`worker_resume.py`).
    """

    def __init__(self, source, *, tokenizer: Any = "tekken", config: PlanConfig | dict, dp_rank: int | None = None,
                 seed: int | None = None, column: str | None = None, planner=None, **options) -> None:
        super().__init__()
        options.setdefault("num_threads", 1)
        options.setdefault("lengths", "auto")
        if options.get("lengths") == "gather":
            options["lengths"] = "local"  # workers have no process group to gather through
        self._p = LoaderPipeline(source, tokenizer=tokenizer, config=config, dp_rank=dp_rank, column=column, planner=planner,
                                 seed=seed, check_ranks=False, **options)
        self._epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self._epoch = int(epoch)

    def __iter__(self) -> _StepIterator:
        from torch.utils.data import get_worker_info

        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        return _StepIterator(self, worker, workers)
