"""`open_special`: the hook `open_source` calls first, for the path kinds it does not detect itself: URLs (an error:
s3:// and other object storage: `remote_open.py`;
schemes no installed package reads are unsupported, listing what is), Megatron `.bin`/`.idx` pairs, Arrow files (`.arrow`, or a folder of them) and
`datasets` `save_to_disk` folders; objects in place of paths go to `objects.open_object`. What it does not take
(local Parquet, JSONL, MDS, directories) goes back to `open_source` as a list of paths.
"""

from __future__ import annotations

import os

from packloader.sources.format_registry import get_format
from packloader.sources.paths import has_magic, walk_glob
from packloader.sources.unsupported import readable_url, unsupported_url, url_scheme

_OPENED_HERE = ("megatron", "arrow", "hf-disk")  # told by more than a suffix: prefixes, folders' contents


def _expand_magic(paths: list[str]) -> list[str]:
    """Globs expanded by `paths.walk_glob`, which never loops (glob.glob follows symlink loops: through two links
    back up, a `**` walk grows exponentially and never ended)."""
    out = []
    for p in paths:
        out.extend(walk_glob(p) if has_magic(p) and not os.path.exists(p) else [p])  # never loops through links
    return out


def open_special(path_or_paths, *, column: str | None, format: str | None, empty: str):  # noqa: A002
    """(source, None) for objects, URLs (an error), Megatron pairs, Arrow files and save_to_disk folders;
    (None, paths) for the paths open_source reads itself (a one-shot iterator of paths comes back as a list)."""
    if not isinstance(path_or_paths, (str, os.PathLike)):
        from packloader.sources.objects import open_object

        source, path_or_paths = open_object(path_or_paths, column=column, empty=empty)
        if source is not None:
            return source, None
    paths = [os.fspath(path_or_paths)] if isinstance(path_or_paths, (str, os.PathLike)) else list(path_or_paths)
    return _open_paths(paths, column=column, format=format, empty=empty), paths


def _open_paths(paths: list[str], *, column: str | None, format: str | None, empty: str):  # noqa: A002
    from packloader.sources.megatron_indexed import is_megatron_prefix

    remote = [p for p in paths if url_scheme(p)]
    if remote:
        if len(remote) != len(paths):
            raise ValueError(f"pass object URLs or local paths, not a mix: {paths}")
        bad = next((p for p in paths if not readable_url(p)), None)
        if bad is not None:
            raise unsupported_url(bad)
        from packloader.sources.remote_open import open_remote

        return open_remote(paths, storage=None, column=column, format=format, empty=empty)
    if format not in (None, *_OPENED_HERE):
        return None
    expanded = _expand_magic(paths)
    if format == "megatron" or (expanded and all(p.endswith((".bin", ".idx")) or is_megatron_prefix(p)
                                                 for p in expanded)):
        return get_format("megatron").open(expanded, column=column, empty=empty)
    arrow = expanded
    if len(arrow) == 1 and os.path.isdir(arrow[0]):  # a directory among files is open_source's error
        from packloader.sources.hf_datasets import is_disk_folder

        if format == "hf-disk" or is_disk_folder(arrow[0]):
            return get_format("hf-disk").open(arrow[0:1], column=column, empty=empty)
        files = sorted(f for f in os.listdir(arrow[0]) if not f.startswith((".", "_")))
        if files and all(f.endswith(".arrow") for f in files):
            arrow = [os.path.join(arrow[0], f) for f in files]
    if format == "arrow" or (expanded and all(p.endswith(".arrow") for p in arrow)):
        return get_format("arrow").open(arrow, column=column, empty=empty)
    return None
