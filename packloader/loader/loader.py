"""`PackedLoader`: shards in, this rank's packed micro-batches out, resumable exactly.

```python
loader = PackedLoader("shards/*.parquet", tokenizer="tekken", config=PlanConfig(...))
for batch in loader:                   # one epoch per `for` (epochs=1); PackedBatch objects, in order
    ...
state = loader.state_dict()            # StatefulDataLoader conventions: load_state_dict(state) resumes here
```

Every step the loader cuts documents longer than `config.context` into independent pieces (counted in
`loader.stats`, never dropped) and draws pieces in the epoch's order until `config.tokens_per_step` tokens are
reached: a step holds `tokens_per_step` within one piece (fewer than `tokens_per_step + context` tokens, whatever
the documents), and the rest of a document it ends inside goes to the next steps (`balancers.draw`). It plans
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
the next `for` is the next epoch. A state saved after the loop resumes before the next pass. At another layout
(elastic resume, `loader.elastic`): any rank's state saved at a step boundary, or `merge_states` of every rank's.

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

from typing import Any, Iterator

import msgspec

from packloader.collate.batch import PackedBatch
from packloader.contracts import LoaderStats, PlanConfig
from packloader.loader.distributed import RankExchange, check_settings, next_instance, torch_rank_world
from packloader.loader.elastic import elastic_start, same_layout
from packloader.loader.graph import LoaderPipeline, ReadyStep, StepGraph
from packloader.loader.mixture_resume import mixture_state, resume_mixture
from packloader.loader.state import (
    LoaderOptions,
    check_state_shape,
    fingerprint,
    options_doc,
    options_signature,
    saved_state,
    upgraded,
)
from packloader.loader.state_check import StateContext, check_skip, check_state_values, source_lengths
from packloader.sources.stream import DocumentStream


class PackedLoader:
    """This rank's packed micro-batches (`PackedBatch`), in order; see the module docstring.

    `source`: a `Source`, or a path / glob / list of paths for `open_source` (`column` picks the column or field).
    `tokenizer`: a name for `get_tokenizer` ("tekken", "cl100k", "bytes", "hf:PATH") or a Tokenizer; only used for
    text sources. `config`: a PlanConfig or its dict (validated by `validate_config`). `dp_rank`: this rank (default
    torch.distributed's). `planner`: a Planner object to use instead of `make_planner(config)` (for planners outside
    the registry). The other keyword arguments are `LoaderOptions` fields:
    """

    def __init__(self, source, *, tokenizer: Any = "tekken", config: PlanConfig | dict, dp_rank: int | None = None,
                 column: str | None = None, planner=None, **options: Any) -> None:
        self._p = LoaderPipeline(source, tokenizer=tokenizer, config=config, dp_rank=dp_rank, column=column,
                                 planner=planner, **options)
        o = self._p.options
        self.exchange: RankExchange | None = None
        if (o.check_ranks or self._p.mode == "gather") and torch_rank_world() is not None:
            self.exchange = RankExchange.from_torch(f"{o.name}-{next_instance()}", o.timeout)
        if self.exchange is not None and o.check_ranks:
            check_settings(self.exchange, self._settings())
        self._graph: StepGraph | None = None  # built on the first batch asked for
        self._start: dict | None = None  # StepNode state the next graph starts from (None: the start)
        self._skip = 0  # micro-batches of the first step that were yielded before the state was saved
        self._cur: ReadyStep | None = None  # the step being yielded
        self._at = 0  # its next micro-batch
        self._resume: tuple[dict | None, int] = (None, 0)  # where the stream stands after the last batch yielded
        self._stats = LoaderStats()  # as of the last batch yielded (or the state loaded)
        self._next_epoch = 0
        self._pass_left: int | None = 0  # epochs left in the open pass (None: endless)
        self._pass_open = False  # a pass started and its `for` has not ended
        self._changes: list = []  # a mixture's changes at resume (`loader.mixture_resume`)

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

    def reprice(self, model: str) -> None:
        """Price plans as `model` (a `PlanConfig.model` string, e.g. `packloader.model_spec(hf_config)`), before
        the first batch: what PackedTrainer does when the config left the model at its default."""
        if self._graph is not None or self._pass_open:
            raise RuntimeError("reprice() before the first batch only: steps already planned keep their prices")
        self._p.reprice(model)

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

    def _advance(self, step: ReadyStep, done: bool) -> None:
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

    def _fetch(self) -> ReadyStep | None:
        if self._graph is None:
            n = self._p.stream.num_docs
            self._graph = self._p.build(span=lambda epoch: (0, n), exchange=self.exchange, max_epochs=None,
                                        start_state=self._start)
        try:
            return self._graph.next()
        except StopIteration:
            return None
        except Exception:  # the graph closed itself: a new pass starts again where the stream stands
            self._graph = None
            self._start, self._skip = self._resume
            raise

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
        return saved_state(fingerprint=self._fingerprint(), step_state=step_state, skip=skip,
                           next_epoch=self._next_epoch, pass_left=self._pass_left, pass_open=self._pass_open,
                           stats=self.stats, mixture=mixture_state(self._p.stream, step_state, self._changes))

    def load_state_dict(self, state: dict, strict: bool = True) -> None:
        """Resume from `state_dict()`: the next batch is the one that followed when it was saved.

        At another layout (dp, pp, cp, tp, num_micro_batches, strategy, cp_mode, max_tokens, tokens_per_step: elastic
        resume, `loader.elastic`), pass any rank's state saved at a step boundary, or `merge_states` of every
        rank's state of one save: the interrupted step's untrained remainder is planned for this layout first.
        A state saved with another source, seed, shuffle, tokenizer, EOS setting or context is refused, with
        `strict=False` too: continuing it would drop and repeat tokens (`strict` is kept for the torch signature
        only). So is a state whose numbers describe no point of this stream (`state_check.py`), naming the field;
        a mid-step state's step is planned here, to check `skip` against it (the loader is left as it was when
        refused)."""
        state = upgraded(state)  # a state saved before a config field existed: the field as it was then
        saved = check_state_shape(state)  # the SavedState (msgspec.convert); the checks below read the plain dict
        state = resume_mixture(state, self._fingerprint, self._p.stream)  # a mixture: its blend; a change, recorded
        fp = self._fingerprint()
        n = self._p.stream.num_docs
        if saved.ranks is None:
            check_state_values(state, StateContext(num_docs=n, span=(0, n), doc_lengths=source_lengths(self._p.stream)))
        if saved.ranks is None and same_layout(saved.fingerprint, fp):
            start, skip = state["loader"]["step_state"], saved.loader.skip
            next_epoch, pass_left, pass_open = int(saved.next_epoch), saved.pass_left, saved.pass_open
        else:
            r = elastic_start(state, fp, lambda config, at: self._p.replay(config, at, lambda epoch: (0, n)))
            start, skip = r.step_state, 0
            next_epoch, pass_left, pass_open = r.next_epoch, r.pass_left, r.pass_open
        previous = self.state_dict()
        self._apply(start, skip, next_epoch, pass_left, pass_open, state["stats"])
        self._changes = list((state.get("mixture") or {}).get("changes", []))
        if self._skip:  # mid-step: plan the step now, to check `skip` against it (it is the first one yielded)
            try:
                self._plan_skipped_step(start["k"])
            except BaseException:
                was = previous["loader"]
                self._apply(was["step_state"], was["skip"], previous["next_epoch"], previous["pass_left"],
                            previous["pass_open"], previous["stats"])
                raise

    def _apply(self, start: dict | None, skip: int, next_epoch: int, pass_left: int | None, pass_open: bool,
               stats: dict) -> None:
        self._close_graph()
        self._start, self._skip = start, skip
        self._resume = (self._start, self._skip)
        self._cur, self._at = None, 0
        self._next_epoch, self._pass_left, self._pass_open = next_epoch, pass_left, pass_open
        self._stats = msgspec.convert(stats, LoaderStats)

    def _plan_skipped_step(self, step_number: int) -> None:
        step = self._fetch()
        check_skip(self._skip, None if step is None else len(step.batches), step_number)
        self._cur, self._at, self._skip = step, self._skip, 0

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


# The options' keyword arguments and their documentation, generated from LoaderOptions.
PackedLoader.__init__.__signature__ = options_signature(PackedLoader.__init__)
PackedLoader.__doc__ = (PackedLoader.__doc__ or "").rstrip() + "\n" + options_doc() + "\n"
