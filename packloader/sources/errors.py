"""What a reader says when its input is wrong, and what it counts when asked to skip instead.

Every error names the file, the row (Parquet, MDS: 0-based row; JSONL: 1-based line number) or field, and what was
expected, so that a bad document in a terabyte of shards can be found with one `sed -n` or one pyarrow call.
"""

from __future__ import annotations


class SourceError(ValueError):
    """A shard or document that cannot be read as the source was configured to read it."""


class EmptyDocumentError(SourceError):
    """A document with no text (or no tokens)."""


class NonUtf8Error(SourceError):
    """Text that is not valid UTF-8."""


def empty_error(location: str, what: str = "text") -> EmptyDocumentError:
    return EmptyDocumentError(
        f"{location}: empty document (no {what}); open the source with empty='skip' to skip empty documents "
        "and count them in `source.skipped`"
    )


def check_policy(name: str, value: str) -> None:
    if value not in ("error", "skip"):
        raise ValueError(f"{name} must be 'error' or 'skip', got {value!r}")


class SkipCounter:
    """Counts of what a source skipped instead of failing on, and the first few places it happened."""

    MAX_EXAMPLES = 20

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.examples: list[str] = []

    def add(self, reason: str, location: str, n: int = 1) -> None:
        if n <= 0:
            return
        self.counts[reason] = self.counts.get(reason, 0) + n
        if len(self.examples) < self.MAX_EXAMPLES:
            self.examples.append(f"{location}: {reason}")

    def __getitem__(self, reason: str) -> int:
        return self.counts.get(reason, 0)

    def __repr__(self) -> str:
        return f"SkipCounter({self.counts})"

    def summary(self) -> str:
        if not self.counts:
            return "nothing skipped"
        return ", ".join(f"{n} {reason}" for reason, n in sorted(self.counts.items()))
