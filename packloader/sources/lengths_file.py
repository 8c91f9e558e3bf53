"""Document lengths from a file: the one reader behind `packloader plan --lengths` and `packloader report
--lengths` (each CLI picks its own policy for empty documents).

A lengths file is one of:

* ``.npy``: a 1-D array of integers (or of whole-number floats);
* ``.parquet`` / ``.pq``: an integer column (`column`, default ``length``), or a ``tokens`` list column whose
  list sizes are taken when no column is named and there is no ``length`` column;
* anything else: UTF-8 text, one integer per line (blank lines and ``#`` comments ignored).

Empty documents (length 0): `empty="drop"` leaves them out and counts them (the loader's behaviour, what the
report wants); `empty="keep"` keeps them in place and counts them (for `packloader plan`, whose document ids
are positions in the file: the planner skips them, the ids of the rest stay); `empty="error"` rejects the first one (for `packloader plan`, whose document ids are positions
in the file, so dropping one would renumber the rest). Negative lengths are always an error. Every error is a
LengthsError naming the file and the place (array element, line, or column and row); a missing file raises
LengthsFileMissing, which is both a LengthsError and a FileNotFoundError.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["MAX_LENGTH", "MAX_PIECES_PER_DOCUMENT", "Lengths", "LengthsError", "LengthsFileMissing", "check_pieces", "read_lengths"]

# A document longer than the context is cut into ceil(length / context) pieces, each planned on its own: past this
# many, planning one document would take memory and time out of proportion to the rest of the run, so the commands
# that plan from lengths refuse it instead (a length of 10^12 at context 8,192 would be 1.2e8 pieces).
MAX_PIECES_PER_DOCUMENT = 1 << 16
# Lengths are held as int64: a larger number (a 40-digit line, a uint64 near 2^64, a float of 1e30) is refused
# by name rather than wrapped to a negative or an OverflowError.
MAX_LENGTH = int(np.iinfo(np.int64).max)


class LengthsError(ValueError):
    """A lengths file that cannot be read as document lengths."""


class LengthsFileMissing(LengthsError, FileNotFoundError):
    """The lengths file does not exist."""


@dataclass
class Lengths:
    """Document lengths in draw order, and what was left out on the way."""

    lengths: np.ndarray  # int64, every entry >= 1 (>= 0 with empty="keep")
    origin: str  # the file or source they came from, for the report
    empty: int = 0  # documents of length 0 left out
    exhausted: bool = True  # True when every document of the input was read


def _expected(empty: str) -> str:
    return "a positive length" if empty == "error" else "a length >= 0"


def _check_values(values: np.ndarray, path: str, place, empty: str) -> np.ndarray:
    """int64 lengths from a 1-D numeric array; `place(i)` names entry i's position in the file."""
    if values.ndim != 1:
        raise LengthsError(f"{path}: expected a 1-D array of lengths, got shape {values.shape}")
    if values.dtype.kind == "f":
        bad = np.flatnonzero(~np.isfinite(values) | (values != np.round(values)))
        if len(bad):
            i = int(bad[0])
            raise LengthsError(f"{path}: entry {i} is {float(values[i])!r}, expected a whole number of tokens{place(i)}")
    elif values.dtype.kind not in "iu":
        raise LengthsError(f"{path}: expected integer lengths, got dtype {values.dtype}")
    big = np.flatnonzero(values >= 2.0**63) if values.dtype.kind == "f" else (
        np.flatnonzero(values > MAX_LENGTH) if values.dtype.kind == "u" else np.zeros(0, np.int64))
    if len(big):
        i = int(big[0])
        v = int(values[i])
        raise LengthsError(f"{path}: entry {i} is {v:,}, beyond the largest length {MAX_LENGTH:,} (2^63 - 1){place(i)}")
    out = values.astype(np.int64)
    neg = np.flatnonzero(out < 0)
    if len(neg):
        i = int(neg[0])
        raise LengthsError(f"{path}: entry {i} is {int(out[i])}, expected {_expected(empty)}{place(i)}")
    return out


def _read_text(path: str, empty: str) -> tuple[np.ndarray, list[int]]:
    """The lengths of a text file and the line number of each."""
    vals: list[int] = []
    lines: list[int] = []
    with open(path, "rb") as f:
        for no, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8").split("#", 1)[0].strip()
            except UnicodeDecodeError:
                raise LengthsError(f"{path}, line {no}: not UTF-8 text; expected one integer length per line") from None
            if not line:
                continue
            try:
                v = int(line)
            except ValueError:
                raise LengthsError(f"{path}, line {no}: {line[:40]!r} is not an integer; expected one length per line") from None
            if v < 0:
                raise LengthsError(f"{path}, line {no}: {v} is negative; expected {_expected(empty)}")
            if v > MAX_LENGTH:
                shown = f"{v:,}" if len(line) <= 40 else f"a {len(line)}-digit number"
                raise LengthsError(f"{path}, line {no}: {shown} is beyond the largest length {MAX_LENGTH:,} (2^63 - 1)")
            vals.append(v)
            lines.append(no)
    return np.asarray(vals, dtype=np.int64), lines


def _read_parquet(path: str, column: str | None, column_flag: str, empty: str) -> tuple[np.ndarray, str]:
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    try:
        schema = pq.read_schema(path)
    except Exception as e:  # pyarrow raises several types for a non-Parquet file
        raise LengthsError(f"{path}: not a readable Parquet file ({e})") from None
    names = schema.names
    col = column or ("length" if "length" in names else "tokens" if "tokens" in names else None)
    if col is None or col not in names:
        raise LengthsError(f"{path}: no column {column or 'length'!r}; columns are {names}; pass {column_flag} NAME")
    arr = pq.read_table(path, columns=[col]).column(col).combine_chunks()
    if pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type):
        arr = pc.list_value_length(arr)
    if arr.null_count:
        first = int(np.flatnonzero(np.asarray(arr.is_null()))[0])
        raise LengthsError(f"{path}: column {col!r} row {first} is null, expected a length")
    if not (pa.types.is_integer(arr.type) or pa.types.is_floating(arr.type)):
        raise LengthsError(f"{path}: column {col!r} has type {arr.type}, expected integer lengths or token lists")
    values = np.asarray(arr.to_numpy(zero_copy_only=False))
    return _check_values(values, f"{path} column {col!r}", lambda i: f" (row {i})", empty), col


def check_pieces(lengths: np.ndarray, context: int, origin: str, *, context_flag: str = "--context") -> None:
    """A LengthsError for the first document that `context` would cut into more than MAX_PIECES_PER_DOCUMENT
    pieces (its index is its position in `lengths`)."""
    limit = MAX_PIECES_PER_DOCUMENT * int(context)
    over = np.flatnonzero(np.asarray(lengths) > limit)
    if len(over):
        i = int(over[0])
        n = int(lengths[i])
        raise LengthsError(
            f"{origin}: entry {i} is {n:,} tokens, {-(-n // int(context)):,} pieces of {context_flag} {int(context):,}; "
            f"at most {MAX_PIECES_PER_DOCUMENT:,} pieces per document are planned (lengths up to {limit:,}); "
            f"raise {context_flag} or check the file"
        )


def read_lengths(path: str | os.PathLike, column: str | None = None, *, empty: str = "drop",
                 column_flag: str = "--lengths-column") -> Lengths:
    """Lengths from a .npy, Parquet or text file (see the module docstring). `empty` is "drop" or "error";
    `column_flag` is the calling command's option for the Parquet column, named in the error for a missing
    one."""
    if empty not in ("drop", "keep", "error"):
        raise ValueError(f"empty must be 'drop', 'keep' or 'error', got {empty!r}")
    text = os.fspath(path)
    if not os.path.exists(text):
        raise LengthsFileMissing(f"{text}: no such lengths file")
    if os.path.isdir(text):
        raise LengthsError(f"{text}: is a directory; a lengths file is .npy, .parquet or text with one length per line")
    suffix = Path(text).suffix.lower()
    if suffix == ".npy":
        try:
            values = np.load(text, allow_pickle=False)
        except Exception as e:  # noqa: BLE001 - any unreadable file is a user error here
            raise LengthsError(f"{text}: not a readable .npy array ({e})") from None
        place = lambda i: f" (array element {i})"  # noqa: E731
        values = _check_values(np.asarray(values), text, place, empty)
        where = text
    elif suffix in (".parquet", ".pq"):
        values, col = _read_parquet(text, column, column_flag, empty)
        place = lambda i: f" (row {i})"  # noqa: E731
        where = f"{text} column {col!r}"
    else:
        values, lines = _read_text(text, empty)
        place = None
        where = text
    zeros = np.flatnonzero(values == 0)
    if len(zeros) and empty == "error":
        i = int(zeros[0])
        if place is None:
            raise LengthsError(f"{text}, line {lines[i]}: entry {i} is 0, expected a positive length")
        raise LengthsError(f"{where}: entry {i} is 0, expected a positive length{place(i)}")
    if len(zeros) == len(values):
        raise LengthsError(f"{text}: holds no non-empty document lengths")
    if empty == "drop":
        values = values[values > 0]
    return Lengths(np.ascontiguousarray(values, dtype=np.int64), text, empty=len(zeros))
