"""Planners by name: pure array functions behind one protocol, so the loader, the CLI and the benchmarks pick
any of them the same way."""

from __future__ import annotations

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
_REGISTRY: dict[str, PlannerFactory] = {}
# Modules that register planners when imported; looked up lazily so importing one planner stays cheap.
_MODULES = {
    "fixed": "packloader.balancers.fixed",
    "wlb": "packloader.balancers.wlb",
    "hydraulis": "packloader.balancers.hydraulis",
    "slimpack": "packloader.balancers.slimpack",
    "auto": "packloader.balancers.auto",
    "concat": "packloader.balancers.baselines",
    "multipack": "packloader.balancers.baselines",
    "karmarkar_karp": "packloader.balancers.baselines",
    "multipack_openchat2023": "packloader.balancers.baselines",
    "karmarkar_karp_verl_legacy": "packloader.balancers.baselines",
}


def register_planner(name: str) -> Callable[[PlannerFactory], PlannerFactory]:
    def deco(factory: PlannerFactory) -> PlannerFactory:
        _REGISTRY[name] = factory
        return factory

    return deco


def make_planner(config: PlanConfig) -> Planner:
    name = config.strategy
    if name not in _REGISTRY and name in _MODULES:
        import importlib

        importlib.import_module(_MODULES[name])
    if name not in _REGISTRY:
        raise ValueError(f"unknown planner strategy {name!r}; expected one of {sorted(_MODULES)}")
    return _REGISTRY[name](config)


def available_strategies() -> list[str]:
    return sorted(_MODULES)
