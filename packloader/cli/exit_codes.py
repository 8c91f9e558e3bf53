"""One exit-status convention for every `packloader` command, stated in each command's --help (`EPILOG`) and in
docs/cli.md. Bad input is 2 everywhere, as argparse already uses 2 for a bad flag: a script can tell "fix what
you gave me" from a crash (1, Python's own status for an uncaught exception, with its traceback)."""

from __future__ import annotations

EXIT_OK = 0
EXIT_BAD_INPUT = 2  # a file, row, field, option or combination of them that cannot be used: the message names it
EXIT_DOES_NOT_FIT = 3  # `plan --require-fit`: a step does not fit in the device's memory
EXIT_PIPE_CLOSED = 128 + 13  # the reader of stdout went away (`packloader plan | head`), as SIGPIPE ends a tool

EPILOG = ("exit status (every packloader command): 0 done; 2 bad input or options, with a message naming the "
          "file, row, field or flag; 3 only for `plan --require-fit` when a step does not fit in memory; 141 when "
          "the reader of stdout went away; 1 only for an unexpected error (a bug: please report its traceback)")
