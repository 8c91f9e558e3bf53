"""Planners by name: pure array functions behind one protocol, so the loader, the CLI and the benchmarks pick
any of them the same way."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable, Protocol

import numpy as np

from packloader.contracts import PlanConfig, PlannerState, StepPlan


@dataclass(frozen=True)
class Window:
    """The pieces drawn for one step: piece i is tokens offset[i]..offset[i]+length[i]-1 of document doc[i].

    A piece is a whole document, or an independent context-window piece of a longer one (never longer than
    PlanConfig.context). All three arrays are int64 and the same length; order is draw order.
    """

    doc: np.ndarray
    offset: np.ndarray
    length: np.ndarray

    def __post_init__(self) -> None:
        n = len(self.doc)
        if len(self.offset) != n or len(self.length) != n:
            raise ValueError(f"Window arrays differ in length: doc {n}, offset {len(self.offset)}, length {len(self.length)}")

    @classmethod
    def from_lengths(cls, lengths: np.ndarray, first_doc: int = 0) -> "Window":
        lengths = np.asarray(lengths, dtype=np.int64)
        return cls(np.arange(first_doc, first_doc + len(lengths), dtype=np.int64), np.zeros(len(lengths), np.int64), lengths)

    @property
    def total_tokens(self) -> int:
        return int(self.length.sum())


class Planner(Protocol):
    """Turns the pieces drawn for a step, plus what earlier steps held back, into that step's plan.

    Contract: every token of every piece in `window` and in `state.queued` appears exactly once, either in the
    returned StepPlan's segments or in the returned state's queue; every DP rank gets the same number of
    micro-batches; no micro-batch holds more than config.max_tokens tokens; slices (attend_from < start) only
    when config.allow_slicing, in order, on one rank, within one step. Deterministic for equal inputs.
    """

    config: PlanConfig

    def plan(self, window: Window, state: PlannerState, step: int) -> tuple[StepPlan, PlannerState]: ...


PlannerFactory = Callable[[PlanConfig], Planner]


@dataclass(frozen=True)
class PlannerSpec:
    factory: PlannerFactory
    slices: bool  # plans a piece longer than max_tokens as slices across micro-batches (with allow_slicing)


_REGISTRY: dict[str, PlannerSpec] = {}
# The modules of the planners that ship. Each registers its own names when imported, so the registry is the one
# list of names; they are imported on the first lookup of a name not yet registered.
_BUILTIN_MODULES = ("fixed", "wlb", "hydraulis", "slimpack", "auto", "concat", "multipack", "verl")
_builtins_loaded = False


def register_planner(name: str, *, slices: bool = False) -> Callable[[PlannerFactory], PlannerFactory]:
    """Make `name` a valid `PlanConfig.strategy` whose planners `factory` builds."""

    def deco(factory: PlannerFactory) -> PlannerFactory:
        _REGISTRY[name] = PlannerSpec(factory, slices)
        return factory

    return deco


def _load_builtins() -> None:
    global _builtins_loaded
    if not _builtins_loaded:
        for module in _BUILTIN_MODULES:
            importlib.import_module(f"packloader.balancers.planners.{module}")
        _builtins_loaded = True


def planner_spec(name: str) -> PlannerSpec:
    if name not in _REGISTRY:
        _load_builtins()
    if name not in _REGISTRY:
        raise ValueError(f"unknown planner strategy {name!r}; expected one of {available_strategies()}")
    return _REGISTRY[name]


def slicing_strategies() -> list[str]:
    _load_builtins()
    return sorted(name for name, spec in _REGISTRY.items() if spec.slices)


def check_strategy(config: PlanConfig) -> None:
    """The rules between PlanConfig fields that depend on the planner: a registered strategy, and one that slices
    when context exceeds max_tokens."""
    spec = planner_spec(config.strategy)
    if config.context > config.max_tokens and not (config.allow_slicing and spec.slices):
        how = ("allow_slicing=False" if not config.allow_slicing
               else f"strategy={config.strategy!r}, which does not slice")
        raise ValueError(
            f"PlanConfig.context={config.context} exceeds max_tokens={config.max_tokens} with {how}: a piece of "
            f"{config.context} tokens fits no micro-batch; expected context <= max_tokens, or allow_slicing=True "
            f"with strategy in {slicing_strategies()}"
        )


def make_planner(config: PlanConfig) -> Planner:
    return planner_spec(config.strategy).factory(config)


def available_strategies() -> list[str]:
    _load_builtins()
    return sorted(_REGISTRY)
