"""One section of docs/benchmarks.md per benchmark, between `<!-- SECTION:name -->` and `<!-- END:name -->`
markers, so a rerun of one benchmark leaves the others' figures as they stand."""

from __future__ import annotations

from pathlib import Path


def write_section(path: Path, name: str, heading: str, body: str) -> None:
    """Replace what stands between the markers of `name`; append the section under `heading` when they are
    missing."""
    start, end = f"<!-- SECTION:{name} -->", f"<!-- END:{name} -->"
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    block = f"{start}\n{body.strip()}\n{end}"
    if start in text and end in text:
        text = text[: text.index(start)] + block + text[text.index(end) + len(end):]
    else:
        text = text.rstrip("\n") + f"\n\n## {heading}\n\n" + block + "\n"
    path.write_text(text)
