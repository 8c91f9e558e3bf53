"""Shards in, documents out: readers, tokenizers and the deterministic, resumable epoch order."""

from packloader.sources.base import DocKey, Document, IterableSource, RawDocument, ShardInfo, Source, Tokenizer

# Readers and tokenizers load on first use, so importing the contract stays cheap (no pyarrow, tiktoken, streaming).
_LAZY = {
    "ParquetSource": "packloader.sources.parquet",
    "JsonlSource": "packloader.sources.jsonl",
    "MdsSource": "packloader.sources.mds",
    "DirectorySource": "packloader.sources.directory",
    "stdlib_corpus": "packloader.sources.directory",
    "open_source": "packloader.sources.open",
    "get_tokenizer": "packloader.sources.tokenizers",
    "tokenize_to_parquet": "packloader.sources.pretokenize",
    "SourceError": "packloader.sources.errors",
    "MegatronIndexedSource": "packloader.sources.megatron_indexed",
    "ArrowTableSource": "packloader.sources.arrow_table",
    "IterableDatasetSource": "packloader.sources.hf_iterable",
    "UnsupportedSourceError": "packloader.sources.unsupported",
    "Format": "packloader.sources.format_registry",
    "register_format": "packloader.sources.format_registry",
}

__all__ = ["DocKey", "Document", "IterableSource", "RawDocument", "ShardInfo", "Source", "Tokenizer", *_LAZY]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'packloader.sources' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
