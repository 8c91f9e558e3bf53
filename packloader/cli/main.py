"""`packloader <command>`: each command lives in its own module with add_arguments(parser) and run(args).

Every command also takes `--config FILE` (its options from a JSON, YAML or TOML file, `config_file.py`) and
`--log-level` (the `packloader` logger's messages on stderr: warnings by default)."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import textwrap

from packloader.cli.exit_codes import EPILOG, EXIT_BAD_INPUT, EXIT_PIPE_CLOSED

COMMANDS = {
    "report": ("packloader.cli.report", "show what a data set's lengths do to a parallel layout, and what packloader recovers"),
    "plan": ("packloader.cli.plan", "plan steps for a lengths file and write them as JSON lines"),
    "tokenize": ("packloader.cli.tokenize", "turn text shards into Parquet token shards"),
    "calibrate": ("packloader.cli.calibrate", "time attention and linear parts on this device and fit a cost profile"),
    "warmup": ("packloader.cli.warmup", "compile the planners' numba kernels now (a setup step), not on the first report"),
}
LOG_LEVELS = ("debug", "info", "warning", "error")


def add_common_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("every command")
    g.add_argument("--config", metavar="FILE", default=None,
                   help="options from a JSON, YAML or TOML file: PlanConfig's field names for the layout and model "
                        "(parallel as a table), the flags' names with underscores for the rest; flags given here win")
    g.add_argument("--log-level", choices=LOG_LEVELS, default="warning",
                   help="messages of the packloader logger on stderr from this level up (default warning)")


class _Stderr(logging.StreamHandler):
    """Writes to whatever sys.stderr is when a record comes (main() run in-process by tests or tools that swap
    stderr), not to the stream of the first call."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def configure_logging(level: str) -> None:
    """One stderr handler on the `packloader` logger (replaced, not added again, when main() runs twice)."""
    logger = logging.getLogger("packloader")
    for h in [h for h in logger.handlers if getattr(h, "packloader_cli", False)]:
        logger.removeHandler(h)
    handler = _Stderr()
    handler.packloader_cli = True  # type: ignore[attr-defined]
    handler.setFormatter(logging.Formatter("packloader: %(levelname)s: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(level.upper())


def _preload_plugins(argv: list[str]) -> None:
    """Import --plugin modules before the parser is built, so the formats they register are --format choices;
    a plugin that fails is reported later, by the command's own load."""
    from packloader.balancers.planners.registry import load_plugins

    names = [b for a, b in zip(argv, argv[1:]) if a == "--plugin"] + [a[9:] for a in argv if a.startswith("--plugin=")]
    try:
        load_plugins(names)
    except ValueError:
        pass


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--plugin" in argv or any(a.startswith("--plugin=") for a in argv):
        _preload_plugins(argv)
    parser = argparse.ArgumentParser(prog="packloader", description="Balanced packing for long-context LLM training.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    chosen = argv[0] if argv and argv[0] in COMMANDS else None
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        if name == chosen:  # import only the command being run
            importlib.import_module(module).add_arguments(p)
            add_common_arguments(p)
            p.epilog = f"{p.epilog}\n\n{textwrap.fill(EPILOG, 110)}" if p.epilog else EPILOG
            if not _apply_config(p, name, argv[1:]):
                return EXIT_BAD_INPUT
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # a bad flag (argparse printed why) or --help: the status, for callers of main()
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    configure_logging(args.log_level)
    try:
        code = int(importlib.import_module(COMMANDS[args.command][0]).run(args) or 0)
        sys.stdout.flush()  # here, not at exit: a reader gone by now is a BrokenPipeError caught below
        return code
    except BrokenPipeError:
        return pipe_closed()


def pipe_closed() -> int:
    """The reader of stdout went away (`packloader plan | head`): stop quietly, as Unix tools do, with the status
    a shell shows for a tool that SIGPIPE ended. stdout goes to /dev/null, so that the interpreter's last flush
    does not print a traceback of its own."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout without a file descriptor (redirected in-process)
        pass
    return EXIT_PIPE_CLOSED


def _apply_config(p: argparse.ArgumentParser, name: str, rest: list[str]) -> bool:
    from packloader.cli.config_file import ConfigFileError, apply_config_file

    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    known, _ = pre.parse_known_args(rest)
    if known.config is None:
        return True
    try:
        apply_config_file(p, known.config)
    except ConfigFileError as e:
        print(f"packloader {name}: {e}", file=sys.stderr)
        return False
    return True


if __name__ == "__main__":
    raise SystemExit(main())
