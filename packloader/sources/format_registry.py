"""One entry per source format: how it is recognised, its reader, whether it reads from object storage, whether
`packloader tokenize` writes it, and which column it reads. Opening (`open.py`, `special_paths.py`,
`remote_open.py`), the unsupported-source error, the CLI's `--format` choices and docs/formats.md read this table,
so a new format is one `register_format` call (from a plugin module, too).
"""

from __future__ import annotations

import importlib

import msgspec

from packloader.sources.errors import SourceError

# The column rule the readers share: a name given wins, else the first of these the shard holds
# (text is tokenized, a list of integers is read as tokens).
DEFAULT_COLUMNS = ("text", "content", "tokens", "input_ids")


def default_column(where: str, names: list[str], kind_of, *, none_found: str, both_tail: str = "") -> str:
    """The column the rule picks when none is named (Parquet, MDS): the first of DEFAULT_COLUMNS present, where
    `kind_of(name)` says "text" or "tokens"; text beside tokens is refused, since which to train is not guessed."""
    found = [c for c in DEFAULT_COLUMNS if c in names]
    if not found:
        raise SourceError(none_found)
    text = [c for c in found if kind_of(c) == "text"]
    tokens = [c for c in found if kind_of(c) == "tokens"]
    if text and tokens:
        raise SourceError(
            f"{where}: holds text ({', '.join(map(repr, text))}) and tokens ({', '.join(map(repr, tokens))}); "
            f"which to train is not guessed: pass column={tokens[0]!r} to read the tokens as stored, or "
            f"column={text[0]!r} to tokenize the text{both_tail}"
        )
    return found[0]


class Format(msgspec.Struct, frozen=True):
    """A format entry. `opener` is "module:function", called as
    `function(paths, *, column, empty, **options)` and returning a Source; a string keeps
    the table importable without pyarrow and lets a plugin module outside the package add a format."""

    name: str
    description: str
    opener: str
    suffixes: tuple[str, ...] = ()  # file names that say this format (lower case); empty: never detected by name
    remote: bool = False  # read from object storage (s3://, gs://, az://, http(s)://, Storage(filesystem=...))
    written_by_tokenize: bool = False  # `packloader tokenize` writes it
    column_rule: str = ""
    recognised_by: str = ""  # how open_source tells it when format= is not given, for the docs table

    def open(self, paths: list[str], **options):
        """The reader over `paths`; options: column, empty, and what a format reads of pattern, files_per_shard,
        errors, storage (an opener takes `**_` for the rest)."""
        module, _, attr = self.opener.partition(":")
        return getattr(importlib.import_module(module), attr)(paths, **options)


_COLUMNS = ("`column=`, else text or content (string: tokenized) or tokens or input_ids (list of integers: read as "
            "stored); text beside tokens is refused")
_JSONL = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".jsonl.zstd", ".json", ".json.gz", ".json.zst", ".ndjson",
          ".ndjson.gz", ".ndjson.zst")
_OPENERS = "packloader.sources.format_openers"

_REGISTRY: dict[str, Format] = {}


def register_format(entry: Format, *, replace: bool = False) -> Format:
    """Add a format (a plugin's, too). A name already taken is refused unless `replace=True`."""
    if not isinstance(entry, Format):
        raise TypeError(f"register_format takes a packloader Format, got {type(entry).__name__}")
    if entry.name in _REGISTRY and not replace:
        raise ValueError(f"format {entry.name!r} is already registered; pass replace=True to replace it")
    if ":" not in entry.opener:
        raise ValueError(f"format {entry.name!r}: opener must be 'module:function', got {entry.opener!r}")
    _REGISTRY[entry.name] = entry
    return entry


def unregister_format(name: str) -> None:
    """Remove a registered format (a test's or a plugin's)."""
    _REGISTRY.pop(name, None)


def formats() -> tuple[Format, ...]:
    return tuple(_REGISTRY.values())


def format_names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def get_format(name: str) -> Format:
    entry = _REGISTRY.get(name)
    if entry is None:
        raise ValueError(f"format must be one of {format_names()}, got {name!r}")
    return entry


def format_of(path: str) -> str | None:
    """The format a file name says (by suffix), or None."""
    name = path.lower()
    for entry in _REGISTRY.values():
        if entry.suffixes and name.endswith(entry.suffixes):
            return entry.name
    return None


def remote_formats() -> tuple[str, ...]:
    return tuple(e.name for e in _REGISTRY.values() if e.remote)


def detected_by_suffix() -> tuple[str, ...]:
    """Formats a directory's files are sorted into by name (in registry order)."""
    return tuple(e.name for e in _REGISTRY.values() if e.suffixes)


def added_formats() -> tuple[Format, ...]:
    """Formats registered beyond the built-in ones (plugins), for the unsupported-source error."""
    return tuple(e for e in _REGISTRY.values() if e.name not in BUILTIN)


def markdown_table() -> str:
    """The docs table (docs/formats.md holds it; a test checks it against this)."""
    rows = ["| format | recognised by | object storage | written by `tokenize` | column |", "|---|---|---|---|---|"]
    for e in _REGISTRY.values():
        rows.append(f"| `{e.name}` | {e.recognised_by} | {'yes' if e.remote else 'no'} | "
                    f"{'yes' if e.written_by_tokenize else 'no'} | {e.column_rule} |")
    return "\n".join(rows) + "\n"


for _entry in (
    Format("parquet", "Parquet files", f"{_OPENERS}:open_parquet", suffixes=(".parquet", ".pq"), remote=True,
           written_by_tokenize=True, column_rule=_COLUMNS, recognised_by="suffix .parquet, .pq"),
    Format("jsonl", "JSON Lines (.gz/.zst)", f"{_OPENERS}:open_jsonl", suffixes=_JSONL, remote=True,
           column_rule=_COLUMNS.replace("`column=`", "`column=` (the field)"),
           recognised_by="suffix .jsonl, .json, .ndjson (each also .gz, .zst)"),
    Format("mds", "MDS (mosaicml-streaming) directory", f"{_OPENERS}:open_mds", remote=True, column_rule=_COLUMNS,
           recognised_by="a directory (or prefix) holding index.json"),
    Format("directory", "a directory of text files, one document per file", f"{_OPENERS}:open_directory",
           column_rule="the whole file is the text", recognised_by="a directory with no Parquet or JSONL files"),
    Format("arrow", "Arrow IPC files", f"{_OPENERS}:open_arrow", column_rule=_COLUMNS,
           recognised_by="suffix .arrow, or a folder of them"),
    Format("megatron", "Megatron .bin/.idx pairs", f"{_OPENERS}:open_megatron", column_rule="tokens as stored",
           recognised_by="suffix .bin/.idx, or their common prefix"),
    Format("hf-disk", "a datasets save_to_disk folder", f"{_OPENERS}:open_hf_disk", column_rule=_COLUMNS,
           recognised_by="a folder datasets' save_to_disk wrote"),
):
    register_format(_entry)
BUILTIN = format_names()
