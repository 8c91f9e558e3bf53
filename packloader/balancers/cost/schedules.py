"""Pipeline schedules, each described once: the registry the simulator, the memory model, the action lists, the
runtime, the Megatron adapter, the planners and the CLI's `--schedule` choices read.

The simulator's numba kernels build a rank's action order from an integer `order` code; the codes are the
named constants below (the kernels compare against them, never against bare numbers). A new schedule that
reuses one of these orders (with its own name, memory profile or planner support) is one `register_schedule`
call from any module; a new order also needs its kernel branch in `sim/kernels.py`."""

from __future__ import annotations

from typing import Literal

import msgspec

# the kernels' action-order codes (sim/kernels.build_ops)
ORDER_1F1B = 0
ORDER_GPIPE = 1
ORDER_INTERLEAVED = 2
ORDER_ZB_H1 = 3
ORDER_ZB_V = 4
ORDERS = (ORDER_1F1B, ORDER_GPIPE, ORDER_INTERLEAVED, ORDER_ZB_H1, ORDER_ZB_V)

MemoryProfile = Literal["1f1b", "gpipe", "interleaved"]


class ScheduleSpec(msgspec.Struct, frozen=True):
    """One pipeline schedule. `memory`: how many micro-batches a stage holds at its peak (`cost.memory.
    in_flight_micro_batches`): "1f1b" pp - stage, "gpipe" all m, "interleaved" Megatron's warm-up count at
    vpp > 1. `bubble`: its idle fraction in closed form for m equal micro-batches, where one exists.
    `split_backward`: backwards split into B and W (the runtime and Megatron's adapter run a W action).
    `v_shape`: two chunks per rank placed as a V (stages r and 2*pp-1-r) instead of c*pp + r.
    `multi_chunk`: runs vpp > 1 model chunks per rank; `vpp`: the one vpp it needs, where it needs one.
    `dynamic_cp`: the per-document CP planner can price it (simulates each pool GPU with it)."""

    name: str
    order: int
    memory: MemoryProfile = "1f1b"
    bubble: str = ""
    split_backward: bool = False
    v_shape: bool = False
    multi_chunk: bool = False
    vpp: int | None = None
    dynamic_cp: bool = True


_REGISTRY: dict[str, ScheduleSpec] = {}
# name -> order code, the same dict object for ever (the simulator's modules import it as `SCHEDULES`)
SCHEDULE_ORDERS: dict[str, int] = {}


def register_schedule(spec: ScheduleSpec, *, replace: bool = False) -> ScheduleSpec:
    """Add a schedule (the public hook). Refuses an unknown order code, the name `auto` (a planner's choice,
    not a schedule) and a name already taken unless `replace`."""
    if spec.order not in ORDERS:
        raise ValueError(f"schedule {spec.name!r}: order {spec.order} is not a kernel order; expected one of {ORDERS} "
                         "(ORDER_* in packloader.balancers.cost.schedules)")
    if spec.name == "auto" or not spec.name:
        raise ValueError(f"schedule name {spec.name!r} is reserved or empty")
    if spec.name in _REGISTRY and not replace:
        raise ValueError(f"schedule {spec.name!r} is already registered")
    _REGISTRY[spec.name] = spec
    SCHEDULE_ORDERS[spec.name] = spec.order
    return spec


def schedule_spec(name: str) -> ScheduleSpec:
    """The description of `name`, or a ValueError naming it and the registered ones."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown schedule {name!r}; expected one of {schedule_names()}") from None


def schedule_names() -> list[str]:
    """The registered schedules, in registration order (the built-ins first)."""
    return list(_REGISTRY)


def dynamic_cp_schedule(name: str) -> str:
    """The schedule the per-document CP planner simulates each pool GPU with: the configured one where it can
    price it, 1F1B for `auto` (auto picks per step, after planning); any other is refused, naming it."""
    if name == "auto":
        return "1f1b"
    spec = schedule_spec(name)
    if not spec.dynamic_cp:
        can = [n for n, s in _REGISTRY.items() if s.dynamic_cp]
        raise ValueError(f"the per-document CP planner cannot price schedule {name!r}; it prices {can} (and auto)")
    return name


for _spec in (
    ScheduleSpec("1f1b", ORDER_1F1B, "1f1b", bubble="(pp - 1) / (m + pp - 1)"),
    ScheduleSpec("gpipe", ORDER_GPIPE, "gpipe", bubble="(pp - 1) / (m + pp - 1)"),
    ScheduleSpec("interleaved", ORDER_INTERLEAVED, "interleaved", bubble="(pp - 1) / (vpp * m + pp - 1)", multi_chunk=True),
    ScheduleSpec("zb-h1", ORDER_ZB_H1, "1f1b", split_backward=True, multi_chunk=True),
    ScheduleSpec("zb-v", ORDER_ZB_V, "1f1b", split_backward=True, v_shape=True, multi_chunk=True, vpp=2, dynamic_cp=False),
):
    register_schedule(_spec)
