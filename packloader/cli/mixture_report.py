"""`packloader report --mixture`: the per-entry table after the report (lengths, token and GPU-time shares,
delay), printed and written to OUT/mixture.json."""

from __future__ import annotations

from pathlib import Path

import msgspec
import numpy as np

from packloader.contracts import PlanConfig


def print_entries(stream, lengths: np.ndarray, config: PlanConfig, steps: int, out_dir: str | None) -> None:
    from packloader.balancers.cost.lookup import cost_model_for
    from packloader.balancers.offline import plan_run
    from packloader.balancers.planners.config_rules import validate_config
    from packloader.cli.mixture_option import target_shares
    from packloader.report.mixture_table import entry_rows, render_entries

    config = validate_config(config)
    run = plan_run(lengths, config, steps)
    entries = stream.entry_of(stream.doc_ids(0, np.arange(len(lengths))))
    rows = entry_rows(lengths, entries, stream.names, target_shares(stream), run.plans, run.windows, config,
                      cost_model_for(config))
    print(render_entries(rows, config.strategy))
    if out_dir is not None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / "mixture.json").write_bytes(msgspec.json.format(msgspec.json.encode(rows), indent=2) + b"\n")
