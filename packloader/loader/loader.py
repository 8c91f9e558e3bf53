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
`batch.extra` holds the `epoch`, `last_in_epoch`, the step's `plan` and the cumulative `stats`.

Epochs: a `for` pass yields `epochs` epochs (None: an endless stream); the next pass continues with the next
epoch. At the end of each epoch the planner is asked to flush what it holds back, so every token is trained
exactly once per epoch. Steps are numbered from 0 across epochs.

Ranks: `dp_rank` defaults to torch.distributed's rank when it is initialised and its world size equals
`config.parallel.dp`; otherwise pass it. With torch.distributed initialised (world > 1) each step's plan digest
is compared across all ranks through the process group's store; a rank that disagrees, or that does not answer
within `timeout` seconds, makes the others raise a RuntimeError naming the step and the ranks.

For torch DataLoader workers, use `PackedDataset` (below): each worker plans its own contiguous part of every
epoch and yields whole steps.
"""

from __future__ import annotations

import os
import re
from typing import Any, Iterator, Sequence

import msgspec
from torch.utils.data import IterableDataset
from torchdata.nodes import Loader, ParallelMapper, Prefetcher, Unbatcher

from packloader.balancers.registry import make_planner
from packloader.collate.batch import PackedBatch
from packloader.contracts import PlanConfig
from packloader.loader.distributed import RankExchange, next_instance, resolve_dp_rank, torch_rank_world
from packloader.loader.nodes import ChunkLoader, ChunkNode, StepCollator, StepNode, StepReader
from packloader.loader.state import (STATE_FORMAT, LoaderOptions, LoaderStats, check_fingerprint, fingerprint,
                                     validate_config, validate_options)
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
        self.collator = StepCollator(self.stream, layout=self.options.layout, pad_to_multiple=self.options.pad_to_multiple,
                                     pad_to_tokens=self.options.pad_to_tokens, pad_id=pad_id)

    def tokenizer_name(self) -> str | None:
        if self.stream.pretokenized and not self.stream.eos_appended:
            return None
        return getattr(self.stream.tokenizer, "name", type(self.stream.tokenizer).__name__)

    def build(self, *, span, exchange: RankExchange | None, max_epochs: int | None, start_epoch: int = 0,
              step_stride: int = 1, step_offset: int = 0, unbatch: bool = True):
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
            chunks = ParallelMapper(chunk_node, load, num_workers=threads, in_order=True, method="thread")
        steps = StepNode(chunk_node, chunks, self.stream, self.planner, self.config, self.dp_rank, span=span,
                         mode=mode, exchange=exchange, check_ranks=o.check_ranks, start_epoch=start_epoch,
                         step_stride=step_stride, step_offset=step_offset)
        if mode == "column" and threads > 0:
            # pre-tokenized: planning in one thread, reading this rank's tokens in another (Parquet decoding
            # releases the GIL), collating in a third (the prefetcher's)
            steps = ParallelMapper(steps, StepReader(self.stream), num_workers=1, in_order=True, method="thread",
                                   max_concurrent=1)
        # Collating runs in the prefetcher's thread: it is cheap next to tokenizing, and more collating threads
        # only fight over the GIL (measured: they made the pre-tokenized path slower on 2 cores).
        node = ParallelMapper(steps, self.collator, num_workers=0)
        if threads > 0:
            node = Prefetcher(node, prefetch_factor=o.prefetch)
        return Unbatcher(node) if unbatch else node


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
        n = self._p.stream.num_docs
        self._root = self._p.build(span=lambda epoch: (0, n), exchange=self.exchange, max_epochs=None)
        self._loader = Loader(self._root, restart_on_stop_iteration=False)
        self._it: Iterator | None = None
        self._last: PackedBatch | None = None
        self._next_epoch = 0
        self._pass_left: int | None = 0  # epochs left in the current pass; 0: none in progress

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
        if self._last is None:
            return LoaderStats()
        return self._last.extra["stats"]

    @property
    def epoch(self) -> int:
        """The epoch the next batch belongs to."""
        return self._next_epoch

    # --- iteration -----------------------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[PackedBatch]:
        """One pass: `epochs` epochs from where the loader stands (the rest of the pass a saved state was in)."""
        if self._it is None:
            self._it = iter(self._loader)
        left = self._pass_left if self._pass_left != 0 else self._p.options.epochs
        while True:
            try:
                batch = next(self._it)
            except StopIteration:
                return
            except Exception as e:
                clean = _unwrap(e)
                if clean is e:
                    raise
                raise clean from e
            end = batch is None or batch.extra["last_in_epoch"]  # None: no micro-batch here in an epoch's last step
            if end:
                self._next_epoch += 1
                if left is not None:
                    left -= 1
            elif batch is not None:
                self._next_epoch = batch.extra["epoch"]
            self._pass_left = left  # set before yielding: a state saved now knows where the pass stands
            if batch is not None:
                self._last = batch
                yield batch
            if left == 0:
                return

    # --- state ---------------------------------------------------------------------------------------------------

    def _fingerprint(self) -> dict:
        p = self._p
        return fingerprint(config=p.config, options=p.options, source=p.source, tokenizer_name=p.tokenizer_name(),
                           dp_rank=p.dp_rank, eos_appended=p.stream.eos_appended)

    def state_dict(self) -> dict:
        """Where this rank's stream stands after the last batch yielded: plain Python data (torch.save/pickle)."""
        return {
            "format": STATE_FORMAT,
            "fingerprint": self._fingerprint(),
            "next_epoch": self._next_epoch,
            "pass_left": self._pass_left,
            "stats": msgspec.to_builtins(self.stats),
            "loader": self._loader.state_dict(),
        }

    def load_state_dict(self, state: dict, strict: bool = True) -> None:
        """Resume from `state_dict()` (of this rank): the next batch is the one that followed when it was saved."""
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise ValueError(f"not a PackedLoader state (expected format {STATE_FORMAT!r})")
        if strict:
            check_fingerprint(state["fingerprint"], self._fingerprint())
        self._loader.load_state_dict(state["loader"])
        self._it = None
        self._next_epoch = int(state["next_epoch"])
        self._pass_left = state["pass_left"]
        self._last = None
        self._saved_stats = state.get("stats")

    def close(self) -> None:
        """Stop the background threads (also done when the loader is garbage-collected)."""
        if self.exchange is not None:
            self.exchange.stop.set()
        _shutdown(self._root)

    def __enter__(self) -> "PackedLoader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _StepIterator:
    """A worker's iterator over its steps, with state_dict/load_state_dict (torchdata's Stateful protocol, which
    StatefulDataLoader uses to save and restore each worker)."""

    def __init__(self, dataset: "PackedDataset", worker: int, workers: int) -> None:
        p = dataset._p
        n = p.stream.num_docs
        self.span = split_range(0, n, workers, worker)
        span = self.span
        self.dataset, self.worker, self.workers = dataset, worker, workers
        start = dataset._epoch
        max_epochs = None if p.options.epochs is None else start + p.options.epochs
        self.root = p.build(span=lambda epoch: span, exchange=None, max_epochs=max_epochs, start_epoch=start,
                            step_stride=workers, step_offset=worker, unbatch=False)
        self.loader = Loader(self.root, restart_on_stop_iteration=False)
        self.it = iter(self.loader)

    def __iter__(self):
        return self

    def __next__(self) -> list[PackedBatch]:
        while True:
            try:
                batches = next(self.it)
            except StopIteration:
                raise
            except Exception as e:
                clean = _unwrap(e)
                if clean is e:
                    raise
                raise clean from e
            batches = [b for b in batches if b is not None]
            if batches:
                return batches

    def _fingerprint(self) -> dict:
        p = self.dataset._p
        return fingerprint(config=p.config, options=p.options, source=p.source, tokenizer_name=p.tokenizer_name(),
                           dp_rank=p.dp_rank, eos_appended=p.stream.eos_appended, span=self.span)

    def state_dict(self) -> dict:
        return {"format": STATE_FORMAT, "fingerprint": self._fingerprint(), "loader": self.loader.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        check_fingerprint(state["fingerprint"], self._fingerprint())
        self.loader.load_state_dict(state["loader"])
        self.it = iter(self.loader)


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
