"""From what a user names (a preset, a profile JSON, a bundled profile name, a CostModel) to the cost model
the planners use, and per-rank models for heterogeneous data-parallel groups (`RankCosts`)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Sequence

import msgspec

from packloader.balancers.cost import presets
from packloader.balancers.cost.cp_comm import cp_comm_for
from packloader.balancers.cost.cp_price import fixed_cp_profile, with_fixed_traffic
from packloader.balancers.cost.cp_shard_attention import with_cp_shard
from packloader.balancers.cost.devices import DEFAULT_DEVICE, load_device
from packloader.balancers.cost.measured import measured_profile
from packloader.balancers.cost.memory import max_tokens_for_memory
from packloader.balancers.cost.model import CostModel
from packloader.balancers.cost.profile_io import PROFILES_DIR, check_profile, load_profile
from packloader.contracts import CostProfile, ParallelConfig

Cost = Literal["measured", "analytic"]


def load_cost_model(
    spec: str | os.PathLike | CostProfile | CostModel,
    parallel: ParallelConfig | None = None,
    *,
    device: str = DEFAULT_DEVICE,
    cost: Cost = "measured",
    memory_cap: bool = False,
    recompute: str = "selective",
) -> CostModel:
    """A CostModel from a preset name, a profile JSON path, or a profile name under packloader/profiles/.

    `device` names a device profile (`devices.load_device`; an unknown name is an error listing the known ones).
    A preset is priced, with ``cost="measured"`` (the default) on a device whose profile names measured kernels
    (the shipped h100), by that measured profile scaled to the preset's shape and `parallel`
    (`measured.measured_profile`); on a device without measurements (the shipped h200), and with
    ``cost="analytic"``, by the analytic model with the device's rates (`presets.analytic_profile`); the
    profile's `source` says which. A JSON profile (`packloader calibrate`'s) is taken as measured: one GPU's
    stage at CP 1 (its TP and layers are those it was measured at; `cost` does not change it); at
    ``parallel.cp > 1`` it is scaled to one CP rank's share on `device` (`cp_shard.scale_profile_to_cp`, as a
    preset's measured profile is), at cp > 1 every model built here also pays its CP group's K/V all-gather
    (`cp_price.fixed_cp_profile`: the price every planner balances), its memory cap, if it has one, times cp. With `memory_cap`, a
    preset's profile carries the memory model's token cap (Hydraulis MaxLen) for `parallel` on `device` (see
    memory.py); by default presets carry no cap and the planner's `max_tokens` is the only cap. A CostProfile or
    CostModel passed in is used as given, whatever `parallel` (`scale_profile_to_cp` scales a CP-1 one).
    """
    if isinstance(spec, CostModel):
        return spec
    if isinstance(spec, CostProfile):
        return CostModel(check_profile(spec))
    if cost not in ("measured", "analytic"):
        raise ValueError(f"unknown cost model {cost!r}; expected 'measured' or 'analytic'")
    dev = load_device(device)
    cp = (parallel or ParallelConfig()).cp
    text = os.fspath(spec)
    path = Path(text)
    comm = cp_comm_for(text, parallel, device=device) if cp > 1 else None  # fixed CP's all-gather (`cp_price`)
    if path.suffix == ".json" or path.exists():
        if not path.exists():
            raise FileNotFoundError(f"cost profile {text!r} does not exist")
        return CostModel(fixed_cp_profile(load_profile(path), cp, dev, comm))
    bundled = PROFILES_DIR / f"{text}.json"
    if bundled.exists():
        return CostModel(fixed_cp_profile(load_profile(bundled), cp, dev, comm))
    shape = presets.get_shape(text)
    tile = dev.rates.tile
    cap = None
    if memory_cap:
        cap = max_tokens_for_memory(shape, parallel or ParallelConfig(), memory_gib=dev.memory_gib, recompute=recompute, tile=tile,
                                    usable_fraction=dev.usable_fraction, reserve_gib=dev.reserve_gib)
        if cap < tile:
            raise ValueError(
                f"{shape.name} does not fit on {dev.rates.name} ({dev.memory_gib:g} GiB) under {parallel or ParallelConfig()}: "
                f"no room for a micro-batch of {tile} tokens; use more tp/pp/dp or recompute='full'"
            )
    if cost == "measured" and dev.measured is not None:
        prof = measured_profile(shape, parallel, memory_cap=cap, device=dev)
        return CostModel(prof if comm is None else with_fixed_traffic(prof, comm, cp))
    prof = with_cp_shard(presets.analytic_profile(shape, parallel, dev.rates, memory_cap=cap), dev, cp)
    if comm is not None:
        prof = with_fixed_traffic(prof, comm, cp)
    if cost == "measured":
        prof = msgspec.structs.replace(
            prof, source=f"analytic: no measured {dev.name.upper()} profile ships; calibrate one with `packloader calibrate` "
                         f"and pass it as the model")
    return CostModel(prof)


@dataclass
class RankCosts:
    """A cost model and a token cap per DP rank (Hydraulis's heterogeneous pipelines): rank r runs its
    micro-batches at models[r]'s speed and may hold at most caps[r] tokens in one micro-batch."""

    models: list[CostModel]
    caps: list[int]

    def __post_init__(self) -> None:
        if len(self.models) != len(self.caps):
            raise ValueError(f"{len(self.models)} cost models but {len(self.caps)} caps")
        if not self.models:
            raise ValueError("RankCosts needs at least one rank")
        if any(c < 1 for c in self.caps):
            raise ValueError(f"token caps must be >= 1, got {self.caps}")

    def __len__(self) -> int:
        return len(self.models)

    def __getitem__(self, r: int) -> CostModel:
        return self.models[r]

    @property
    def dp(self) -> int:
        return len(self.models)

    @property
    def homogeneous(self) -> bool:
        first = self.models[0]
        return all(m is first or m.profile == first.profile for m in self.models) and len(set(self.caps)) == 1

    @classmethod
    def uniform(cls, model: CostModel, dp: int, cap: int) -> "RankCosts":
        return cls([model] * dp, [int(cap)] * dp)

    @classmethod
    def from_specs(
        cls,
        specs: Sequence[str | CostModel],
        parallel: ParallelConfig | None = None,
        caps: Sequence[int] | int | None = None,
        *,
        slowdowns: Sequence[float] | None = None,
    ) -> "RankCosts":
        """One model per rank from preset names / profile paths (or CostModels), optionally slowed down by a
        factor per rank (e.g. a rank on an older GPU). Caps: one per rank, one for all, or each model's own
        memory cap (which must then be known)."""
        models = [load_cost_model(s, parallel) if not isinstance(s, CostModel) else s for s in specs]
        if slowdowns is not None:
            if len(slowdowns) != len(models):
                raise ValueError(f"{len(slowdowns)} slowdowns for {len(models)} ranks")
            models = [m.scaled(f) if f != 1.0 else m for m, f in zip(models, slowdowns)]
        if caps is None:
            got = [m.memory_cap() for m in models]
            if any(c is None for c in got):
                raise ValueError("caps not given and some cost models carry no memory cap")
            cap_list = [int(c) for c in got]  # type: ignore[arg-type]
        elif isinstance(caps, int):
            cap_list = [caps] * len(models)
        else:
            cap_list = [int(c) for c in caps]
        return cls(models, cap_list)

    def speeds(self, tokens: int = 8192) -> list[float]:
        """Relative speed of each rank (1.0 = the fastest) on a micro-batch of one `tokens`-token document."""
        t = [sum(m.microbatch_time_of([tokens])) for m in self.models]
        fastest = min(t)
        return [fastest / x for x in t]
