"""The bad-input catalogue: every kind of bad input a user can hand packloader, the error it gives (naming the
file, row or field) or the skip it counts, and never a hang (each case runs under a timeout).

The table below is the source of truth; docs/bad-input.md lists the same cases with the same message fragments,
and `test_the_docs_list_every_case` keeps the two in sync.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from packloader.cli.main import main
from packloader.collate.batch import SlicesNotSupported
from packloader.contracts import PlanConfig
from packloader.loader.loader import PackedLoader
from packloader.sources.base import IterableSource
from packloader.sources.errors import EmptyDocumentError, NonUtf8Error, SourceError
from packloader.sources.jsonl import JsonlSource
from packloader.sources.open import open_source
from packloader.sources.parquet import ParquetSource
from packloader.sources.pretokenize import tokenize_to_parquet
from packloader.sources.tokenizers import get_tokenizer

DOCS = Path(__file__).resolve().parents[1] / "docs" / "bad-input.md"


class CliExit(Exception):
    """A command that exited with a non-zero status; the message is the status and what it printed on stderr."""


def cli(*argv: str) -> None:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(list(argv))
    if code:
        raise CliExit(f"exit {code}: {err.getvalue()}")


def read_all(src) -> list:
    return [d for shard, info in enumerate(src.shards) for d in src.read(shard, np.arange(info.num_rows))]


def texts(n: int = 60, seed: int = 0) -> list[str]:
    """Random CJK characters: tokens of high entropy, which zstd stores with few checks of its own."""
    rng = np.random.default_rng(seed)
    return ["".join(map(chr, rng.integers(0x4E00, 0x9FFF, size=int(rng.integers(20, 200))))) + f" #{i}"
            for i in range(n)]


def tokenized(tmp: Path) -> tuple[str, list[np.ndarray]]:
    """A shard written by `packloader tokenize` (page checksums, vocabulary in the metadata), and its tokens."""
    summary = tokenize_to_parquet(IterableSource(texts()), get_tokenizer("tekken", num_threads=1), tmp / "tok",
                                  progress=False, row_group_tokens=2000)
    path = summary.files[0]
    return path, [d.copy() for d in read_all(ParquetSource(path))]


def corrupt_page_data(tmp: Path, seed: int) -> Callable[[], object]:
    """One bit flipped at a seeded offset inside the compressed page data of row group 0's token column, at seeds
    where a reader that skips the checksums gets changed tokens, every one inside the vocabulary: nothing but the
    page checksum can tell (checked here, by reading the same bytes with verification off)."""
    path, good = tokenized(tmp)
    col = pq.ParquetFile(path).metadata.row_group(0).column(0)
    start, size = col.data_page_offset, col.total_compressed_size
    rnd = random.Random(seed)
    off = rnd.randrange(start + size // 4, start + size)  # past the page header
    data = bytearray(Path(path).read_bytes())
    data[off] ^= 1 << rnd.randrange(8)
    bad = tmp / "corrupt.parquet"
    bad.write_bytes(bytes(data))
    unchecked = pq.ParquetFile(bad, page_checksum_verification=False).read(columns=["tokens"]).column(0)
    ids = unchecked.combine_chunks().flatten().to_numpy()
    assert len(ids) == sum(map(len, good)) and not np.array_equal(ids, np.concatenate(good))
    assert 0 <= ids.min() and ids.max() < get_tokenizer("tekken").vocab_size  # in range: silent without checksums
    return lambda: read_all(ParquetSource(bad))


def token_table(path: Path, rows: list[list[int]], *, length: bool = True, metadata: dict | None = None) -> Path:
    cols = {"tokens": pa.array(rows, pa.list_(pa.int32()))}
    if length:
        cols["length"] = pa.array([len(r) for r in rows], pa.int32())
    table = pa.table(cols)
    if metadata:
        table = table.replace_schema_metadata(metadata)
    pq.write_table(table, path)
    return path


def jsonl(path: Path, lines: list[str | bytes]) -> Path:
    path.write_bytes(b"".join((x if isinstance(x, bytes) else x.encode()) + b"\n" for x in lines))
    return path


# --- the cases: each returns a thunk that must raise (or, for skips, return the source to inspect) ----------------


def truncated_parquet(tmp):
    path, _ = tokenized(tmp)
    data = Path(path).read_bytes()
    cut = tmp / "cut.parquet"
    cut.write_bytes(data[: len(data) // 2])
    return lambda: ParquetSource(cut)


def parquet_wrong_column(tmp):
    pq.write_table(pa.table({"body": ["a", "b"]}), tmp / "cols.parquet")
    return lambda: open_source(tmp / "cols.parquet")


def parquet_wrong_type(tmp):
    pq.write_table(pa.table({"text": pa.array([1.5, 2.5])}), tmp / "floats.parquet")
    return lambda: open_source(tmp / "floats.parquet")


def parquet_negative_token(tmp):
    p = token_table(tmp / "neg.parquet", [[1, 2, 3], [4, -7, 5]])
    return lambda: read_all(ParquetSource(p))


def parquet_token_beyond_vocab(tmp):
    p = token_table(tmp / "vocab.parquet", [[1, 2, 3], [4, 5, 1000]], metadata={"packloader.vocab_size": "1000"})
    return lambda: read_all(ParquetSource(p))


def parquet_length_mismatch(tmp):
    table = pa.table({"tokens": pa.array([[1, 2], [3, 4, 5]], pa.list_(pa.int32())), "length": pa.array([2, 9])})
    pq.write_table(table, tmp / "len.parquet")
    return lambda: read_all(ParquetSource(tmp / "len.parquet"))


def parquet_empty_row_length_column(tmp):
    p = token_table(tmp / "e1.parquet", [[1, 2], [], [3]], length=True)
    return lambda: PackedLoader(ParquetSource(p), config=_config(), append_eos=False, num_threads=0).__iter__().__next__()


def parquet_empty_row_no_length_column(tmp):
    p = token_table(tmp / "e2.parquet", [[1, 2], [], [3]], length=False)
    return lambda: PackedLoader(ParquetSource(p), config=_config(), append_eos=False, num_threads=0).__iter__().__next__()


def empty_rows_skipped(tmp):
    p = token_table(tmp / "e3.parquet", [[1, 2], [], [3], []], length=True)
    return lambda: ParquetSource(p, empty="skip")


def truncated_jsonl_gz(tmp):
    data = gzip.compress("".join(json.dumps({"text": t}) + "\n" for t in texts()).encode())
    (tmp / "cut.jsonl.gz").write_bytes(data[: len(data) // 2])
    return lambda: JsonlSource(tmp / "cut.jsonl.gz")


def truncated_jsonl_zst(tmp):
    import zstandard

    data = zstandard.ZstdCompressor().compress("".join(json.dumps({"text": t}) + "\n" for t in texts(2000)).encode())
    (tmp / "cut.jsonl.zst").write_bytes(data[: len(data) // 2])  # a stream reader would return the first half
    return lambda: JsonlSource(tmp / "cut.jsonl.zst")


def jsonl_bad_line(tmp):
    p = jsonl(tmp / "mid.jsonl", ['{"text": "a"}', '{"text": "b"}', '{"text": "c", oops}', '{"text": "d"}'])
    return lambda: read_all(JsonlSource(p))


def jsonl_wrong_field(tmp):
    p = jsonl(tmp / "field.jsonl", ['{"body": "a"}'])
    return lambda: JsonlSource(p)


def jsonl_wrong_type(tmp):
    p = jsonl(tmp / "type.jsonl", ['{"text": "a"}', '{"text": 5}'])
    return lambda: read_all(JsonlSource(p))


def jsonl_negative_token(tmp):
    p = jsonl(tmp / "ids.jsonl", ['{"tokens": [1, 2]}', '{"tokens": [3, -7]}'])
    return lambda: read_all(JsonlSource(p))


def jsonl_non_utf8(tmp):
    p = jsonl(tmp / "latin1.jsonl", ['{"text": "fine"}', b'{"text": "caf\xe9"}'])
    return lambda: read_all(JsonlSource(p))


def parquet_non_utf8(tmp):
    raw = pa.array([b"fine", "caf\xe9".encode("latin-1")], pa.binary()).view(pa.string())
    pq.write_table(pa.table({"text": raw}), tmp / "latin1.parquet")
    return lambda: read_all(ParquetSource(tmp / "latin1.parquet"))


def directory_non_utf8(tmp):
    (tmp / "d").mkdir()
    (tmp / "d" / "ok.txt").write_text("hello")
    (tmp / "d" / "latin1.txt").write_bytes(b"caf\xe9")
    return lambda: read_all(open_source(tmp / "d"))


def directory_non_utf8_skipped(tmp):
    (tmp / "d").mkdir()
    (tmp / "d" / "ok.txt").write_text("hello")
    (tmp / "d" / "latin1.txt").write_bytes(b"caf\xe9")
    return lambda: open_source(tmp / "d", errors="skip")


def empty_jsonl_file(tmp):
    (tmp / "empty.jsonl").write_bytes(b"")
    return lambda: open_source(tmp / "empty.jsonl")


def empty_parquet_file(tmp):
    (tmp / "zero.parquet").write_bytes(b"")
    return lambda: open_source(tmp / "zero.parquet")


def empty_text_file(tmp):
    (tmp / "d").mkdir()
    (tmp / "d" / "a.txt").write_text("hello")
    (tmp / "d" / "blank.txt").write_text("")
    return lambda: read_all(open_source(tmp / "d"))


def empty_directory(tmp):
    (tmp / "nothing").mkdir()
    return lambda: open_source(tmp / "nothing")


def glob_matches_nothing(tmp):
    return lambda: open_source(str(tmp / "shards-*.parquet"))


def mixed_formats(tmp):
    (tmp / "mix").mkdir()
    pq.write_table(pa.table({"text": ["a"] * 100}), tmp / "mix" / "a.parquet")
    jsonl(tmp / "mix" / "b.jsonl", ['{"text": "b"}'] * 100)
    return lambda: open_source(tmp / "mix")


def pattern_matches_nothing(tmp):
    (tmp / "src").mkdir()
    (tmp / "src" / "sub").mkdir()
    jsonl(tmp / "src" / "sub" / "data.json", ['{"text": "stray"}'])
    return lambda: cli("tokenize", str(tmp / "src"), "--pattern", "*.py", "--out", str(tmp / "out"),
                       "--tokenizer", "bytes", "--no-progress")


def state_from_another_config(tmp):
    docs = [np.arange(1, 1 + n, dtype=np.int32) for n in (5, 70, 30, 200, 12) * 10]
    a = PackedLoader(IterableSource(docs), config=_config(), num_threads=0)
    next(iter(a))
    state = a.state_dict()
    b = PackedLoader(IterableSource(docs), config=_config(max_tokens=512, context=512), num_threads=0)
    return lambda: b.load_state_dict(state)


def trainer_checkpoint_without_loader_state(tmp):
    """What PackedTrainer.train(resume_from_checkpoint=...) runs first: a checkpoint folder without the loader's
    state (written by another Trainer, or another number of processes)."""
    from packloader_integrations.hf_resume import load_loader_state

    (tmp / "checkpoint-4").mkdir()
    a = PackedLoader(IterableSource([np.arange(1, 9, dtype=np.int32)] * 4), config=_config(), num_threads=0)
    return lambda: load_loader_state(a, str(tmp / "checkpoint-4"), 1)


def trainer_loader_without_state(tmp):
    """What PackedTrainer runs at each checkpoint, with a packed_loader that cannot save where it stands."""
    from packloader_integrations.hf_resume import save_loader_state

    return lambda: save_loader_state([], str(tmp / "checkpoint-1"), 0)


def cli_number_zero(tmp):
    np.save(tmp / "ok.npy", np.array([10, 20, 30]))
    return lambda: cli("plan", "--lengths", str(tmp / "ok.npy"), "--dp", "0", "--quiet")


def cli_number_too_large(tmp):
    np.save(tmp / "ok.npy", np.array([10, 20, 30]))
    return lambda: cli("report", "--lengths", str(tmp / "ok.npy"), "--max-tokens", "1" + "0" * 21,
                       "--out", str(tmp / "r"), "--no-plots", "--no-advice", "--no-progress")


def cli_number_not_a_number(tmp):
    return lambda: cli("tokenize", "stdlib", "--out", str(tmp / "o"), "--threads", "four")


def cli_length_beyond_bound(tmp):
    np.save(tmp / "huge.npy", np.array([10, 10**12, 30]))
    return lambda: cli("plan", "--lengths", str(tmp / "huge.npy"), "--quiet", "--out", str(tmp / "p.jsonl"))


def _state_with(change: Callable[[dict], None]) -> Callable[[], None]:
    """A loader's state in its second step, mid-step (so `skip` is checked against the step), changed by
    `change`, loaded into a fresh loader."""
    docs = [np.arange(1, 1 + n, dtype=np.int32) for n in (5, 70, 30, 200, 12) * 10]
    a = PackedLoader(IterableSource(docs), config=_config(), num_threads=0)
    state = next(a.state_dict() for b in a if b.step == 1)
    assert state["loader"]["skip"] > 0
    change(state)
    b = PackedLoader(IterableSource(docs), config=_config(), num_threads=0)
    return lambda: b.load_state_dict(state)


def state_pos_negative(tmp):
    return _state_with(lambda s: s["loader"]["step_state"].update(pos=-3))


def state_pos_beyond_source(tmp):
    return _state_with(lambda s: s["loader"]["step_state"].update(pos=10**9))


def state_skip_beyond_step(tmp):
    return _state_with(lambda s: s["loader"].update(skip=10000))


def state_epoch_changed(tmp):
    return _state_with(lambda s: s["loader"]["step_state"].update(epoch=7))


def cli_tokens_per_step_below_max_tokens(tmp):
    np.save(tmp / "ok.npy", np.array([10, 20, 30]))
    return lambda: cli("plan", "--lengths", str(tmp / "ok.npy"), "--max-tokens", "1024", "--tokens-per-step", "512",
                       "--quiet")


def lengths_forty_digits(tmp):
    (tmp / "big.txt").write_text("10\n" + "1234567890" * 4 + "\n")
    return lambda: cli("plan", "--lengths", str(tmp / "big.txt"), "--quiet")


def lengths_uint64_max(tmp):
    np.save(tmp / "u64.npy", np.array([10, 2**64 - 1], np.uint64))
    return lambda: cli("plan", "--lengths", str(tmp / "u64.npy"), "--quiet")


class _ClosedPipe(io.TextIOWrapper):
    """A stdout whose reader went away: every write is a BrokenPipeError, as after `packloader plan | head`."""

    def __init__(self) -> None:
        super().__init__(io.BytesIO())
        self._buf = type("Closed", (), {"write": self._broken, "flush": self._broken})()

    @property
    def buffer(self):
        return self._buf

    def _broken(self, *args):
        raise BrokenPipeError(32, "Broken pipe")

    def write(self, text):
        self._broken()


def stdout_closed(tmp):
    np.save(tmp / "ok.npy", np.array([10, 20, 30]))

    def run():
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(_ClosedPipe()):
            code = main(["plan", "--lengths", str(tmp / "ok.npy"), "--quiet"])
        raise CliExit(f"exit {code}: {err.getvalue()}")  # the status and all it printed: nothing

    return run


def to_hf_with_slices(tmp):
    from packloader.collate.collate import collate
    from packloader.contracts import Segment

    b = collate([Segment(8, 0, 2, 0), Segment(7, 4, 10, 0)], {7: np.arange(100, 110), 8: np.array([1, 2])},
                step=5, index_in_step=2)
    return b.to_hf


def _config(**kw) -> PlanConfig:
    base = dict(strategy="fixed", max_tokens=256, context=256, tokens_per_step=1024)
    base.update(kw)
    return PlanConfig(**base)


@dataclass(frozen=True)
class Case:
    name: str
    build: Callable  # tmp_path -> thunk
    raises: type[BaseException] | None  # None: a documented skip, checked by `skipped`
    fragments: tuple[str, ...]  # substrings of the message (file names, rows, fields, what was expected)
    skipped: tuple[str, int] | None = None  # (reason, count) in source.skipped


def _seeded(seed: int) -> Callable:
    return lambda tmp: corrupt_page_data(tmp, seed)


CASES = [
    *(Case(f"corrupt_parquet_pages_seed{s}", _seeded(s), SourceError,
           ("corrupt.parquet", "row group 0 (rows 0..", "column 'tokens'", "CRC checksum")) for s in (0, 1, 2, 4)),
    Case("truncated_parquet", truncated_parquet, SourceError, ("cut.parquet", "not a readable Parquet file")),
    Case("parquet_wrong_column", parquet_wrong_column, SourceError,
         ("cols.parquet", "no text or token column found among ['body']")),
    Case("parquet_wrong_type", parquet_wrong_type, SourceError, ("floats.parquet", "column 'text'", "type double")),
    Case("parquet_negative_token", parquet_negative_token, SourceError,
         ("neg.parquet", "row 1", "column 'tokens'", "token id -7 at position 1", "expected an id >= 0")),
    Case("parquet_token_beyond_vocab", parquet_token_beyond_vocab, SourceError,
         ("vocab.parquet", "row 1", "token id 1000 at position 2", "[0, 1000), the vocabulary")),
    Case("parquet_length_mismatch", parquet_length_mismatch, SourceError,
         ("len.parquet", "row 1", "column 'length': says 9 tokens")),
    Case("parquet_empty_row_length_column", parquet_empty_row_length_column, EmptyDocumentError,
         ("e1.parquet", "row 1", "empty document", "empty='skip'")),
    Case("parquet_empty_row_no_length_column", parquet_empty_row_no_length_column, EmptyDocumentError,
         ("e2.parquet", "row 1", "empty document", "empty='skip'")),
    Case("empty_rows_skipped", empty_rows_skipped, None, ("e3.parquet", "row 1", "empty documents"),
         skipped=("empty documents", 2)),
    Case("truncated_jsonl_gz", truncated_jsonl_gz, SourceError, ("cut.jsonl.gz", "cannot be read as gzip JSONL")),
    Case("truncated_jsonl_zst", truncated_jsonl_zst, SourceError,
         ("cut.jsonl.zst", "cannot be read as zstd JSONL (truncated: the file ends inside a zstd frame)")),
    Case("jsonl_bad_line", jsonl_bad_line, SourceError, ("mid.jsonl", "line 3", "not valid JSON")),
    Case("jsonl_wrong_field", jsonl_wrong_field, SourceError, ("field.jsonl", "line 1", "no text or token field")),
    Case("jsonl_wrong_type", jsonl_wrong_type, SourceError, ("type.jsonl", "line 2", "field 'text'", "Expected `str`")),
    Case("jsonl_negative_token", jsonl_negative_token, SourceError,
         ("ids.jsonl", "line 2", "field 'tokens'", "Expected `int` >= 0")),
    Case("jsonl_non_utf8", jsonl_non_utf8, NonUtf8Error, ("latin1.jsonl", "line 2", "not valid UTF-8")),
    Case("parquet_non_utf8", parquet_non_utf8, NonUtf8Error,
         ("latin1.parquet", "row 1", "column 'text'", "not valid UTF-8")),
    Case("directory_non_utf8", directory_non_utf8, NonUtf8Error, ("latin1.txt", "not valid UTF-8", "errors='skip'")),
    Case("directory_non_utf8_skipped", directory_non_utf8_skipped, None, ("latin1.txt", "non-UTF-8 files"),
         skipped=("non-UTF-8 files", 1)),
    Case("empty_jsonl_file", empty_jsonl_file, SourceError, ("empty.jsonl", "no documents")),
    Case("empty_parquet_file", empty_parquet_file, SourceError, ("zero.parquet", "not a readable Parquet file")),
    Case("empty_text_file", empty_text_file, EmptyDocumentError, ("blank.txt", "empty document (no text)")),
    Case("empty_directory", empty_directory, FileNotFoundError, ("nothing", "no files match '**/*'")),
    Case("glob_matches_nothing", glob_matches_nothing, FileNotFoundError, ("no files match", "shards-*.parquet")),
    Case("mixed_formats", mixed_formats, ValueError,
         ("mix mixes file formats", "parquet: ", "a.parquet", "jsonl: ", "b.jsonl", "nothing was read")),
    Case("pattern_matches_nothing", pattern_matches_nothing, CliExit, ("exit 1", "no files match '*.py'")),
    Case("state_from_another_config", state_from_another_config, ValueError,
         ("differently configured loader", "max_tokens")),
    Case("trainer_checkpoint_without_loader_state", trainer_checkpoint_without_loader_state, FileNotFoundError,
         ("checkpoint-4 holds no packloader loader state for process 1", "packloader_state-rank1.pt")),
    Case("trainer_loader_without_state", trainer_loader_without_state, ValueError,
         ("cannot checkpoint its packed_loader (list): it has no state_dict()", "save_strategy='no'")),
    Case("cli_number_zero", cli_number_zero, CliExit,
         ("exit 2", "argument --dp: must be >= 1 and <= 131,072 (field parallel.dp), got 0")),
    Case("cli_number_too_large", cli_number_too_large, CliExit, ("exit 2", "argument --max-tokens", "<= 1,099,511,627,776 (field max_tokens)")),
    Case("cli_number_not_a_number", cli_number_not_a_number, CliExit, ("exit 2", "argument --threads", "got 'four'")),
    Case("cli_length_beyond_bound", cli_length_beyond_bound, CliExit,
         ("exit 2", "huge.npy", "entry 1", "at most 65,536 pieces per document")),
    Case("state_pos_negative", state_pos_negative, ValueError,
         ("state field loader.step_state.pos = -3: expected 0..49, the documents in this source",)),
    Case("state_pos_beyond_source", state_pos_beyond_source, ValueError,
         ("state field loader.step_state.pos = 1000000000: expected 0..49",)),
    Case("state_skip_beyond_step", state_skip_beyond_step, ValueError,
         ("state field loader.skip = 10000: expected 0..", "the micro-batches this rank has in step")),
    Case("state_epoch_changed", state_epoch_changed, ValueError,
         ("state field loader.step_state.epoch = 7: expected 0, the epochs completed",)),
    Case("cli_tokens_per_step_below_max_tokens", cli_tokens_per_step_below_max_tokens, CliExit,
         ("exit 2", "(--tokens-per-step, --max-tokens)", "tokens_per_step=512 is below max_tokens=1024")),
    Case("lengths_forty_digits", lengths_forty_digits, CliExit,
         ("exit 2", "big.txt, line 2", "is beyond the largest length 9,223,372,036,854,775,807")),
    Case("lengths_uint64_max", lengths_uint64_max, CliExit,
         ("exit 2", "u64.npy: entry 1 is 18,446,744,073,709,551,615, beyond the largest length")),
    Case("stdout_closed", stdout_closed, CliExit, ("exit 141: ",)),
    Case("to_hf_with_slices", to_hf_with_slices, SlicesNotSupported,
         ("PackedBatch.to_hf(): step 5, micro-batch 2 holds a slice of document 7", "allow_slicing=False")),
]


@pytest.mark.timeout(120)  # a hang fails the case instead of blocking the suite
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input(case: Case, tmp_path):
    thunk = case.build(tmp_path)
    if case.raises is None:
        src = thunk()
        reason, count = case.skipped
        assert src.skipped[reason] == count, src.skipped
        message = "; ".join(src.skipped.examples) + "; " + src.skipped.summary()
    else:
        with pytest.raises(case.raises) as info:
            thunk()
        message = str(info.value)
    for fragment in case.fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"


@pytest.mark.timeout(300)
def test_corrupt_token_shards_never_yield_changed_tokens(tmp_path):
    """16 random bytes overwritten anywhere in a tokenized shard, 40 times: each read fails with a SourceError
    naming the file, or yields exactly the original tokens (bytes in statistics the reader never uses)."""
    path, good = tokenized(tmp_path)
    data = Path(path).read_bytes()
    outcomes = {"error": 0, "unchanged": 0}
    for trial in range(40):
        rnd = random.Random(1000 + trial)
        b = bytearray(data)
        off = rnd.randrange(4, len(data) - 16)
        b[off : off + 16] = bytes(rnd.randrange(256) for _ in range(16))
        p = tmp_path / f"c{trial}.parquet"  # a fresh name: the reader memory-maps files
        p.write_bytes(bytes(b))
        try:
            got = read_all(ParquetSource(p))
        except SourceError as e:
            assert p.name in str(e)
            outcomes["error"] += 1
            continue
        assert len(got) == len(good) and all(np.array_equal(a, g) for a, g in zip(good, got)), f"offset {off}"
        outcomes["unchanged"] += 1
    assert outcomes["error"] >= 30, outcomes  # most of a shard is page data, and every page is checked


def test_empty_documents_follow_one_rule(tmp_path):
    """Skipped and counted in `source.skipped`, with or without a length column: the same rows leave the row space."""
    rows = [[1, 2], [], [3], [], [4, 5, 6]]
    with_col = ParquetSource(token_table(tmp_path / "a.parquet", rows, length=True), empty="skip")
    without = ParquetSource(token_table(tmp_path / "b.parquet", rows, length=False), empty="skip")
    for src in (with_col, without):
        assert src.skipped["empty documents"] == 2
        assert [d.tolist() for d in read_all(src)] == [[1, 2], [3], [4, 5, 6]]
    assert with_col.lengths(0).tolist() == [2, 1, 3]


def test_the_docs_list_every_case():
    """docs/bad-input.md has one table row per case, holding every fragment of its message."""
    rows = {m.group(1): line for line in DOCS.read_text().splitlines() if (m := re.match(r"\| `([a-z0-9_]+)` \|", line))}
    names = [c.name for c in CASES if not c.name.startswith("corrupt_parquet_pages_seed")] + ["corrupt_parquet_pages"]
    assert sorted(rows) == sorted(names)
    for case in CASES:
        line = rows["corrupt_parquet_pages" if case.name.startswith("corrupt_parquet_pages_seed") else case.name]
        for fragment in case.fragments:
            assert fragment.replace("|", "\\|") in line, (case.name, fragment)
