"""`tokenize` split over machines: part i of N tokenizes a deterministic run of the documents, and the parts'
files, read as one directory, are the same tokens in the same order as one machine's `tokenize` of the input.

Part i of N takes documents floor(i D / N) .. floor((i + 1) D / N) - 1 of the input's order (D documents: the
order `tokenize` reads, shard by shard, row by row), so any scheduler that hands out the indices i (a SLURM array,
torchrun ranks, Ray: `tokenize_ray.py`) gets the same split. Its files are `part-IIIII-of-NNNNN-KKKKK.parquet`,
which sort in input order, each with its length index beside it. A part finishes by writing its record,
`_part-IIIII-of-NNNNN.record` (JSON: a `PartRecord`: the range, the input's document count, the tokenizer and EOS settings,
the files). Opening the directory checks the records before anything is read: every part of 0..N-1 present once,
the ranges adjoining and covering the input, one input, one tokenizer and EOS setting, and every token file named
by a record. A part missing, written twice, or tokenized differently is refused, naming it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import msgspec

from packloader.sources.errors import SourceError

RECORD = re.compile(r"^_part-(\d{5})-of-(\d{5})\.record$")


class PartRecord(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What one part wrote: enough for the directory's reader to check the parts form one whole."""

    part: int
    parts: int
    first: int  # the part's documents: first .. end - 1 of the input's order
    end: int
    input_documents: int
    tokenizer: str
    eos_appended: bool
    files: list[str]  # names in the directory
    documents: int
    tokens: int


def parse_part(text: str) -> tuple[int, int]:
    """"i/N" (0 <= i < N) as (i, N)."""
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
    if m is None or not 0 <= int(m.group(1)) < int(m.group(2)):
        raise ValueError(f"--part {text!r}: expected i/N with 0 <= i < N, e.g. 0/4 for the first of four parts")
    return int(m.group(1)), int(m.group(2))


def part_range(documents: int, part: int, parts: int) -> tuple[int, int]:
    return documents * part // parts, documents * (part + 1) // parts


def prefix_of(part: int, parts: int) -> str:
    return f"part-{part:05d}-of-{parts:05d}-"


def record_name(part: int, parts: int) -> str:
    return f"_part-{part:05d}-of-{parts:05d}.record"


def tokenize_part(source, tokenizer, out_dir: str | os.PathLike, part: int, parts: int, **kw) -> PartRecord:
    """Part `part` of `parts` of `tokenize_to_parquet(source, tokenizer, out_dir, **kw)`; returns its record."""
    from packloader.sources.pretokenize import tokenize_to_parquet

    total = sum(s.num_rows for s in source.shards)
    first, end = part_range(total, part, parts)
    out = Path(out_dir)
    (out / record_name(part, parts)).unlink(missing_ok=True)  # a rerun of this part: its old record goes first
    summary = tokenize_to_parquet(source, tokenizer, out, doc_range=(first, end), prefix=prefix_of(part, parts),
                                  metadata={"packloader.part": f"{part}/{parts}"}, **kw)
    record = PartRecord(part=part, parts=parts, first=first, end=end, input_documents=total,
                        tokenizer=summary.tokenizer, eos_appended=summary.eos_appended,
                        files=[os.path.basename(f) for f in summary.files], documents=summary.documents,
                        tokens=summary.tokens)
    tmp = out / f".{record_name(part, parts)}.tmp"
    tmp.write_bytes(msgspec.json.encode(record))
    os.replace(tmp, out / record_name(part, parts))
    return record


def check_parts(directory: str | os.PathLike) -> list[PartRecord] | None:
    """The parts' records of a directory, checked to form one whole; None where no part wrote there."""
    d = Path(directory)
    names = sorted(n for n in os.listdir(d) if RECORD.match(n))
    if not names:
        return None
    records = []
    for n in names:
        try:
            records.append(msgspec.json.decode((d / n).read_bytes(), type=PartRecord))
        except msgspec.DecodeError as e:
            raise SourceError(f"{d / n}: not a tokenize part record ({e})") from e
    parts = {r.parts for r in records}
    if len(parts) != 1:
        raise SourceError(f"{d}: parts of splits into {sorted(parts)} parts ({', '.join(names)}); expected the parts "
                          "of one split: tokenize each part with the same N")
    n = parts.pop()
    have = {r.part for r in records}
    missing = sorted(set(range(n)) - have)
    if missing:
        raise SourceError(f"{d}: part {missing[0]}/{n} is missing ({len(have)} of {n} parts written); run "
                          f"`packloader tokenize ... --part {missing[0]}/{n}` before reading the directory")
    first = records[0]
    for r in records:
        if (r.tokenizer, r.eos_appended, r.input_documents) != (first.tokenizer, first.eos_appended, first.input_documents):
            raise SourceError(f"{d / record_name(r.part, n)}: tokenizer {r.tokenizer!r}, EOS "
                              f"{'appended' if r.eos_appended else 'not appended'}, an input of {r.input_documents} "
                              f"documents; part 0 has {first.tokenizer!r}, EOS "
                              f"{'appended' if first.eos_appended else 'not appended'}, {first.input_documents}: "
                              "expected every part tokenized from one input with one tokenizer")
        if (r.first, r.end) != part_range(r.input_documents, r.part, n):
            raise SourceError(f"{d / record_name(r.part, n)}: documents {r.first}..{r.end - 1}, expected "
                              f"{part_range(r.input_documents, r.part, n)} for part {r.part}/{n}")
    listed = {f for r in records for f in r.files}
    strays = sorted(f for f in os.listdir(d) if f.endswith(".parquet") and not f.startswith((".", "_"))
                    and f not in listed)
    if strays:
        raise SourceError(f"{d}: token file {strays[0]} belongs to no part record ({len(strays)} such files): "
                          "expected only the files of one split's parts (a one-machine run or another split "
                          "wrote there?)")
    gone = sorted(f for f in listed if not (d / f).exists())
    if gone:
        raise SourceError(f"{d}: {gone[0]} is named by a part record and is missing")
    return sorted(records, key=lambda r: r.part)
