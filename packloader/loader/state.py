"""What the loader counts and checks about itself: its options (validated), its stats, and the fingerprint that
makes `load_state_dict` refuse a state saved by a differently configured loader."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from packloader.balancers.planners.registry import check_strategy
from packloader.contracts import LoaderStats, PlanConfig, PlannerState, check_plan_config
from packloader.sources.identity import shard_fingerprints

STATE_FORMAT = "packloader.loader/3"
LengthsMode = Literal["auto", "column", "local", "gather"]
Layout = Literal["flat", "hf"]


class LoaderOptions(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """The loader's own knobs (PlanConfig holds the planning ones). Validated with msgspec: a bad value is an
    error naming the field, e.g. ``Expected `int` >= 1 - at `$.pad_to_multiple```."""

    seed: Annotated[int, msgspec.Meta(ge=0)] = 0
    shuffle: bool = True
    append_eos: bool = True
    layout: Layout = "flat"
    pad_to_multiple: Annotated[int, msgspec.Meta(ge=1)] | None = None
    pad_to_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    pad_id: Annotated[int, msgspec.Meta(ge=0)] | None = None
    epochs: Annotated[int, msgspec.Meta(ge=1)] | None = 1  # per `for` pass; None: never stop
    lengths: LengthsMode = "auto"
    num_threads: Annotated[int, msgspec.Meta(ge=0)] = 2  # threads reading/tokenizing and collating
    prefetch: Annotated[int, msgspec.Meta(ge=1)] = 2  # steps planned and collated ahead of the trainer
    chunk_docs: Annotated[int, msgspec.Meta(ge=1)] = 256  # documents read/tokenized per task
    check_ranks: bool = True
    timeout: Annotated[float, msgspec.Meta(gt=0)] = 300.0  # seconds to wait for other ranks
    name: str = "loader"


def validate_config(config) -> PlanConfig:
    """A PlanConfig, validated: each field (msgspec checks constraints when converting, not in the constructor),
    the rules between fields (`check_plan_config`, and the planner's `check_strategy`), and that `model` names a preset or a cost profile (the `fixed`
    strategy never loads it, so a typo would otherwise pass unnoticed)."""
    raw = msgspec.to_builtins(config) if isinstance(config, PlanConfig) else config
    if not isinstance(raw, dict):
        raise TypeError(f"config must be a PlanConfig or a dict, got {type(config).__name__}")
    cfg = msgspec.convert(raw, PlanConfig)
    check_plan_config(cfg)
    check_strategy(cfg)
    check_model(cfg)
    return cfg


def check_model(config: PlanConfig) -> None:
    from packloader.balancers.cost.presets import preset_names
    from packloader.balancers.planners.registry import cost_model_for

    try:
        cost_model_for(config)
    except (KeyError, ValueError, OSError, msgspec.DecodeError) as e:
        why = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        raise ValueError(
            f"PlanConfig.model={config.model!r} is not usable ({why}); expected a model preset "
            f"({', '.join(preset_names())}) or the path of a cost profile JSON (`packloader calibrate` writes one)"
        ) from e


def validate_options(**kwargs) -> LoaderOptions:
    return msgspec.convert(kwargs, LoaderOptions)


def source_fingerprint(source) -> dict[str, str]:
    """Each shard, by its path under the shards' common directory, with its row count and content identity
    (`sources.identity.shard_identity`): the same data in another directory still matches, and a refusal names the
    shard that was replaced, deleted or renamed."""
    return shard_fingerprints(source)


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


class _StepState(msgspec.Struct):
    """The StepNode state a saved loader state resumes from (checked on load, used as the plain dict)."""

    epoch: int
    pos: int
    offset: int  # tokens of the document at `pos` that earlier steps drew (a step ends inside a long document)
    k: int
    flushing: bool
    planner: PlannerState
    queued_lengths: list[tuple[int, int]]
    stats: LoaderStats
    remainder: dict | None = None  # an interrupted step's untrained pieces, to plan first (elastic resume)


class _Position(msgspec.Struct):
    step_state: _StepState | None  # None: the start
    skip: Annotated[int, msgspec.Meta(ge=0)]  # micro-batches of the step from step_state already yielded


class _SavedState(msgspec.Struct):
    format: str
    fingerprint: dict
    next_epoch: int | None
    pass_left: int | None
    pass_open: bool
    stats: LoaderStats | None
    loader: _Position
    ranks: list[_Position] | None = None  # `elastic.merge_states`: every saving rank's position, by DP rank


def check_state(state, current_fingerprint: dict) -> None:
    """Refuse, naming the field, a state that is not a complete `state_dict()` of a loader configured like this one."""
    check_state_shape(state)
    check_fingerprint(state["fingerprint"], current_fingerprint)


def check_state_shape(state) -> None:
    """Refuse, naming the field, a state that is not a complete `state_dict()` (or `merge_states`) of this version."""
    if not isinstance(state, dict):
        raise TypeError(f"a PackedLoader state is the dict state_dict() returned, got {type(state).__name__}")
    if state.get("format") != STATE_FORMAT:
        raise ValueError(f"not a PackedLoader state of this version: its 'format' is {state.get('format')!r}, "
                         f"expected {STATE_FORMAT!r}")
    try:
        msgspec.convert(state, _SavedState)
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
