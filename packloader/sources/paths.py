"""From what the user named to the files read: globs walked without looping, and every file named once.

Globs follow symlinked directories (datasets are often linked in), except a directory that is a link back to one
the walk is inside already (a loop): it is not entered, so a `**` pattern lists each file once, however the links
run. Listing a file twice, by the same path, through a symlinked alias or a hard link, would read its documents
twice an epoch: `refuse_duplicates` refuses it, naming both paths. Files are compared by device and inode (what
`os.stat` resolves symlinks to).
"""

from __future__ import annotations

import os
from fnmatch import fnmatchcase
from typing import Iterator, Sequence

from packloader.sources.errors import SourceError

MAGIC = "*?["


def has_magic(pattern: str) -> bool:
    return any(c in pattern for c in MAGIC)


def _visible(name: str, pat: str, hidden: bool) -> bool:
    """Hidden names only match a pattern part that starts with "." itself (as `glob` does), unless asked for."""
    return hidden or not name.startswith(".") or pat.startswith(".")


def _entries(d: str) -> list[os.DirEntry]:
    try:
        with os.scandir(d or ".") as it:
            return sorted(it, key=lambda e: e.name)
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return []


def _is_dir(e: os.DirEntry) -> bool:
    try:
        return e.is_dir()  # follows symlinks
    except OSError:
        return False


def _walk(d: str, parts: list[str], inside: frozenset, hidden: bool) -> Iterator[str]:
    """Paths under directory `d` matching the pattern parts; `inside` holds the real paths of the directories the
    walk is in, so a link back to one of them is not entered."""
    if not parts:
        yield d
        return
    pat, rest = parts[0], parts[1:]
    if pat == "**":
        yield from _walk(d, rest, inside, hidden)
        for e in _entries(d):
            if _visible(e.name, "", hidden) and _is_dir(e):
                real = os.path.realpath(e.path)
                if real not in inside:
                    yield from _walk(e.path, parts, inside | {real}, hidden)
        return
    if not has_magic(pat):
        p = os.path.join(d, pat) if d else pat
        if os.path.lexists(p) and (not rest or os.path.isdir(p)):
            yield from _walk(p, rest, inside | {os.path.realpath(p)} if rest else inside, hidden)
        return
    for e in _entries(d):
        if fnmatchcase(e.name, pat) and _visible(e.name, pat, hidden) and (not rest or _is_dir(e)):
            path = os.path.join(d, e.name) if d else e.name
            real = os.path.realpath(path) if rest else None
            if real not in inside:
                yield from _walk(path, rest, inside | {real} if rest else inside, hidden)


def walk_glob(pattern: str, root: str = "", include_hidden: bool = False) -> list[str]:
    """Sorted paths matching `pattern` (relative to `root` when given), `**` matching any depth; each path once."""
    if root:
        start, parts = root, [p for p in pattern.split("/") if p]
    else:
        absolute = pattern.startswith(os.sep)
        parts = [p for p in pattern.split("/") if p]
        start = os.sep if absolute else ""
    seen = dict.fromkeys(_walk(start, parts, frozenset({os.path.realpath(start or ".")}), include_hidden))
    return sorted(seen)


def refuse_duplicates(paths: Sequence[str]) -> None:
    """A SourceError naming both paths when two of them are the same file."""
    first: dict[tuple[int, int], str] = {}
    for p in paths:
        try:
            st = os.stat(p)
        except OSError:
            continue  # a missing file is the reader's error to name
        key = (st.st_dev, st.st_ino)
        if key in first:
            raise SourceError(
                f"{first[key]} and {p} are the same file ({os.path.realpath(p)}): listed twice, or reached through "
                "a symlink or hard link; its documents would be read twice an epoch. Name each shard once"
            )
        first[key] = p
