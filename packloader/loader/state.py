"""What the loader declares and checks about itself: its options and its saved state, each declared once as a
Struct (keyword arguments, docs and `state_dict()` are generated from them), and the fingerprint that makes
`load_state_dict` refuse a state saved by a differently configured loader."""

from __future__ import annotations

import inspect
from typing import Annotated, Literal

import msgspec
import msgspec.inspect as mi

from packloader.balancers.planners.config_rules import validate_config as validate_config  # the one validation
from packloader.contracts import LoaderStats, PlanConfig, PlannerState
from packloader.sources.identity import shard_fingerprints

STATE_FORMAT = "packloader.loader/3"
LengthsMode = Literal["auto", "column", "local", "gather"]
Layout = Literal["flat", "hf"]


def _doc(text: str) -> msgspec.Meta:
    return msgspec.Meta(description=text)


class LoaderOptions(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """The loader's own knobs (PlanConfig holds the planning ones), declared once: `PackedLoader`'s and
    `PackedDataset`'s keyword arguments, their documentation (`options_doc`) and their validation come from here.
    A bad value is an error naming the field, e.g. ``Expected `int` >= 1 - at `$.pad_to_multiple```."""

    seed: Annotated[Annotated[int, msgspec.Meta(ge=0)] | None, _doc(
        "seed of the epoch order (None: config.seed)")] = None
    shuffle: Annotated[bool, _doc("shuffle the documents' order every epoch")] = True
    append_eos: Annotated[bool, _doc("end every document with the tokenizer's EOS token")] = True
    layout: Annotated[Layout, _doc('"flat" (`[T]` tensors) or "hf" (`[1, T]`)')] = "flat"
    pad_to_multiple: Annotated[Annotated[int, msgspec.Meta(ge=1)] | None, _doc(
        "the padded variant: pad each micro-batch to a multiple of this many tokens")] = None
    pad_to_tokens: Annotated[Annotated[int, msgspec.Meta(ge=1)] | None, _doc(
        "the padded variant: pad each micro-batch to this many tokens (at least config.max_tokens)")] = None
    pad_id: Annotated[Annotated[int, msgspec.Meta(ge=0)] | None, _doc(
        "the padding token (None: EOS, else 0)")] = None
    epochs: Annotated[Annotated[int, msgspec.Meta(ge=1)] | None, _doc(
        "epochs per `for` pass (None: never stop)")] = 1
    lengths: Annotated[LengthsMode, _doc(
        '"auto" (a length column when the source has one, else "local"), "column", "local" (every rank tokenizes '
        'the whole stream) or "gather" (ranks split the tokenizing and all-gather lengths)')] = "auto"
    num_threads: Annotated[int, msgspec.Meta(ge=0), _doc(
        "threads that read/tokenize and that collate (0: everything in the calling thread, no prefetching)")] = 2
    prefetch: Annotated[int, msgspec.Meta(ge=1), _doc("steps planned and collated ahead of the trainer")] = 2
    chunk_docs: Annotated[int, msgspec.Meta(ge=1), _doc("documents read/tokenized per task")] = 256
    check_ranks: Annotated[bool, _doc(
        "with torch.distributed: compare settings and every step's plan across ranks")] = True
    timeout: Annotated[float, msgspec.Meta(gt=0), _doc("seconds to wait for other ranks")] = 300.0
    name: Annotated[str, _doc("the name the ranks' exchange uses in the process group's store")] = "loader"
    cp_rank: Annotated[Annotated[int, msgspec.Meta(ge=0)] | None, _doc(
        "this GPU's CP rank: under per-document CP (cp_mode 'dynamic') it trains pool GPU dp_rank * cp + cp_rank's "
        "part")] = None


def validate_options(config: PlanConfig, **kwargs) -> LoaderOptions:
    """The options from keyword arguments (unknown or bad ones refused naming the field), the seed resolved."""
    options = msgspec.convert(kwargs, LoaderOptions)
    return msgspec.structs.replace(options, seed=config.seed) if options.seed is None else options


def options_doc() -> str:
    """The options' documentation, one line each, from the Struct (for the loaders' docstrings)."""
    lines = []
    for f in mi.type_info(LoaderOptions).fields:
        info = (f.type.extra_json_schema or {}) if isinstance(f.type, mi.Metadata) else {}
        lines.append(f"    `{f.name}` (default {f.default!r}): {info.get('description', '')}")
    return "\n".join(lines)


def options_signature(func, options_at: str = "options") -> inspect.Signature:
    """`func`'s signature with its `**options` replaced by LoaderOptions' fields as keyword arguments, so that
    help() and editors show them."""
    sig = inspect.signature(func)
    params = [p for p in sig.parameters.values() if p.name != options_at]
    taken = {p.name for p in params}
    params += [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default)
               for f in mi.type_info(LoaderOptions).fields if f.name not in taken]
    return sig.replace(parameters=params)


def source_fingerprint(source) -> dict[str, str]:
    """Each shard, by its path under the shards' common directory, with its row count and content identity
    (`sources.identity.shard_identity`): the same data in another directory still matches, and a refusal names the
    shard that was replaced, deleted or renamed."""
    out = shard_fingerprints(source)
    describe = getattr(source, "describe", None)  # a mixture: its entries' names, weights and epoch size
    if describe is not None:
        out["mixture"] = msgspec.json.encode(describe()).decode()
    return out


def fingerprint(*, config: PlanConfig, options: LoaderOptions, source, tokenizer_name: str | None, dp_rank: int,
                eos_appended: bool, span: tuple[int, int] | None = None) -> dict:
    """What must match between the loader that saved a state and the one that loads it."""
    return {
        "config": msgspec.to_builtins(config),
        "seed": options.seed,
        "shuffle": options.shuffle,
        "eos_appended": eos_appended,
        "tokenizer": tokenizer_name,
        "source": source_fingerprint(source),
        "num_docs": sum(s.num_rows for s in source.shards),
        "dp_rank": dp_rank,
        "span": list(span) if span is not None else None,
    }


class StepState(msgspec.Struct, kw_only=True):
    """Where the planning stage stands: StepNode's state, and the step part of a saved state. Declared once here:
    StepNode builds it (`get_state`, as `msgspec.to_builtins`) and resumes from it (`msgspec.convert`)."""

    epoch: int
    pos: int  # the first document of the epoch's order not yet drawn (in full)
    offset: int  # tokens of the document at `pos` that earlier steps drew (a step ends inside a long document)
    k: int  # the next step's number
    flushing: bool  # the epoch's documents are all drawn: the planner is flushing its queue
    remainder: dict | None = None  # an interrupted step's untrained pieces, to plan first (elastic resume)
    planner: PlannerState
    queued_lengths: list[Annotated[list[int], msgspec.Meta(min_length=2, max_length=2)]]  # [doc, length] pairs
    stats: LoaderStats
    # [doc, step] pairs: the step a document drawn over several steps was first drawn in, while its pieces are still
    # to be trained (the one at `pos`, begun; queued ones), so its pieces' delay counts from there (StepMetrics, as
    # `packloader plan`); empty in a state saved before it was kept (those pieces then count from their own draw)
    first_drawn: list[Annotated[list[int], msgspec.Meta(min_length=2, max_length=2)]] = []


class Position(msgspec.Struct, kw_only=True):
    step_state: StepState | None  # None: the start
    skip: Annotated[int, msgspec.Meta(ge=0)]  # micro-batches of the step from step_state already yielded


class SavedState(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A loader's `state_dict()` (or `PackedDataset` worker's), declared once: built by `saved_state`, checked on
    load by `check_state_shape` (`msgspec.convert`)."""

    format: str
    fingerprint: dict
    next_epoch: int | None
    pass_left: int | None
    pass_open: bool
    stats: LoaderStats | None
    loader: Position
    ranks: list[Position] | None = None  # `elastic.merge_states`: every saving rank's position, by DP rank
    worker: int | None = None  # a `PackedDataset` worker's state: which worker of how many saved it
    workers: int | None = None
    mixture: dict | None = None  # a mixture's blend and changes (`loader.mixture_resume`)


def step_state(**fields) -> dict:
    """A StepNode state as the plain dict the loaders save (validated on the way, so a field never goes missing)."""
    return msgspec.to_builtins(StepState(**fields))


def saved_state(*, fingerprint: dict, step_state: dict | None, skip: int, next_epoch: int | None = None,
                pass_left: int | None = None, pass_open: bool = False, stats: LoaderStats | None = None,
                worker: int | None = None, workers: int | None = None, mixture: dict | None = None) -> dict:
    """A `state_dict()`: plain Python data (torch.save/pickle), `msgspec.to_builtins` of a SavedState."""
    position = Position(step_state=None if step_state is None else msgspec.convert(step_state, StepState), skip=skip)
    return msgspec.to_builtins(SavedState(format=STATE_FORMAT, fingerprint=fingerprint, next_epoch=next_epoch,
                                          pass_left=pass_left, pass_open=pass_open, stats=stats, loader=position,
                                          worker=worker, workers=workers, mixture=mixture))


# PlanConfig fields added after states were first saved, with the value every state without them was saved under
ADDED_CONFIG_FIELDS = {"cp_mode": "fixed"}  # per-document CP (issue 26): before it, every plan was fixed CP


def upgraded(state):
    """A state saved before a PlanConfig field existed, with that field as it was then (a copy: the caller's dict
    is left as it is); anything else as given, for `check_state_shape` to judge."""
    fp = state.get("fingerprint") if isinstance(state, dict) else None
    config = fp.get("config") if isinstance(fp, dict) else None
    if not isinstance(config, dict) or all(k in config for k in ADDED_CONFIG_FIELDS):
        return state
    return dict(state, fingerprint=dict(fp, config={**ADDED_CONFIG_FIELDS, **config}))


def check_state(state, current_fingerprint: dict) -> None:
    """Refuse, naming the field, a state that is not a complete `state_dict()` of a loader configured like this one."""
    check_state_shape(state)
    check_fingerprint(state["fingerprint"], current_fingerprint)


def check_state_shape(state) -> SavedState:
    """Refuse, naming the field, a state that is not a complete `state_dict()` (or `merge_states`) of this version."""
    if not isinstance(state, dict):
        raise TypeError(f"a PackedLoader state is the dict state_dict() returned, got {type(state).__name__}")
    if state.get("format") != STATE_FORMAT:
        raise ValueError(f"not a PackedLoader state of this version: its 'format' is {state.get('format')!r}, "
                         f"expected {STATE_FORMAT!r}")
    try:
        return msgspec.convert(state, SavedState)
    except msgspec.ValidationError as e:
        raise ValueError(f"this PackedLoader state is incomplete or damaged: {e}") from e


def flatten(d: dict, prefix: str = "") -> dict:
    """Nested dicts as one dict with dotted keys (`config.parallel.dp`), to name the field that differs."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def check_fingerprint(saved: dict, current: dict) -> None:
    saved, current = flatten(saved), flatten(current)
    diff = [k for k in sorted(set(saved) | set(current)) if saved.get(k) != current.get(k)]
    if diff:
        parts = "; ".join(f"{k}: saved {saved.get(k)!r}, now {current.get(k)!r}" for k in diff)
        raise ValueError(
            f"this state was saved by a differently configured loader ({parts}); resuming it would not continue the "
            "same stream (tokens would be lost and repeated), so it is refused"
        )
