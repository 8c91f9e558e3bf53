"""`--plugin MODULE`: import modules that register planners (`packloader.register_planner`) before a command reads
its configuration, so a planner added outside the package is a strategy of `plan` and `report` (and a candidate
of `auto` when its entry says so) like the shipped ones. Repeat the flag for several modules."""

from __future__ import annotations

import argparse

from packloader.balancers.planners.registry import load_plugins


def add_plugin_argument(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    p.add_argument("--plugin", action="append", default=[], metavar="MODULE",
                   help="import MODULE (dotted name, on PYTHONPATH) first: the planners it registers become strategies")


def load(args: argparse.Namespace) -> None:
    """Import the --plugin modules; a ValueError naming the one that does not import."""
    load_plugins(tuple(getattr(args, "plugin", None) or ()))
