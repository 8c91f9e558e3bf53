"""Shards in, documents out: readers, tokenizers and the deterministic, resumable epoch order."""

from packloader.sources.base import DocKey, Document, IterableSource, RawDocument, ShardInfo, Source, Tokenizer

__all__ = ["DocKey", "Document", "IterableSource", "RawDocument", "ShardInfo", "Source", "Tokenizer"]
