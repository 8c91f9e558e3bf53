"""The loader's stages as torchdata nodes.

```
ChunkNode         epoch order in chunks of `chunk_docs` positions              state: (epoch, position)
  -> ParallelMapper(load_chunk, threads, in_order)   lengths (+ tokens) of each chunk
  -> StepNode      draw a window of tokens_per_step, cut over-long documents,   state: cursor, step, planner
                   plan, check ranks agree                                      state (queue), stats
  -> ParallelMapper(StepReader, 1 thread)           column mode: read this rank's documents (Parquet decodes
                                                    without the GIL, several row groups at once)
  -> ParallelMapper(StepCollator)                   collate this rank's micro-batches (numba, without the GIL)
  -> Prefetcher    the next steps are planned, read and collated while this one trains
```
(the loader hands out the micro-batches of each step one at a time; its state: a StepNode state and an index)
How each rank learns the lengths (`lengths=`):
- "column": a pre-tokenized source with a length column. Every rank reads the global lengths (a few bytes per
  document, no tokens) and reads tokens only for the documents of its own micro-batches (in one reading thread
  of its own, ahead of the trainer: sources cache decoded row groups per thread, so one reading thread decodes
  each row group once; measured on 2 cores, planning, reading and collating in three threads beat one thread
  doing all three, because decoding and the collate kernel release the GIL).
- "local": every rank reads and tokenizes every document (the cost paid on every rank), kept until collated.
- "gather": ranks share the tokenizing: each of the W ranks tokenizes its contiguous 1/W of each chunk, the
  lengths are all-gathered through the rank store, and a rank reads and tokenizes again only those documents of
  its own micro-batches that another rank tokenized (about 2/W of the stream per rank instead of all of it).

Resume: StepNode's state is small (the position of the first document not yet drawn, with the tokens of it
already drawn when a step ended inside it, the step, the planner's state with its queue of delayed pieces, the
lengths of those documents, the stats, and after an elastic resume the interrupted step's untrained rest to plan
first). On reset it restarts the chunk stage at that position, so nothing drawn is kept in the state: delayed pieces are re-read by id. Each
StepWork carries the state before and after its step: those are the loader's resume points, so torchdata's own
snapshots of the graph are not used, and a resume builds a new graph rather than resetting a running one.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, Sequence

import msgspec
import numpy as np
from torchdata.nodes import BaseNode

from packloader.balancers.draw import cut_pieces, step_ends
from packloader.balancers.planners.contract import check_step_plan
from packloader.balancers.planners.registry import StepLayout, Window, cost_model_for
from packloader.collate.collate import collate_step, loss_tokens_in_plan
from packloader.contracts import LoaderStats, MicroBatch, PlanConfig, PlannerState, StepMetrics, StepPlan
from packloader.loader.chunks import Chunk, ChunkNode
from packloader.loader.distributed import RankExchange, digest
from packloader.loader.entry_metrics import with_entry_counts
from packloader.loader.loss_masks import StepMasks
from packloader.loader.micro_batch_count import check_micro_batch_count
from packloader.loader.pool import localize_step, own_rank, ranks_expected
from packloader.loader.state import StepState, step_state
from packloader.loader.step_metrics import draw_steps, padding_of, step_metrics
from packloader.sources.order import split_range
from packloader.sources.stream import DocumentStream


@dataclass
class StepWork:
    """A planned step, on its way to the collate stage."""

    step: int
    epoch: int
    plan: StepPlan
    micro_batches: list[MicroBatch]  # this rank's
    doc_lengths: dict[int, int]  # every document of this rank's segments
    tokens: dict[int, np.ndarray]  # tokens already at hand (local/gather modes)
    loss_tokens: int
    last_in_epoch: bool
    stats: LoaderStats
    # StepNode states: replaying from `state_before` plans this step again; `state_after` plans the next one
    state_before: dict | None = None
    state_after: dict | None = None
    step_lengths: dict[int, int] | None = None  # every document of the step's plan (all ranks)
    metrics: StepMetrics | None = None  # the step's record for the trainer's logs (padding added at collation)
    drawn: dict[int, int] | None = None  # doc -> first draw step, for the documents drawn before this step
    pool_gpu: int | None = None  # per-document CP: this GPU's index in the DP x CP pool (loader.pool)


class StepNode(BaseNode[StepWork]):
    """Draws each step's window from the chunk stage, plans it, and hands this rank's part on."""

    def __init__(
        self,
        chunk_node: ChunkNode,
        chunks: BaseNode[Chunk],
        stream: DocumentStream,
        planner,
        config: PlanConfig,
        dp_rank: int,
        *,
        span: Callable[[int], tuple[int, int]],
        mode: str,
        exchange: RankExchange | None = None,
        check_ranks: bool = True,
        start_epoch: int = 0,
        step_stride: int = 1,
        step_offset: int = 0,
        start_state: dict | None = None,
        lock: threading.Lock | None = None,
        cp_rank: int | None = None,
    ) -> None:
        super().__init__()
        self.chunk_node, self.chunks, self.stream = chunk_node, chunks, stream
        self.planner, self.config, self.dp_rank, self.cp_rank = planner, config, dp_rank, cp_rank
        self.pool_gpu = dp_rank  # the index of this loader's RankPlan (loader.pool.own_rank), set per step
        self.span, self.mode, self.exchange, self.check_ranks = span, mode, exchange, check_ranks
        self.start_epoch = start_epoch
        self.step_stride, self.step_offset = step_stride, step_offset
        self.start_state = start_state  # where reset(None) starts: a saved state_after/state_before, or the start
        # One lock for every StepNode of a pipeline: the planner object is shared, and a thread of a graph that was
        # replaced (torchdata joins its threads with a timeout) may still be planning when the new graph starts.
        self._lock = lock if lock is not None else threading.Lock()
        self._closed, self._masks = False, StepMasks(stream)

    def close(self) -> None:
        """Make any later next() stop: a thread left over from a replaced graph must not draw another step."""
        self._closed = True

    # --- state ---------------------------------------------------------------------------------------------------

    def fresh_state(self, epoch: int | None = None) -> dict:
        e = self.start_epoch if epoch is None else epoch
        return step_state(epoch=int(e), pos=int(self.span(e)[0]), offset=0, k=0, flushing=False, planner=PlannerState(),
                          queued_lengths=[], stats=LoaderStats())

    def get_state(self) -> dict:
        return step_state(epoch=int(self.epoch), pos=int(self.pos), offset=int(self.offset), k=int(self.k),
                          flushing=bool(self.flushing), remainder=self.remainder, planner=self.pstate,
                          queued_lengths=[[int(d), int(n)] for d, n in self.queued_lengths.items()], stats=self.stats,
                          first_drawn=[[int(d), int(n)] for d, n in sorted(self.first_drawn.items())])

    def reset(self, initial_state: dict | None = None) -> None:
        with self._lock:
            super().reset(initial_state)
            st = initial_state if initial_state is not None else self.start_state
            if st is None:
                st = self.fresh_state()
            st = msgspec.convert(st, StepState)
            self.epoch, self.pos, self.k, self.offset = st.epoch, st.pos, st.k, st.offset
            self.flushing = st.flushing
            self.remainder = st.remainder  # an interrupted step to finish first (elastic resume)
            self.pstate = st.planner
            self.queued_lengths = {d: n for d, n in st.queued_lengths}
            self.first_drawn = {d: n for d, n in st.first_drawn}  # documents drawn over several steps
            self.stats = st.stats
            # what was drawn from the chunk stage but not yet into a window (not part of the state: re-read)
            self._buf_ids = np.zeros(0, np.int64)
            self._buf_len = np.zeros(0, np.int64)
            self._buf_at = 0
            self._tokens: dict[int, np.ndarray] = {}
            self._last_seen = False  # the current epoch's last chunk has been pulled
            self._pending: Chunk | None = None  # a chunk of a later epoch, pulled while looking for more
            self._exhausted = False
            lo, hi = self.span(self.epoch)
            start = (self.epoch + 1, None) if self.pos >= hi else (self.epoch, self.pos)
            self._last_seen = self.pos >= hi
            self.chunk_node.set_start(*start)
            self.chunks.reset(None)

    # --- drawing ---------------------------------------------------------------------------------------------------

    def _pull(self) -> bool:
        """Refill the buffer with the next chunk of the current epoch. False when the epoch has no more."""
        if self._last_seen:
            return False
        chunk = self._pending
        self._pending = None
        while chunk is None:
            if self._exhausted:
                return False
            try:
                chunk = next(self.chunks)
            except StopIteration:
                self._exhausted = True
                return False
            if chunk.spec.epoch < self.epoch:
                chunk = None  # left over from before a reset; cannot happen with a fresh chunk stage
        if chunk.spec.epoch > self.epoch:
            self._pending = chunk
            return False
        if self.mode == "gather" and self.exchange is not None:
            self._gather_lengths(chunk)
        self._buf_ids, self._buf_len, self._buf_at = chunk.ids, chunk.lengths, 0
        self._tokens.update(chunk.tokens)
        self._last_seen = chunk.spec.last
        return True

    def _gather_lengths(self, chunk: Chunk) -> None:
        spec = chunk.spec
        a, b = split_range(spec.start, spec.stop, self.exchange.world, self.exchange.rank)
        mine = np.ascontiguousarray(chunk.lengths[a - spec.start : b - spec.start], dtype=np.int64)
        parts = self.exchange.all_gather(
            f"len/{spec.epoch}/{spec.start}", mine.tobytes(),
            lambda: f"epoch {spec.epoch}: exchanging the lengths of documents {spec.start}..{spec.stop - 1}",
        )
        lengths = np.concatenate([np.frombuffer(p, dtype=np.int64) for p in parts])
        if len(lengths) != len(chunk.ids):
            raise RuntimeError(
                f"packloader: epoch {spec.epoch}: ranks sent {len(lengths)} lengths for a chunk of {len(chunk.ids)} "
                "documents; the ranks read different sources"
            )
        chunk.lengths = lengths

    def _draw(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, bool]:
        """Documents (ids, whole lengths, first and end token drawn) until tokens_per_step is reached (within one
        piece: the step may end inside a document, at `self.offset`) or the epoch ends; and whether it ended."""
        target, context = self.config.tokens_per_step, self.config.context
        ids, lens, starts, stops = [], [], [], []
        total = 0  # tokens drawn from earlier buffers
        while True:
            if self._buf_at >= len(self._buf_ids):
                if not self._pull():
                    break
                continue
            rest = self._buf_len[self._buf_at :]
            at = self.offset
            end = step_ends(rest, target, context, steps=1, filled=total, offset=at)  # none: not a whole step here
            k, e = (int(x) for x in end[0]) if len(end) else (len(rest), 0)
            take = k + (e > 0)
            start, stop = np.zeros(take, np.int64), rest[:take].copy()
            if take:
                start[0] = at
                if e:
                    stop[-1] = e
            ids.append(self._buf_ids[self._buf_at : self._buf_at + take])
            lens.append(rest[:take])
            starts.append(start)
            stops.append(stop)
            self._buf_at += k
            self.offset = e
            if len(end):
                break
            total += int(rest.sum()) - at
        if self._buf_at >= len(self._buf_ids) and not self._last_seen:
            self._pull()  # learn whether the epoch ends here (the next chunk may be the next epoch's)
        done = self._buf_at >= len(self._buf_ids) and (self._last_seen or self._pending is not None or self._exhausted)
        if ids:
            return np.concatenate(ids), np.concatenate(lens), np.concatenate(starts), np.concatenate(stops), done
        z = np.zeros(0, np.int64)
        return z, z, z, z, done

    # --- planning --------------------------------------------------------------------------------------------------

    def next(self) -> StepWork:
        with self._lock:
            if self._closed:
                raise StopIteration
            before = self.get_state()
            while True:
                work = self._next_step()
                if work is not None:
                    work.state_before, work.state_after = before, self.get_state()
                    return work

    def _next_step(self) -> StepWork | None:
        if self.remainder is not None:
            return self._remainder_step()
        cfg = self.config
        if self.flushing:
            ids = lens = starts = stops = np.zeros(0, np.int64)
            done = True
        else:
            if self._exhausted and self._buf_at >= len(self._buf_ids) and self._pending is None:
                raise StopIteration
            ids, lens, starts, stops, done = self._draw()
            if len(ids) == 0 and not self.pstate.queued:
                if self._exhausted and self._pending is None:
                    raise StopIteration
                self._advance_epoch()  # an epoch with nothing (left) to plan
                return None
            first = starts == 0  # documents whose first token is drawn now (the others were counted before)
            self.stats.documents += int(first.sum())
            self.stats.tokens += int((stops - starts).sum())
            self._masks.drawn(self._tokens, ids, starts, self.stats)  # SFT sources: their drop counts
            empty = lens == 0
            if empty.any():
                self.stats.empty_documents += int(empty.sum())
                ids, lens, starts, stops = ids[~empty], lens[~empty], starts[~empty], stops[~empty]
        window, split_docs, split_pieces = cut_pieces(ids, lens, cfg.context, starts, stops)
        self.stats.split_documents += split_docs
        self.stats.split_pieces += split_pieces
        doc_len = dict(zip(ids.tolist(), lens.tolist()))
        doc_len.update(self.queued_lengths)

        step = self.step_offset + self.k * self.step_stride
        state_in = self.pstate  # the flush travels in StepLayout (`_plan`), never in the state
        drawn = draw_steps(state_in, self.first_drawn)
        plan, new_state = self._plan(window, state_in, step, done)
        loss_tokens = loss_tokens_in_plan(plan, doc_len, self._masks.plan_tokens(self._tokens, plan))
        plan = msgspec.structs.replace(plan, loss_tokens=loss_tokens)
        mbs, lengths, tokens = self._own_part(plan, window, doc_len)
        # carry the queue; forget what is planned
        self.queued_lengths = {q.doc: doc_len[q.doc] for q in new_state.queued}
        keep = set(self.queued_lengths)
        if self.offset:  # the document the step ended inside: its next pieces are the next step's first
            keep.add(int(self._buf_ids[self._buf_at]))
            self.first_drawn.setdefault(int(self._buf_ids[self._buf_at]), step)
            rest = int(self._buf_len[self._buf_at]) - self.offset
            self.stats.delayed_pieces += -(-rest // cfg.context)
        self.first_drawn = {d: n for d, n in self.first_drawn.items() if d in keep}
        for d in doc_len:
            if d not in keep:
                self._tokens.pop(d, None)
        self.pstate = new_state
        self.k += 1
        self.stats.steps += 1
        self.stats.delayed_pieces += len(new_state.queued)
        epoch = self.epoch
        model = getattr(self.planner, "model", None) or cost_model_for(cfg)
        metrics = step_metrics(plan, model, cfg, epoch=epoch, state_in=state_in, state_out=new_state, drawn=drawn)
        metrics = with_entry_counts(metrics, plan, self.stream, doc_len)
        last = False
        if done:
            if new_state.queued:
                self.flushing = True
            else:
                last = True
                self.stats.epochs_completed += 1
                self._advance_epoch()
        else:
            self.pos = int(self._buf_ids[self._buf_at]) % self.stream.num_docs if self._buf_at < len(self._buf_ids) \
                else self._next_pos_after_buffer()
        return StepWork(step, epoch, plan, mbs, lengths, tokens, loss_tokens, last, self.stats.copy(),
                        step_lengths=doc_len, metrics=metrics, drawn=drawn, pool_gpu=self.pool_gpu)

    def _plan(self, window, state_in: PlannerState, step: int, done: bool,
              remainder: bool = False) -> tuple[StepPlan, PlannerState]:
        """The planner's plan of a window, checked: ranks, the flush, the pinned count, the contract."""
        cfg = self.config
        plan, new_state = self.planner.plan(window, state_in, layout := StepLayout(step, flush=done))
        planned = sum(mb.num_tokens for r in plan.ranks for mb in r.micro_batches)
        if len(plan.ranks) != ranks_expected(plan, cfg.parallel):
            raise RuntimeError(f"planner {cfg.strategy!r} returned {len(plan.ranks)} ranks for parallel.dp="
                               f"{cfg.parallel.dp}, cp={cfg.parallel.cp} (cp_mode {plan.cp_mode!r})")
        if done and new_state.queued and planned == 0:
            raise RuntimeError(
                f"planner {cfg.strategy!r} keeps {len(new_state.queued)} pieces queued at the end of epoch "
                f"{self.epoch} although asked to flush (StepLayout.flush); every token must be planned "
                "once per epoch"
            )
        check_micro_batch_count(plan, cfg, int(window.length.sum()), sum(q.length for q in state_in.queued), remainder)
        check_step_plan(plan, window, state_in, new_state, cfg, layout)
        return plan, new_state

    def _own_part(self, plan: StepPlan, window, doc_len: dict[int, int]):
        """Check the plan with the other ranks; this rank's micro-batches, their documents' lengths and the tokens
        at hand; count them in the stats."""
        if self.exchange is not None and self.check_ranks:
            self.exchange.check_plan(plan.step, digest(window.doc, window.offset, window.length),
                                     digest(msgspec.json.encode(plan)))
        self.pool_gpu = own_rank(plan, self.config.parallel, self.dp_rank, self.cp_rank)
        mbs = plan.ranks[self.pool_gpu].micro_batches
        own_docs = {s.doc for mb in mbs for s in mb.segments}
        self.stats.rank_micro_batches += len(mbs)
        self.stats.rank_tokens += sum(mb.num_tokens for mb in mbs)
        return mbs, {d: doc_len[d] for d in own_docs}, {d: self._tokens[d] for d in own_docs if d in self._tokens}

    def _remainder_step(self) -> StepWork:
        """An interrupted step's untrained pieces, planned again for this layout (elastic resume, `loader.elastic`)
        as the same step number, with the step's loss normaliser; then the stream goes on from after that step."""
        rem = self.remainder
        window = Window(*(np.array(c, dtype=np.int64).reshape(-1) for c in zip(*rem["pieces"]))) if rem["pieces"] \
            else Window(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64))
        doc_len = {int(d): int(n) for d, n in rem["doc_lengths"]}
        plan, _ = self._plan(window, PlannerState(), int(rem["step"]), True, remainder=True)
        plan = msgspec.structs.replace(plan, loss_tokens=int(rem["loss_tokens"]))
        mbs, lengths, tokens = self._own_part(plan, window, doc_len)
        self.remainder = None
        model = getattr(self.planner, "model", None) or cost_model_for(self.config)
        metrics = step_metrics(plan, model, self.config, epoch=int(rem["epoch"]), state_in=PlannerState(),
                               state_out=PlannerState(), drawn={int(d): int(n) for d, n in rem.get("drawn", [])})
        return StepWork(plan.step, int(rem["epoch"]), plan, mbs, lengths, tokens, plan.loss_tokens, bool(rem["last"]),
                        self.stats.copy(), step_lengths=doc_len, metrics=metrics, pool_gpu=self.pool_gpu)

    def _next_pos_after_buffer(self) -> int:
        if len(self._buf_ids):
            return int(self._buf_ids[-1]) % self.stream.num_docs + 1
        return self.pos

    def _advance_epoch(self) -> None:
        self.flushing = False
        self.offset = 0
        self.epoch += 1
        self.pos = self.span(self.epoch)[0]
        self._last_seen = False
        self._buf_ids, self._buf_len = np.zeros(0, np.int64), np.zeros(0, np.int64)
        self._buf_at = 0


def read_missing(stream: DocumentStream, work: StepWork) -> StepWork:
    """Read the tokens of this rank's documents that are not at hand yet (column mode: all of them; gather mode:
    those another rank tokenized), checking each against the length it was planned with."""
    missing = sorted(d for d in work.doc_lengths if d not in work.tokens)
    if not missing:
        return work
    tokens = dict(work.tokens)
    for d, t in zip(missing, stream.read(missing)):
        if len(t) != work.doc_lengths[d]:
            raise RuntimeError(
                f"packloader: document {d} ({stream.keys([d])[0]}) has {len(t)} tokens on reading, but "
                f"its length was {work.doc_lengths[d]} when planned (a length column that disagrees with the "
                "tokens, or a source that changed)"
            )
        tokens[d] = t
    work.tokens = tokens
    return work


class StepReader:
    """The map function of the read stage (one thread): this rank's tokens of a planned step.

    Its own thread, because decoding Parquet row groups releases the GIL: the next step is read while this one is
    collated. One thread only: sources keep decoded row groups per thread, so several reading threads would
    decode the same row groups once each.
    """

    def __init__(self, stream: DocumentStream) -> None:
        self.stream = stream

    def __call__(self, work: StepWork) -> StepWork:
        return read_missing(self.stream, work)


class StepCollator:
    """The map function of the collate stage: this rank's micro-batches of one step as PackedBatches."""

    def __init__(self, stream: DocumentStream, *, layout: str = "flat", pad_to_multiple: int | None = None,
                 pad_to_tokens: int | None = None, pad_id: int = 0) -> None:
        self.stream = stream
        self.kw = dict(layout=layout, pad_to_multiple=pad_to_multiple, pad_to_tokens=pad_to_tokens, pad_id=pad_id)

    def __call__(self, work: StepWork) -> Sequence:
        tokens = read_missing(self.stream, work).tokens
        metrics = work.metrics
        if metrics is not None:
            pad = padding_of(work.plan, self.kw["pad_to_multiple"], self.kw["pad_to_tokens"])
            metrics = msgspec.structs.replace(metrics, padding_tokens=pad)
        out = collate_step([mb.segments for mb in work.micro_batches], tokens, step=work.step,
                           loss_tokens_in_step=work.loss_tokens, dp_groups=[mb.dp_group for mb in work.micro_batches],
                           epoch=work.epoch, last_in_epoch=work.last_in_epoch, plan=work.plan, stats=work.stats,
                           step_metrics=metrics, **self.kw)
        if work.plan.cp_mode == "dynamic":
            out = localize_step(out, work.micro_batches, work.pool_gpu, len(work.plan.ranks))
        if not out and work.last_in_epoch:
            # a rank with no micro-batch in the epoch's last step still needs to see the epoch end
            return [None]
        return out
