"""`--mixture FILE` for `plan` and `report`: a mixture table (JSON, YAML or TOML; or the `mixture` key of a
`--config` file) read as a `Mixture`, and its lengths in the blend's order, as the loader draws them."""

from __future__ import annotations

import argparse

import numpy as np


def add_mixture_argument(p) -> None:
    action = p.add_argument("--mixture", default=None, metavar="FILE",
                            help="a mixture of sources (docs/mixtures.md): a JSON/YAML/TOML file with `entries` "
                            "(name, source, weight | repeat | choose, column, format, tokenizer) and `epoch_docs`; "
                            "in a --config file, the `mixture` table")
    action.takes_table = True  # config_file: a table under the key is the value itself


def load_mixture(value):
    """A Mixture from a file path or a config file's table, refused naming the file, entry or field."""
    from packloader.cli.config_file import read_config_file
    from packloader.sources.mixture import as_mixture

    table = read_config_file(value).get("mixture", None) if isinstance(value, str) else value
    if isinstance(value, str) and table is None:
        table = read_config_file(value)
    return as_mixture(table)


def mixture_stream(args: argparse.Namespace, seed: int, shuffle: bool = True):
    """The mixed stream of `--mixture` with the command's tokenizer, and its first epoch's lengths in order."""
    from packloader.sources.mixed_stream import MixedStream

    stream = MixedStream(load_mixture(args.mixture), getattr(args, "tokenizer", "tekken"), seed=seed,
                         shuffle=shuffle)
    lengths = stream.column_lengths(stream.doc_ids(0, np.arange(stream.num_docs)))
    return stream, lengths


def target_shares(stream) -> np.ndarray:
    """Each entry's share of tokens: its weight, or its quota's tokens in the first epoch."""
    if stream.relative:
        return stream.weights
    summary = stream.epoch_summary(0)
    tokens = np.array([summary[n]["tokens"] for n in stream.names], np.float64)
    return tokens / max(1.0, tokens.sum())
