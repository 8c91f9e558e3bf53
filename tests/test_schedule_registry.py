"""Schedules described once: a schedule registered from one file outside the package is simulated,
memory-modelled and offered by the CLI's --schedule; the simulator's step time checked against hand-worked
numbers; a schedule the per-document CP planner cannot price is refused, naming it."""

from __future__ import annotations

import argparse
import importlib.util
import math

import numpy as np
import pytest

from packloader.balancers.cost import schedules as reg
from packloader.balancers.cost.memory import in_flight_micro_batches
from packloader.balancers.sim.simulator import step_time
from packloader.cli.layout_options import add_layout_arguments
from packloader.contracts import ParallelConfig

PLUGIN = '''
from packloader.balancers.cost.schedules import ORDER_GPIPE, ScheduleSpec, register_schedule
register_schedule(ScheduleSpec("all-forward-first", ORDER_GPIPE, "gpipe", bubble="(pp - 1) / (m + pp - 1)",
                               dynamic_cp=False), replace=True)
'''


@pytest.fixture
def plugin(tmp_path):
    path = tmp_path / "my_schedule.py"
    path.write_text(PLUGIN)
    spec = importlib.util.spec_from_file_location("my_schedule", path)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
    yield "all-forward-first"
    reg._REGISTRY.pop("all-forward-first", None)
    reg.SCHEDULE_ORDERS.pop("all-forward-first", None)


def test_hand_worked_step_times_pp2_m3_unit_costs():
    # pp 2, m 3, forward 1 and backward 1 per stage: GPipe runs F0 F1 F2 on stage 0 (t 0..3), stage 1 ends its
    # last forward at 4, backwards B2 B1 B0 on stage 1 (4..7) and stage 0 (5..8): 8 = (m + pp - 1) * (f + b).
    # 1F1B: stage 0 F0 F1 | stage 1 F0(1-2) B0(2-3) F1(3-4) B1(4-5) F2(5-6) B2(6-7); stage 0 B0(3-4) F2(4-5)
    # B1(5-6) B2(7-8): 8 as well.
    f = np.ones(3)
    b = np.ones(3)
    assert step_time(f, b, 2, schedule="gpipe") == pytest.approx(8.0)
    assert step_time(f, b, 2, schedule="1f1b") == pytest.approx(8.0)


def test_registered_schedule_is_simulated_memory_modelled_and_offered(plugin):
    f = np.ones(3)
    b = np.ones(3)
    assert step_time(f, b, 2, schedule=plugin) == pytest.approx(8.0)  # the hand-worked GPipe figure
    par = ParallelConfig(pp=2)
    # GPipe's memory profile: every micro-batch in flight (3), where 1F1B holds pp - stage (2)
    assert in_flight_micro_batches(par, 0, plugin, 3) == 3.0
    assert in_flight_micro_batches(par, 0, "1f1b", 3) == 2.0
    assert in_flight_micro_batches(par, 0, plugin) == 2.0 and not math.isinf(in_flight_micro_batches(par, 0, plugin))
    p = argparse.ArgumentParser()
    add_layout_arguments(p)
    assert plugin in vars(p.parse_args(["--schedule", plugin])).values()
    with pytest.raises(SystemExit):
        p.parse_args(["--schedule", "no-such-schedule"])


def test_unknown_and_unpriceable_schedules_are_refused_by_name(plugin):
    with pytest.raises(ValueError, match="no-such"):
        reg.schedule_spec("no-such")
    with pytest.raises(ValueError, match="'zb-v'.*1f1b"):
        reg.dynamic_cp_schedule("zb-v")
    with pytest.raises(ValueError, match=plugin):
        reg.dynamic_cp_schedule(plugin)
    assert reg.dynamic_cp_schedule("auto") == "1f1b"
    assert reg.dynamic_cp_schedule("gpipe") == "gpipe"
    with pytest.raises(ValueError, match="not a kernel order"):
        reg.register_schedule(reg.ScheduleSpec("bad", 99))


def test_builtins_keep_their_kernel_codes():
    assert reg.SCHEDULE_ORDERS == {**reg.SCHEDULE_ORDERS, "1f1b": 0, "gpipe": 1, "interleaved": 2, "zb-h1": 3, "zb-v": 4}
