"""`PackedLoader`: shards in, this rank's packed micro-batches out, resumable exactly.

```python
loader = PackedLoader("shards/*.parquet", tokenizer="tekken", config=PlanConfig(...))
for batch in loader:                   # one epoch per `for` (epochs=1); PackedBatch objects, in order
    ...
state = loader.state_dict()            # StatefulDataLoader conventions: load_state_dict(state) resumes here
```

Every step the loader draws documents in the epoch's order until `config.tokens_per_step` tokens are reached, cuts
documents longer than `config.context` into independent pieces (counted in `loader.stats`, never dropped), plans
the step with the configured planner (every rank computes the same plan from the same lengths, and checks that
with the other ranks), and collates only this rank's micro-batches. Each batch says its `step`, its
`index_in_step`, this rank's `micro_batches_in_step` and the step's `loss_tokens_in_step` (all ranks).
Each batch also carries the loader's bookkeeping as fields: its `epoch`, `last_in_epoch` (this rank's last
micro-batch of the epoch), the step's `plan`, the cumulative `stats` and, for a DP-Merge micro-batch, its
`dp_group`.

Epochs: a `for` pass yields `epochs` epochs (None: an endless stream); the next pass continues with the next
epoch. At the end of each epoch the planner is asked to flush what it holds back, so every token is trained
exactly once per epoch. Steps are numbered from 0 across epochs.

Resume: the state is the planning stage's position (the first document not yet drawn, the step number, the
planner's queue, the stats) and how many of the current step's micro-batches were yielded, so it does not
depend on `num_threads`, `prefetch`, `chunk_docs`, `lengths` or the layout. A state saved inside the loop after
a pass's last batch resumes into that pass, which yields nothing more (as the uninterrupted loop would end);
the next `for` is the next epoch. A state saved after the loop resumes before the next pass.

Ranks: `dp_rank` defaults to torch.distributed's rank when it is initialised and its world size equals
`config.parallel.dp`; otherwise pass it. With torch.distributed initialised (world > 1) the ranks compare their
settings (PlanConfig, seed, shuffle, tokenizer, EOS, source) when the loader is built, and a RuntimeError names
each field that differs; then each step's plan digest is compared through the process group's store: a rank that
disagrees, or that does not answer within `timeout` seconds, makes the others raise a RuntimeError naming the
step and the ranks.

For torch DataLoader workers, use `PackedDataset` (below): each worker plans its own contiguous part of every
epoch and yields whole steps.
"""

from __future__ import annotations

import os
import re
import threading
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import msgspec
from torch.utils.data import IterableDataset
from torchdata.nodes import ParallelMapper, Prefetcher

from packloader.balancers.planners.registry import make_planner
from packloader.collate.batch import PackedBatch
from packloader.contracts import LoaderStats, PlanConfig
from packloader.loader.distributed import RankExchange, check_settings, next_instance, resolve_dp_rank, torch_rank_world
from packloader.loader.nodes import ChunkLoader, ChunkNode, StepCollator, StepNode, StepReader
from packloader.loader.state import (
    STATE_FORMAT,
    LoaderOptions,
    check_state,
    fingerprint,
    validate_config,
    validate_options,
)
from packloader.sources.order import split_range
from packloader.sources.stream import DocumentStream


def _open(source, column: str | None):
    if isinstance(source, (str, os.PathLike)) or (isinstance(source, Sequence) and not hasattr(source, "shards")
                                                   and all(isinstance(p, (str, os.PathLike)) for p in source)):
        from packloader.sources.open import open_source

        return open_source(source, column=column)
    if not hasattr(source, "shards") or not hasattr(source, "read"):
        raise TypeError(f"source must be a path, a list of paths or a Source, got {type(source).__name__}")
    return source


def _unwrap(e: BaseException) -> BaseException:
    """torchdata re-raises a background thread's exception as `type(e)("Caught ... Original Traceback ...")`,
    twice when it crossed two thread stages; give the trainer the original message (the traceback stays chained)."""
    msg = str(e)
    if "Original Traceback" not in msg:
        return e
    name = type(e).__name__
    lines = msg.splitlines()
    starts = [i for i, line in enumerate(lines) if re.match(rf"^[\w.]*\b{re.escape(name)}: ", line)]
    if not starts:
        return e
    text = "\n".join(lines[starts[-1]:]).split(": ", 1)[1].rstrip()
    try:
        clean = type(e)(text)
    except Exception:  # noqa: BLE001 - an exception type that needs other arguments
        clean = RuntimeError(text)
    return clean


def _shutdown(node, seen=None) -> None:
    """Stop the threads of a torchdata node graph (best effort; they are daemon threads anyway)."""
    seen = set() if seen is None else seen
    if node is None or id(node) in seen:
        return
    seen.add(id(node))
    if hasattr(node, "_shutdown"):
        try:
            node._shutdown()
        except Exception:  # noqa: BLE001 - cleanup only
            pass
    for attr in ("_it", "source", "chunks", "root"):
        child = getattr(node, attr, None)
        if child is not None and not isinstance(child, (int, str)):
            _shutdown(child, seen)


class _Pipeline:
    """What PackedLoader and PackedDataset share: options, stream, planner, and the node graph."""

    def __init__(self, source, *, tokenizer, config, dp_rank, column, planner=None, **options) -> None:
        self.config: PlanConfig = validate_config(config)
        self.options: LoaderOptions = validate_options(**options)
        if self.options.pad_to_tokens is not None and self.options.pad_to_tokens < self.config.max_tokens:
            raise ValueError(
                f"pad_to_tokens={self.options.pad_to_tokens} is below config.max_tokens={self.config.max_tokens}: "
                "a full micro-batch would not fit"
            )
        self.source = _open(source, column)
        self.dp_rank = resolve_dp_rank(dp_rank, self.config.parallel.dp)
        tok_threads = 1 if self.options.num_threads > 0 else None  # the chunk stage's threads run tokenizers
        self.stream = DocumentStream(self.source, tokenizer, seed=self.options.seed, shuffle=self.options.shuffle,
                                     append_eos=self.options.append_eos, tokenizer_threads=tok_threads)
        self.planner = make_planner(self.config) if planner is None else planner
        mode = self.options.lengths
        if mode == "auto":
            mode = "column" if self.stream.has_column_lengths else "local"
        elif mode == "column" and not self.stream.has_column_lengths:
            raise ValueError("lengths='column' needs a pre-tokenized source with a length column "
                             "(`packloader tokenize` writes one); use lengths='local' or 'gather'")
        self.mode = mode
        pad_id = self.options.pad_id
        if pad_id is None:
            pad_id = self.stream.eos_id if self.stream.eos_id is not None else 0
        self.lock = threading.Lock()  # shared by the StepNodes of every graph built (they share the planner)
        self.collator = StepCollator(self.stream, layout=self.options.layout, pad_to_multiple=self.options.pad_to_multiple,
                                     pad_to_tokens=self.options.pad_to_tokens, pad_id=pad_id)

    def __getstate__(self) -> dict:  # DataLoader workers receive the dataset pickled; a lock does not pickle
        return {k: v for k, v in self.__dict__.items() if k != "lock"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.lock = threading.Lock()

    def tokenizer_name(self) -> str | None:
        if self.stream.pretokenized and not self.stream.eos_appended:
            return None
        return getattr(self.stream.tokenizer, "name", type(self.stream.tokenizer).__name__)

    def build(self, *, span, exchange: RankExchange | None, max_epochs: int | None, start_epoch: int = 0,
              step_stride: int = 1, step_offset: int = 0, start_state: dict | None = None) -> "_Graph":
        """A fresh node graph whose StepNode starts at `start_state` (None: the start). Its items are `_Step`s.

        The loader never resets a graph that has run: torchdata joins a replaced stage's threads with a timeout
        and lets them run on, so a thread of the old graph could still draw a step from a node that was reset to a
        saved state, and that step would be lost. Resuming builds a new graph and closes the old one instead;
        the state is the StepNode's, not torchdata's, so it does not depend on threads, prefetching or the
        lengths mode."""
        o = self.options
        mode = self.mode
        if mode == "gather" and exchange is None:
            mode = "local"  # one rank: gathering is reading everything
        rank, world = (exchange.rank, exchange.world) if exchange is not None else (0, 1)
        chunk_node = ChunkNode(span, o.chunk_docs, max_epochs)
        load = ChunkLoader(self.stream, mode, rank, world)
        threads = o.num_threads
        if mode == "column" or threads == 0:
            chunks = ParallelMapper(chunk_node, load, num_workers=0)
        else:
            chunks = ParallelMapper(chunk_node, load, num_workers=threads, in_order=True, method="thread",
                                    snapshot_frequency=0)
        steps = StepNode(chunk_node, chunks, self.stream, self.planner, self.config, self.dp_rank, span=span,
                         mode=mode, exchange=exchange, check_ranks=o.check_ranks, start_epoch=start_epoch,
                         step_stride=step_stride, step_offset=step_offset, start_state=start_state, lock=self.lock)
        node = steps
        if mode == "column" and threads > 0:
            # pre-tokenized: planning in one thread, reading this rank's tokens in another (Parquet decoding
            # releases the GIL), collating in a third (the prefetcher's)
            node = ParallelMapper(node, StepReader(self.stream), num_workers=1, in_order=True, method="thread",
                                  max_concurrent=1, snapshot_frequency=0)
        # Collating runs in the prefetcher's thread: it is cheap next to tokenizing, and more collating threads
        # only fight over the GIL (measured: they made the pre-tokenized path slower on 2 cores).
        node = ParallelMapper(node, _Collate(self.collator), num_workers=0)
        if threads > 0:
            node = Prefetcher(node, prefetch_factor=o.prefetch, snapshot_frequency=0)
        return _Graph(node, steps)


@dataclass
class _Step:
    """One planned step as this rank's collated micro-batches, with the StepNode states around it: the loader's
    resume points (`state_before` with the number of micro-batches already yielded, or `state_after`)."""

    batches: list[PackedBatch]  # empty when this rank has no micro-batch in the step
    epoch: int
    last_in_epoch: bool
    state_before: dict
    state_after: dict


class _Collate:
    def __init__(self, collator: StepCollator) -> None:
        self.collator = collator

    def __call__(self, work) -> _Step:
        out = [b for b in self.collator(work) if b is not None]
        return _Step(out, work.epoch, work.last_in_epoch, work.state_before, work.state_after)


class _Graph:
    """A node graph, started by the first `next`; `close` stops its threads and makes its StepNode refuse to
    draw again (a thread that outlives the join only ever sees this graph's nodes)."""

    def __init__(self, root, steps: StepNode) -> None:
        self.root, self.steps = root, steps
        self.started = False

    def next(self) -> _Step:
        if not self.started:
            self.root.reset()
            self.started = True
        try:
            return next(self.root)
        except Exception as e:
            clean = _unwrap(e)
            if clean is e:
                raise
            raise clean from e

    def close(self) -> None:
        self.steps.close()
        _shutdown(self.root)


class PackedLoader:
    """This rank's packed micro-batches (`PackedBatch`), in order; see the module docstring.

    `source`: a `Source`, or a path / glob / list of paths for `open_source` (`column` picks the column or field).
    `tokenizer`: a name for `get_tokenizer` ("tekken", "cl100k", "bytes", "hf:PATH") or a Tokenizer; only used for
    text sources. `lengths`: "auto" (a length column when the source has one, else "local"), "column", "local"
    (every rank tokenizes the whole stream) or "gather" (ranks split the tokenizing and all-gather lengths).
    `layout`: "flat" (`[T]`) or "hf" (`[1, T]`). `pad_to_multiple` / `pad_to_tokens`: the padded variant.
    `num_threads`: threads that read/tokenize and that collate (0: everything in the calling thread, no
    prefetching). `prefetch`: steps planned and collated ahead. `planner`: a Planner object to use instead of
    `make_planner(config)` (for planners outside the registry).
    """

    def __init__(
        self,
        source,
        *,
        tokenizer: Any = "tekken",
        config: PlanConfig | dict,
        dp_rank: int | None = None,
        seed: int | None = None,
        shuffle: bool = True,
        append_eos: bool = True,
        layout: str = "flat",
        pad_to_multiple: int | None = None,
        pad_to_tokens: int | None = None,
        pad_id: int | None = None,
        epochs: int | None = 1,
        lengths: str = "auto",
        num_threads: int = 2,
        prefetch: int = 2,
        chunk_docs: int = 256,
        check_ranks: bool = True,
        timeout: float = 300.0,
        name: str = "loader",
        column: str | None = None,
        planner=None,
    ) -> None:
        cfg = validate_config(config)
        self._p = _Pipeline(
            source, tokenizer=tokenizer, config=cfg, dp_rank=dp_rank, column=column, planner=planner,
            seed=cfg.seed if seed is None else seed, shuffle=shuffle, append_eos=append_eos, layout=layout,
            pad_to_multiple=pad_to_multiple, pad_to_tokens=pad_to_tokens, pad_id=pad_id, epochs=epochs,
            lengths=lengths, num_threads=num_threads, prefetch=prefetch, chunk_docs=chunk_docs,
            check_ranks=check_ranks, timeout=timeout, name=name,
        )
        o = self._p.options
        self.exchange: RankExchange | None = None
        if (o.check_ranks or self._p.mode == "gather") and torch_rank_world() is not None:
            self.exchange = RankExchange.from_torch(f"{o.name}-{next_instance()}", o.timeout)
        if self.exchange is not None and o.check_ranks:
            check_settings(self.exchange, self._settings())
        self._graph: _Graph | None = None  # built on the first batch asked for
        self._start: dict | None = None  # StepNode state the next graph starts from (None: the start)
        self._skip = 0  # micro-batches of the first step that were yielded before the state was saved
        self._cur: _Step | None = None  # the step being yielded
        self._at = 0  # its next micro-batch
        self._resume: tuple[dict | None, int] = (None, 0)  # where the stream stands after the last batch yielded
        self._stats = LoaderStats()  # as of the last batch yielded (or the state loaded)
        self._next_epoch = 0
        self._pass_left: int | None = 0  # epochs left in the open pass (None: endless)
        self._pass_open = False  # a pass started and its `for` has not ended

    # --- facts ---------------------------------------------------------------------------------------------------

    @property
    def config(self) -> PlanConfig:
        return self._p.config

    @property
    def options(self) -> LoaderOptions:
        return self._p.options

    @property
    def source(self):
        return self._p.source

    @property
    def stream(self) -> DocumentStream:
        return self._p.stream

    @property
    def dp_rank(self) -> int:
        return self._p.dp_rank

    @property
    def lengths_mode(self) -> str:
        return self._p.mode if not (self._p.mode == "gather" and self.exchange is None) else "local"

    @property
    def stats(self) -> LoaderStats:
        """Counts up to the step of the last batch yielded (split documents and pieces, tokens, steps, ...)."""
        return self._stats

    @property
    def epoch(self) -> int:
        """The epoch the next batch belongs to."""
        return self._next_epoch

    # --- iteration -----------------------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[PackedBatch]:
        """One pass: `epochs` epochs from where the loader stands (the rest of the pass a saved state was in).

        A pass is open from its first batch until its `for` ends. A state saved after the pass's last batch but
        inside the loop resumes into that same pass, which then yields nothing (as the uninterrupted loop would);
        a state saved after the loop resumes before the next pass."""
        if self._pass_open and self._pass_left == 0:
            self._pass_open = False
            return
        if not self._pass_open:
            self._pass_left, self._pass_open = self._p.options.epochs, True
        while True:
            if self._cur is None:
                step = self._fetch()
                if step is None:  # the stream ended (only a bounded span does)
                    self._pass_open = False
                    return
                self._cur, self._at, self._skip = step, self._skip, 0
            step = self._cur
            if self._at >= len(step.batches):  # none of this rank's micro-batches (left) in this step
                self._cur = None
                self._advance(step, done=True)
            else:
                batch = step.batches[self._at]
                self._at += 1
                done = self._at == len(step.batches)
                if done:
                    self._cur = None
                self._advance(step, done)  # before yielding: a state saved now knows where the pass stands
                self._stats = batch.stats
                try:
                    yield batch
                except GeneratorExit:  # the loop was left (break): after the last batch, that ends the pass
                    if self._pass_left == 0:
                        self._pass_open = False
                    raise
            if self._pass_left == 0:
                self._pass_open = False
                return

    def _advance(self, step: _Step, done: bool) -> None:
        if not done:
            self._resume = (step.state_before, self._at)
            self._next_epoch = step.epoch
            return
        self._resume = (step.state_after, 0)
        if step.last_in_epoch:
            self._next_epoch = step.epoch + 1
            if self._pass_left is not None:
                self._pass_left -= 1
        else:
            self._next_epoch = step.epoch

    def _fetch(self) -> _Step | None:
        if self._graph is None:
            n = self._p.stream.num_docs
            self._graph = self._p.build(span=lambda epoch: (0, n), exchange=self.exchange, max_epochs=None,
                                        start_state=self._start)
        try:
            return self._graph.next()
        except StopIteration:
            return None

    # --- state ---------------------------------------------------------------------------------------------------

    def _fingerprint(self) -> dict:
        p = self._p
        return fingerprint(config=p.config, options=p.options, source=p.source, tokenizer_name=p.tokenizer_name(),
                           dp_rank=p.dp_rank, eos_appended=p.stream.eos_appended)

    def _settings(self) -> dict:
        """What every rank must agree on before the first step (the fingerprint without the rank's own index)."""
        out = {k: v for k, v in self._fingerprint().items() if k not in ("dp_rank", "span")}
        out.update(append_eos=self._p.options.append_eos, lengths=self.lengths_mode,
                   chunk_docs=self._p.options.chunk_docs)
        return out

    def state_dict(self) -> dict:
        """Where this rank's stream stands after the last batch yielded: plain Python data (torch.save/pickle).

        It does not depend on `num_threads`, `prefetch`, `chunk_docs`, `lengths`, the layout or the padding:
        a loader that differs from the saving one only in those resumes it exactly."""
        step_state, skip = self._resume
        return {
            "format": STATE_FORMAT,
            "fingerprint": self._fingerprint(),
            "next_epoch": self._next_epoch,
            "pass_left": self._pass_left,
            "pass_open": self._pass_open,
            "stats": msgspec.to_builtins(self.stats),
            "loader": {"step_state": step_state, "skip": skip},
        }

    def load_state_dict(self, state: dict, strict: bool = True) -> None:
        """Resume from `state_dict()` (of this rank): the next batch is the one that followed when it was saved.

        A state saved by a loader with another configuration, seed, shuffle, tokenizer, source or rank is refused,
        with `strict=False` too: continuing it would drop and repeat tokens (`strict` is kept for the torch
        signature only)."""
        check_state(state, self._fingerprint())
        self._close_graph()
        pos = state["loader"]
        self._start, self._skip = pos["step_state"], int(pos["skip"])
        self._resume = (self._start, self._skip)
        self._cur, self._at = None, 0
        self._next_epoch = int(state["next_epoch"])
        self._pass_left = state["pass_left"]
        self._pass_open = bool(state["pass_open"])
        self._stats = msgspec.convert(state["stats"], LoaderStats)

    def _close_graph(self) -> None:
        if self._graph is not None:
            self._graph.close()
            self._graph = None

    def close(self) -> None:
        """Stop the background threads (also done when the loader is garbage-collected)."""
        if self.exchange is not None:
            self.exchange.stop.set()
        self._close_graph()

    def __enter__(self) -> "PackedLoader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


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
        self._graph: _Graph | None = None
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
        self._p = _Pipeline(source, tokenizer=tokenizer, config=cfg, dp_rank=dp_rank, column=column, planner=planner,
                            seed=cfg.seed if seed is None else seed, check_ranks=False, **options)
        self._epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self._epoch = int(epoch)

    def __iter__(self) -> _StepIterator:
        from torch.utils.data import get_worker_info

        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        return _StepIterator(self, worker, workers)
