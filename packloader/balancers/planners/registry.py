"""Planners by name: each registry entry describes its planner (options, slicing, role, report summary, how `auto`
may use it), so the loader, `auto`, the report and the CLI learn about a planner from its entry alone and a
planner added from outside the package (`register_planner` in any module) is a strategy like the shipped ones.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Protocol

import msgspec
import numpy as np

from packloader.balancers.cost.lookup import cost_model_for  # noqa: F401 (the planners' and plugins' import path)
from packloader.balancers.cost.model import CostModel
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


@dataclass(frozen=True)
class StepLayout:
    """What one step's plan must fit besides its pieces: per call, never carried in PlannerState."""

    step: int
    flush: bool = False  # plan every piece now (end of epoch): nothing held back by choice
    micro_batches: int | None = None  # per DP rank; None: the planner's own choice (or config.num_micro_batches)

    @classmethod
    def of(cls, step: "int | StepLayout") -> "StepLayout":
        return step if isinstance(step, StepLayout) else cls(int(step))


class Planner(Protocol):
    """Turns the pieces drawn for a step, plus what earlier steps held back, into that step's plan.

    Contract: every token of every piece in `window` and in `state.queued` appears exactly once, either in the
    returned StepPlan's segments or in the returned state's queue (nothing queued when `layout.flush`); every DP
    rank gets the same number of micro-batches; no micro-batch holds more than config.max_tokens tokens; slices
    (attend_from < start) only when config.allow_slicing, in order, on one rank, within one step. Deterministic
    for equal inputs. `layout` may be a plain step number (no flush, the planner's own count).
    """

    config: PlanConfig

    def plan(self, window: Window, state: PlannerState, layout: StepLayout | int) -> tuple[StepPlan, PlannerState]: ...


class NoOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A planner without options of its own."""


@dataclass(frozen=True)
class AutoUse:
    """How `auto` may plan a step with this planner as one of its candidates (`planners/auto.py`)."""

    order: int  # position among the candidates; ties in score go to the earlier one
    # its default micro-batches per DP rank for (planner, pieces, config with auto's token cap); None: one
    # candidate at the planner's own choice
    default_count: Callable[[Any, Any, PlanConfig], int] | None = None
    ladder: tuple[int, ...] = (2,)  # multiples of the default count also tried on small problems
    pipeline_ladder: tuple[int, ...] | None = None  # the ladder in a pipeline, PP > 1 (None: `ladder`)
    defer: Literal["default", "counts"] | None = None  # in a pipeline with slicing: planned only when no slicing count fits
    max_work: int | None = None  # dropped above pieces x DP ranks
    max_pp: int | None = None  # dropped in a pipeline deeper than this (None: at any depth)
    whole_pieces: bool = False  # plans every piece, whole: skipped once PP x the largest piece's time cannot win
    flush_fallback: bool = False  # plans everything when every candidate that could plan breaks the delay bound
    options: dict = field(default_factory=dict)  # options auto sets on small problems
    options_at_scale: dict | None = None  # and above SMALL_WORK (None: `options`)
    bounded_runs_option: str | None = None  # memory fallback: the option that bounds runs of linked packs


PlannerFactory = Callable[[PlanConfig, Any, "CostModel | None"], Planner]


@dataclass(frozen=True)
class PlannerSpec:
    """A registry entry: everything the package needs to know about a planner."""

    name: str
    factory: PlannerFactory  # (config, options Struct, cost model or None) -> Planner
    slices: bool = False  # plans a piece longer than max_tokens as slices across micro-batches (with allow_slicing)
    options: type = NoOptions  # msgspec Struct of its options: PlanConfig.planner_options[name]
    role: Literal["packloader", "baseline"] = "packloader"  # a packloader planner, or another tool's packer
    summary: str = ""  # one line for the report
    report_order: int | None = 50  # its place in the report's default strategies (baselines first); None: not shown
    auto: AutoUse | None = None  # None: `auto` never plans with it
    uses_model: bool = True  # takes a cost model (False: plans by token counts only)
    # takes a RankCosts (a cost model and token cap per DP rank) as its injected model: the report's grouping
    # advice (DP ranks merged into context-parallel groups) plans with it
    rank_costs: bool = False
    # plans per-document context parallelism on the DP x CP pool (StepPlan.cp_mode "dynamic"): the report's
    # per-document CP row plans with it
    cp_pool: bool = False

    def parse_options(self, raw: dict | None) -> Any:
        """The entry's options Struct from a plain dict, unknown or ill-typed keys a ValueError naming them."""
        try:
            return msgspec.convert(raw or {}, self.options)
        except msgspec.ValidationError as e:
            known = sorted(self.options.__struct_fields__)
            raise ValueError(f"PlanConfig.planner_options[{self.name!r}]: {e}; expected fields of "
                             f"{self.options.__name__}: {known}") from None

    def build(self, config: PlanConfig, model: CostModel | None = None, **overrides: Any) -> Planner:
        """The planner for `config`, with its options from config.planner_options (then `overrides`) and the cost
        model injected (`cost_model_for(config)` when none is given)."""
        raw = {**config.planner_options.get(self.name, {}), **overrides}
        if model is None and self.uses_model:
            model = cost_model_for(config)
        return self.factory(config, self.parse_options(raw), model if self.uses_model else None)


_REGISTRY: dict[str, PlannerSpec] = {}
# The modules of the planners that ship. Each registers its own names when imported, so the registry is the one
# list of names; they are imported on the first lookup of a name not yet registered.
_BUILTIN_MODULES = ("fixed", "wlb", "hydraulis", "slimpack", "auto", "concat", "multipack", "verl", "doc_cp.planner")
_builtins_loaded = False


def register_planner(name: str, **entry: Any) -> Callable[[PlannerFactory], PlannerFactory]:
    """Make `name` a valid `PlanConfig.strategy` whose planners `factory(config, options, model)` builds; `entry`
    holds the other PlannerSpec fields (slices, options, role, summary, report_order, auto, uses_model,
    rank_costs, cp_pool)."""

    def deco(factory: PlannerFactory) -> PlannerFactory:
        _REGISTRY[name] = PlannerSpec(name, factory, **entry)
        return factory

    return deco


def load_plugins(modules: list[str] | tuple[str, ...]) -> None:
    """Import each module (dotted name), so the planners it registers are strategies (the CLI's `--plugin`)."""
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise ValueError(f"--plugin {module}: cannot import it ({e}); expected an importable module name "
                             f"(on PYTHONPATH) that calls register_planner") from None
        except Exception as e:  # noqa: BLE001 - the plugin's own code failed (SyntaxError included): name it
            raise ValueError(f"--plugin {module}: importing it raised {type(e).__name__}: {e}; the module "
                             "(or one it imports) fails before it can register a planner: fix it or leave "
                             "--plugin out") from e


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


def planner_specs() -> list[PlannerSpec]:
    """Every registered planner, by name."""
    _load_builtins()
    return [_REGISTRY[n] for n in sorted(_REGISTRY)]


def slicing_strategies() -> list[str]:
    return [s.name for s in planner_specs() if s.slices]


def report_strategies() -> tuple[str, ...]:
    """The report's default strategies: baselines, then packloader's planners, each by its report_order."""
    shown = [s for s in planner_specs() if s.report_order is not None]
    return tuple(s.name for s in sorted(shown, key=lambda s: (s.role != "baseline", s.report_order, s.name)))


def rank_costs_planner() -> PlannerSpec | None:
    """The planner that plans heterogeneous DP ranks (`rank_costs`) for the report's grouping advice: the first
    such in the report's order, None when none is registered."""
    able = [s for s in planner_specs() if s.rank_costs]
    return min(able, key=lambda s: (s.report_order is None, s.report_order or 0, s.name), default=None)


def check_strategy(config: PlanConfig) -> None:
    """The rules between PlanConfig fields that depend on the planner: a registered strategy, one that slices
    when context exceeds max_tokens, and planner_options that name planners and fit their options Structs."""
    spec = planner_spec(config.strategy)
    if config.context > config.max_tokens and not (config.allow_slicing and spec.slices):
        how = ("allow_slicing=False" if not config.allow_slicing
               else f"strategy={config.strategy!r}, which does not slice")
        raise ValueError(
            f"PlanConfig.context={config.context} exceeds max_tokens={config.max_tokens} with {how}: a piece of "
            f"{config.context} tokens fits no micro-batch; expected context <= max_tokens, or allow_slicing=True "
            f"with strategy in {slicing_strategies()}"
        )
    check_planner_options(config)


def check_planner_options(config: PlanConfig) -> None:
    """config.planner_options names registered planners, and each one's options fit its options Struct."""
    for name, raw in config.planner_options.items():
        if name not in _REGISTRY:
            _load_builtins()
        if name not in _REGISTRY:
            raise ValueError(f"PlanConfig.planner_options names {name!r}, which is no planner; expected names from "
                             f"{available_strategies()}")
        _REGISTRY[name].parse_options(raw)


def available_strategies() -> list[str]:
    return [s.name for s in planner_specs()]
