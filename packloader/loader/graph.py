"""The torchdata graph behind `PackedLoader` and `PackedDataset`: reading and tokenizing, drawing and planning
steps, collating, with prefetching; built fresh on every resume (see `loader.py`)."""

from __future__ import annotations

import re
import threading
import traceback
from dataclasses import dataclass

import msgspec
from torchdata.nodes import ParallelMapper, Prefetcher

from packloader.balancers.factory import make_planner
from packloader.collate.batch import PackedBatch
from packloader.contracts import PlanConfig
from packloader.loader.chunks import ChunkLoader, ChunkNode
from packloader.loader.default_model import note_default_model
from packloader.loader.distributed import RankExchange, resolve_dp_rank
from packloader.loader.entry_metrics import tag_entries
from packloader.loader.graph_threads import stop, watch
from packloader.loader.nodes import StepCollator, StepNode, StepReader, StepWork
from packloader.loader.state import LoaderOptions, validate_config, validate_options
from packloader.sources.mixed_stream import MixedStream
from packloader.sources.mixture import Mixture
from packloader.sources.stream import DocumentStream


def _open(source, column: str | None):
    from packloader.sources.dispatch import open_any

    return open_any(source, column=column)


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


class LoaderPipeline:
    """What PackedLoader and PackedDataset share: options, stream, planner, and the node graph."""

    def __init__(self, source, *, tokenizer, config, dp_rank, column, planner=None, **options) -> None:
        self.config: PlanConfig = validate_config(config)  # the one place the loaders validate it
        self.options: LoaderOptions = validate_options(self.config, **options)
        if self.options.pad_to_tokens is not None and self.options.pad_to_tokens < self.config.max_tokens:
            raise ValueError(
                f"pad_to_tokens={self.options.pad_to_tokens} is below config.max_tokens={self.config.max_tokens}: "
                "a full micro-batch would not fit"
            )
        self.dp_rank = resolve_dp_rank(dp_rank, self.config.parallel.dp)
        tok_threads = 1 if self.options.num_threads > 0 else None  # the chunk stage's threads run tokenizers
        if isinstance(source, Mixture):  # a mixture reads as one stream (sources/mixed_stream.py)
            self.stream = MixedStream(source, tokenizer, seed=self.options.seed, shuffle=self.options.shuffle,
                                      append_eos=self.options.append_eos, tokenizer_threads=tok_threads)
            self.source = self.stream.source
            if self.config.parallel.dp > 1:
                self.stream.readahead = 0  # a rank reads its own documents only
        else:
            self.source = _open(source, column)
            self.stream = DocumentStream(self.source, tokenizer, seed=self.options.seed, shuffle=self.options.shuffle,
                                         append_eos=self.options.append_eos, tokenizer_threads=tok_threads)
        self.own_planner = planner is None  # made from the config here: `reprice` may make it again
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

    def reprice(self, model: str) -> None:
        """Plans priced as `model` (PlanConfig.model) from here on: a new config, validated, and the planner made
        for it (refused for a planner object the user passed, which holds its own cost model)."""
        if not self.own_planner:
            raise ValueError("the loader plans with a planner object passed to it, which holds its own cost model: "
                             "build that planner for the model instead")
        self.config = validate_config(msgspec.structs.replace(self.config, model=model))
        self.planner = make_planner(self.config)

    def tokenizer_name(self) -> str | None:
        if self.stream.pretokenized and not self.stream.eos_appended:
            return None
        return getattr(self.stream.tokenizer, "name", type(self.stream.tokenizer).__name__)

    def replay(self, config: PlanConfig, step_state: dict | None, span) -> StepWork:
        """The step at `step_state` as `config` plans it, in this thread (elastic resume: the interrupted step as
        the saving layout planned it). A registry planner for `config`, not this pipeline's planner object."""
        mode = "local" if self.mode == "gather" else self.mode
        chunk_node = ChunkNode(span, self.options.chunk_docs, None)
        chunks = ParallelMapper(chunk_node, ChunkLoader(self.stream, mode, 0, 1), num_workers=0)
        node = StepNode(chunk_node, chunks, self.stream, make_planner(config), config, 0, span=span, mode=mode,
                        check_ranks=False, start_state=step_state, cp_rank=0)
        try:
            node.reset(None)
            return node.next()
        finally:
            node.close()

    def build(self, *, span, exchange: RankExchange | None, max_epochs: int | None, start_epoch: int = 0,
              step_stride: int = 1, step_offset: int = 0, start_state: dict | None = None) -> "StepGraph":
        """A fresh node graph whose StepNode starts at `start_state` (None: the start). Its items are `ReadyStep`s.

        The loader never resets a graph that has run: torchdata joins a replaced stage's threads with a timeout
        and lets them run on, so a thread of the old graph could still draw a step from a node that was reset to a
        saved state, and that step would be lost. Resuming builds a new graph and closes the old one instead;
        the state is the StepNode's, not torchdata's, so it does not depend on threads, prefetching or the
        lengths mode."""
        note_default_model(self.config)
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
                         step_stride=step_stride, step_offset=step_offset, start_state=start_state, lock=self.lock,
                         cp_rank=o.cp_rank)
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
        return StepGraph(node, steps)


@dataclass
class ReadyStep:
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

    def __call__(self, work) -> ReadyStep:
        step = self.collator(work)
        tag_entries(step, self.collator.stream)  # a mixture's entry of each segment
        out = [b for b in step if b is not None]
        return ReadyStep(out, work.epoch, work.last_in_epoch, work.state_before, work.state_after)


class StepGraph:
    """A node graph, started by the first `next`; `close` stops its threads and makes its StepNode refuse to
    draw again (a thread that outlives the join only ever sees this graph's nodes), then lets go of the nodes,
    so torchdata's iterators are collected now rather than at interpreter shutdown."""

    def __init__(self, root, steps: StepNode) -> None:
        self.root, self.steps = root, steps
        self.started = False
        self._watch = None  # stops the threads if the graph is dropped unclosed, or at exit (graph_threads)

    def next(self) -> ReadyStep:
        if self.root is None:
            raise RuntimeError("this step graph is closed (after an error, or close()): build a new one")
        if not self.started:
            self._watch = watch(self, self.root, self.steps)
            self.root.reset()
            self.started = True
        try:
            return next(self.root)
        except StopIteration:
            raise
        except Exception as e:
            # a failed graph cannot go on: stop its threads now, and let the traceback (kept until exit as
            # sys.last_traceback) hold no torchdata iterator whose __del__ would run at interpreter shutdown
            self.close()
            traceback.clear_frames(e.__traceback__)
            clean = _unwrap(e)
            if clean is e:
                raise
            raise clean from e

    def close(self, *, final: bool = False, wait: float = 0.0) -> None:
        """`final`: the loader is done with its rank exchange too; `wait`: seconds to wait for the threads. Threads
        that outlive the wait are kept by graph_threads and stopped at exit; the graph lets go of its nodes now."""
        if self.root is None:
            return
        if self._watch is not None:
            self._watch.detach()
        stop(self.root, self.steps, final=final, wait=wait)
        self.root = self.steps = None


