"""`packloader <command>`: each command lives in its own module with add_arguments(parser) and run(args)."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

EXIT_PIPE_CLOSED = 128 + 13  # 128 + SIGPIPE

COMMANDS = {
    "report": ("packloader.cli.report", "show what a data set's lengths do to a parallel layout, and what packloader recovers"),
    "plan": ("packloader.cli.plan", "plan steps for a lengths file and write them as JSON lines"),
    "tokenize": ("packloader.cli.tokenize", "turn text shards into Parquet token shards"),
    "calibrate": ("packloader.cli.calibrate", "time attention and linear parts on this device and fit a cost profile"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="packloader", description="Balanced packing for long-context LLM training.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    chosen = argv[0] if argv and argv[0] in COMMANDS else None
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        if name == chosen:  # import only the command being run
            importlib.import_module(module).add_arguments(p)
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # a bad flag (argparse printed why) or --help: the status, for callers of main()
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
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


if __name__ == "__main__":
    raise SystemExit(main())
