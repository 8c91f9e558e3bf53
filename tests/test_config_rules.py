"""One PlanConfig validation for every entry point: on a table of configs, each written with the outcome expected
by hand (not derived from the code), the library (`validate_config`, `plan_run`, `PackedLoader`, `build_report`)
and the CLIs (`packloader plan`, `packloader report`) accept or refuse alike, and a CLI's refusal names the flags
of the fields at fault and carries the library's own message."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from packloader import PackedLoader, validate_config
from packloader.balancers.offline import plan_run
from packloader.cli.main import main
from packloader.contracts import ConfigError, PlanConfig
from packloader.report.build import ReportOptions, build_report
from packloader.sources.base import IterableSource
from packloader.sources.lengths_file import Lengths
from tests.helpers.docs import token_docs

# name, PlanConfig fields, CLI flags, plan's outcome, report's outcome, flags a refusal names.
# Outcomes: "ok", "refused" (a configuration error), "unplannable" (the report runs, but no strategy it was asked
# for can plan: its strategy is a placeholder, each strategy is judged on its own).
# The report runs `fixed` and `slimpack`; plan and the loader run the config's strategy.
CASES = [
    ("fine", dict(strategy="fixed", max_tokens=1024, context=1024, tokens_per_step=4096),
     ["--strategy", "fixed", "--max-tokens", "1024", "--tokens-per-step", "4096"], "ok", "ok", []),
    ("step_below_micro_batch", dict(strategy="fixed", max_tokens=1024, context=1024, tokens_per_step=512),
     ["--strategy", "fixed", "--max-tokens", "1024", "--tokens-per-step", "512"], "refused", "refused",
     ["--tokens-per-step", "--max-tokens"]),
    ("long_context_no_slicing", dict(strategy="slimpack", max_tokens=1024, context=2048, tokens_per_step=4096,
                                     allow_slicing=False),
     ["--strategy", "slimpack", "--max-tokens", "1024", "--context", "2048", "--tokens-per-step", "4096",
      "--no-slicing"], "refused", "unplannable", ["--context", "--max-tokens", "--no-slicing"]),
    ("long_context_non_slicing_strategy", dict(strategy="fixed", max_tokens=1024, context=2048, tokens_per_step=4096),
     ["--strategy", "fixed", "--max-tokens", "1024", "--context", "2048", "--tokens-per-step", "4096"],
     "refused", "ok", ["--context", "--strategy"]),
    ("long_context_slicing", dict(strategy="slimpack", max_tokens=1024, context=2048, tokens_per_step=4096),
     ["--strategy", "slimpack", "--max-tokens", "1024", "--context", "2048", "--tokens-per-step", "4096"],
     "ok", "ok", []),
    ("unknown_strategy", dict(strategy="nope", max_tokens=1024, context=1024, tokens_per_step=4096),
     ["--strategy", "nope", "--max-tokens", "1024", "--tokens-per-step", "4096"], "refused", None, ["--strategy"]),
    ("unknown_model", dict(strategy="fixed", max_tokens=1024, context=1024, tokens_per_step=4096, model="gpt-17"),
     ["--strategy", "fixed", "--max-tokens", "1024", "--tokens-per-step", "4096", "--model", "gpt-17"],
     "refused", "refused", ["--model"]),
    ("zero_dp", dict(strategy="fixed", max_tokens=1024, context=1024, tokens_per_step=4096, parallel={"dp": 0}),
     ["--strategy", "fixed", "--max-tokens", "1024", "--tokens-per-step", "4096", "--dp", "0"],
     "refused", "refused", ["--dp"]),
]
IDS = [c[0] for c in CASES]


def _lengths(tmp_path) -> str:
    path = tmp_path / "l.npy"
    np.save(path, np.random.default_rng(0).integers(1, 2048, 200))
    return str(path)


def _library_outcome(fn) -> str:
    try:
        fn()
    except (ConfigError, msgspec.ValidationError):
        return "refused"
    return "ok"


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_the_library_refuses_what_the_table_says(case, tmp_path):
    _, fields, _, plan_expect, report_expect, _ = case
    lengths = np.random.default_rng(0).integers(1, 2048, 200)
    assert _library_outcome(lambda: validate_config(fields)) == plan_expect
    assert _library_outcome(lambda: plan_run(lengths, fields, 1)) == plan_expect
    loader_cfg = dict(fields)
    if "parallel" not in loader_cfg:
        loader_cfg["parallel"] = {"dp": 1}
    assert _library_outcome(lambda: PackedLoader(IterableSource(token_docs(20)), config=loader_cfg, num_threads=0)
                            .close()) == plan_expect
    if report_expect is None:
        return
    opts = ReportOptions(steps=1, strategies=("fixed", "slimpack"), plots=False, advice=False, progress=False)

    def report():  # a PlanConfig as a caller builds one from a dict (msgspec refuses a bad field there)
        cfg = msgspec.convert(fields, PlanConfig)
        report, _ = build_report(Lengths(lengths, origin="test"), cfg, opts)
        return report

    outcome = _library_outcome(report)
    if outcome == "ok":
        outcome = "ok" if any(f.status == "ok" for f in report().strategies) else "unplannable"
    assert outcome == report_expect


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_plan_cli_refuses_exactly_what_the_library_refuses(case, tmp_path, capsys):
    name, fields, flags, plan_expect, _, named = case
    code = main(["plan", "--lengths", _lengths(tmp_path), *flags, "--quiet", "--out", str(tmp_path / "p.jsonl")])
    err = capsys.readouterr().err
    assert code == (0 if plan_expect == "ok" else 2), err
    if plan_expect == "refused":
        assert all(f in err for f in named), err
        if name != "zero_dp":  # argparse refuses --dp 0 itself, from the field's constraint, before any config
            assert "invalid configuration" in err, err
            with pytest.raises(ConfigError) as lib:
                validate_config(fields)
            assert str(lib.value) in err


@pytest.mark.parametrize("case", [c for c in CASES if c[4] is not None], ids=[c[0] for c in CASES if c[4] is not None])
def test_report_cli_refuses_exactly_what_the_library_refuses(case, tmp_path, capsys):
    name, fields, flags, _, report_expect, named = case
    flags = [f for i, f in enumerate(flags) if f != "--strategy" and (i == 0 or flags[i - 1] != "--strategy")]
    code = main(["report", "--lengths", _lengths(tmp_path), *flags, "--strategies", "fixed,slimpack", "--steps", "1",
                 "--out", str(tmp_path / "r"), "--no-plots", "--no-advice", "--no-progress"])
    out = capsys.readouterr()
    assert code == (0 if report_expect == "ok" else 2), out.err  # bad input: 2, as argparse's
    if report_expect == "refused":
        assert all(f in out.err for f in named), out.err
    if report_expect == "unplannable":
        assert "no strategy could plan" in out.err and "invalid configuration" not in out.err, out.err
