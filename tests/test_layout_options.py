"""`packloader plan` and `packloader report` take the same layout and model flags, with the PlanConfig's defaults."""

from __future__ import annotations

import argparse

import msgspec
import pytest

from packloader.cli import plan as plan_cli
from packloader.cli import report as report_cli
from packloader.cli.main import main
from packloader.contracts import ParallelConfig, PlanConfig


def parser_of(module) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(exit_on_error=False)
    module.add_arguments(p)
    return p


def flag_defaults(p: argparse.ArgumentParser) -> dict[str, object]:
    return {a.option_strings[0]: a.default for a in p._actions if a.dest.startswith("layout_") and a.option_strings}


def struct_flags() -> dict[str, object]:
    """Flag -> default straight from the Structs' fields (the CLI module's renames written out here)."""
    renames = {"num_micro_batches": "--micro-batches", "allow_slicing": "--no-slicing"}
    out = {}
    for f in msgspec.structs.fields(ParallelConfig):
        out["--" + f.name] = f.default
    for f in msgspec.structs.fields(PlanConfig):
        if f.name in ("strategy", "parallel"):
            continue
        default = f.default_factory() if f.default is msgspec.NODEFAULT else f.default  # planner_options: {}
        out[renames.get(f.name, "--" + f.name.replace("_", "-"))] = default
    return out


def test_both_clis_expose_every_struct_field_with_its_default():
    expected = struct_flags()
    assert {"--dp", "--tp", "--cp", "--pp", "--vpp", "--schedule", "--model", "--memory-gib"} <= set(expected)
    for module in (plan_cli, report_cli):
        assert flag_defaults(parser_of(module)) == expected, module.__name__


def test_parsed_flags_build_the_config():
    args = parser_of(plan_cli).parse_args(["--lengths", "x.npy", "--tp", "2", "--cp", "2", "--dp", "3",
                                           "--max-tokens", "4096", "--memory-gib", "40.5", "--no-slicing",
                                           "--schedule", "gpipe"])
    c = plan_cli.build_config(args)
    assert c.parallel == ParallelConfig(dp=3, pp=1, cp=2, tp=2, vpp=1)
    assert (c.max_tokens, c.context, c.memory_gib, c.allow_slicing, c.schedule) == (4096, 4096, 40.5, False, "gpipe")
    # nothing given: the Struct's own defaults (context follows max_tokens, 8192 both)
    d = plan_cli.build_config(parser_of(plan_cli).parse_args(["--lengths", "x.npy"]))
    assert d == PlanConfig()


def test_report_demo_defaults_apply_only_to_flags_not_given():
    args = parser_of(report_cli).parse_args(["--demo", "--tp", "4"])
    c = report_cli._config(args)
    assert (c.parallel.tp, c.parallel.dp, c.parallel.pp, c.max_tokens) == (4, report_cli.DEMO["dp"], report_cli.DEMO["pp"],
                                                                          report_cli.DEMO["max_tokens"])
    plain = report_cli._config(parser_of(report_cli).parse_args(["--lengths", "x.npy"]))
    assert plain.parallel == ParallelConfig()
    assert plain.tokens_per_step == 1 * 8192 * 4  # the report's derived default: dp x max-tokens x max(4, 2 pp)


@pytest.mark.parametrize("command", ["plan", "report"])
@pytest.mark.parametrize("flag, value, field", [
    ("--dp", "0", "parallel.dp"), ("--tp", "-1", "parallel.tp"), ("--max-tokens", "abc", "max_tokens"),
    ("--memory-gib", "0", "memory_gib"), ("--seed", "-2", "seed"), ("--steps", "0", None),
])
def test_bad_numbers_fail_naming_the_flag_and_field(capsys, command, flag, value, field):
    code = main([command, "--lengths", "x.npy", flag, value])
    err = capsys.readouterr().err
    assert code == 2
    assert f"argument {flag}:" in err, err
    assert field is None or f"field {field}" in err, err  # --steps is the command's own count, not a config field
    assert "Traceback" not in err


def test_bad_choice_is_named(capsys):
    assert main(["plan", "--lengths", "x.npy", "--schedule", "zigzag"]) == 2
    assert "--schedule" in capsys.readouterr().err
