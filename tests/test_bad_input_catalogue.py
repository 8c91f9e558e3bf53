"""The bad-input catalogue: every kind of bad input a user can hand packloader, the error it gives (naming the
file, row or field) or the skip it counts, and never a hang or a crash: each case runs in a child forked from the
test process, under a timeout (`helpers.forked`), so a signal or a hang fails that case alone, naming it.

The table below is the source of truth; docs/bad-input.md lists the same cases with the same message fragments,
and `test_the_docs_list_every_case` keeps the two in sync.
"""

from __future__ import annotations

import contextlib
import faulthandler
import gzip
import io
import json
import os
import random
import re
import shutil
import signal
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers.forked import ChildFailed, qualified, run_forked
from helpers.sft_bad_input import SFT_CASES

from packloader.balancers.planners.contract import PlanContractError
from packloader.cli.main import main
from packloader.collate.batch import SlicesNotSupported
from packloader.contracts import ParallelConfig, PlanConfig
from packloader.loader.loader import PackedLoader
from packloader.sources.base import IterableSource
from packloader.sources.errors import EmptyDocumentError, NonUtf8Error, SourceError
from packloader.sources.identity import ShardChanged
from packloader.sources.jsonl import JsonlSource
from packloader.sources.open import open_source
from packloader.sources.parquet import ParquetSource
from packloader.sources.pretokenize import tokenize_to_parquet
from packloader.sources.remote import RemoteError
from packloader.sources.tokenizers import get_tokenizer
from packloader.sources.unsupported import UnsupportedSourceError

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


def tokenized(tmp: Path, page_rows: int = 1) -> tuple[str, list[np.ndarray]]:
    """A shard written by `packloader tokenize` (page checksums, vocabulary in the metadata), and its tokens."""
    summary = tokenize_to_parquet(IterableSource(texts()), get_tokenizer("tekken", num_threads=1), tmp / "tok",
                                  progress=False, row_group_tokens=2000, page_rows=page_rows)
    path = summary.files[0]
    return path, [d.copy() for d in read_all(ParquetSource(path))]


def corrupt_page_data(tmp: Path, seed: int) -> Callable[[], object]:
    """One bit flipped at a seeded offset inside the compressed page data of row group 0's token column, at seeds
    where a reader that skips the checksums gets changed tokens, every one inside the vocabulary: nothing but the
    page checksum can tell (checked here, by reading the same bytes with verification off). The shard has pyarrow's
    1 MiB pages (`--page-rows 0`), where the seeds were chosen: with one document a page most flipped bits land in
    a page header or a zstd frame, which fail on their own."""
    path, good = tokenized(tmp, page_rows=0)
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


def parquet_length_statistics_mismatch(tmp):
    """Footer statistics (what ranks plan from) stating 299 for a 300-token document; the column agrees with the tokens."""
    schema = pa.schema([("tokens", pa.list_(pa.int32())), ("length", pa.int32())])
    buf = io.BytesIO()
    with pq.ParquetWriter(buf, schema, write_statistics=["length"]) as w:
        w.write_table(pa.table({"tokens": [[i % 200 for i in range(300)]], "length": [300]}, schema=schema))
    body = buf.getvalue()
    n = int.from_bytes(body[-8:-4], "little")
    footer = body[-8 - n:-8].replace((300).to_bytes(4, "little"), (299).to_bytes(4, "little"))
    (tmp / "stats.parquet").write_bytes(body[:-8 - n] + footer + body[-8:])
    return lambda: read_all(ParquetSource(tmp / "stats.parquet"))


def _indexed_shard(tmp, docs):
    """A token shard with one document a page and its length index beside it, read as a remote shard (through a
    filesystem object) so the index is used."""
    import pyarrow.fs as pafs

    from packloader.sources.pretokenize import write_index
    from packloader.sources.storage import Storage

    p = tmp / "idx.parquet"
    pq.write_table(pa.table({"tokens": pa.array(docs, pa.list_(pa.int32()))}), p, max_rows_per_page=1,
                   use_dictionary=False)
    index = write_index(str(p))
    return p, index, lambda: read_all(open_source(Storage(filesystem=pafs.LocalFileSystem(), block_size=0).paths(str(p))))


def length_index_corrupt(tmp):
    _, index, read = _indexed_shard(tmp, [[1, 2, 3], [4, 5]])
    raw = bytearray(Path(index).read_bytes())
    raw[-3] ^= 0x55
    Path(index).write_bytes(bytes(raw))
    return read


def length_index_of_another_shard(tmp):
    p, _, read = _indexed_shard(tmp, [[1, 2, 3], [4, 5]])
    pq.write_table(pa.table({"tokens": pa.array([[1, 2], [3]], pa.list_(pa.int32()))}), p)  # rewritten, index stale
    return read


def length_index_lengths_disagree(tmp):
    """A well-formed index (hash recomputed) whose first two lengths are swapped: the pages say otherwise."""
    import msgspec

    from packloader.sources.length_index import decode, encode

    _, index, read = _indexed_shard(tmp, [[1, 2, 3], [4, 5]])
    idx = decode(Path(index).read_bytes(), index)
    Path(index).write_bytes(encode(msgspec.structs.replace(idx, lengths=np.array([2, 3], "<i8").tobytes())))
    return read


def local_indexed_page_corrupt(tmp):
    """A local shard as `tokenize` writes it (one document a page, its index beside), the last byte of row group
    0's token pages flipped: same size and footer, so the index still matches and the local reader decodes the
    row group through it; the page's CRC tells."""
    from packloader.sources.pretokenize import write_index

    p = tmp / "idx.parquet"
    pq.write_table(pa.table({"tokens": pa.array([[1, 2, 3], [4, 5], [6, 7, 8, 9]], pa.list_(pa.int32()))}), p,
                   max_rows_per_page=1, use_dictionary=False, compression="zstd", write_page_checksum=True)
    write_index(str(p))
    col = pq.read_metadata(p).row_group(0).column(0)
    raw = bytearray(p.read_bytes())
    raw[col.data_page_offset + col.total_compressed_size - 1] ^= 0x01
    p.write_bytes(bytes(raw))
    return lambda: read_all(ParquetSource(p))


def local_length_index_lengths_disagree(tmp):
    """A local shard as `tokenize` writes it, its index's lengths of rows 0 and 1 swapped and the hash recomputed:
    the local decoder holds each page's rows to the index, as the ranged reader does (was: boundaries moved)."""
    import msgspec

    from packloader.sources.length_index import decode, encode
    from packloader.sources.pretokenize import write_index

    p = tmp / "loc.parquet"
    pq.write_table(pa.table({"tokens": pa.array([[1, 2, 3], [4, 5], [6, 7, 8, 9]], pa.list_(pa.int32()))}), p,
                   max_rows_per_page=1, use_dictionary=False, compression="zstd", write_page_checksum=True)
    index = write_index(str(p))
    idx = decode(Path(index).read_bytes(), index)
    Path(index).write_bytes(encode(msgspec.structs.replace(idx, lengths=np.array([2, 3, 4], "<i8").tobytes())))
    return lambda: read_all(ParquetSource(p))


def cache_block_size_changed(tmp):
    """A Parquet shard read through the disk cache with 64 KiB blocks, then by a new Storage with 4 KiB blocks over
    the same cache directory (was: "File too short" / "no footer at its end" for a healthy shard)."""
    import pyarrow.fs as pafs

    from packloader.sources.storage import Storage

    rows = [list(range(i % 500 + 1)) for i in range(300)]
    pq.write_table(pa.table({"tokens": pa.array(rows, pa.list_(pa.int32()))}), tmp / "c.parquet", row_group_size=60)

    def read(block_size):
        storage = Storage(filesystem=pafs.LocalFileSystem(), block_size=block_size, cache_dir=str(tmp / "cache"),
                          cache_bytes=1 << 30, index="off")
        return [d.tolist() for d in read_all(open_source(storage.paths(str(tmp / "c.parquet"))))]

    def both():
        first, second = read(64 << 10), read(4 << 10)
        return f"{len(second)} documents at 4 KiB blocks, equal to the file's: {first == second == rows}"

    return both


def http_shard_without_version_replaced(tmp):
    """A JSONL shard served over http without ETag or Last-Modified, a state saved after 3 micro-batches, the file
    replaced by one of the same size (was: resumed, 3,678 tokens wrong in the issue's run)."""
    from helpers.plain_http import serve, write_docs

    from packloader.sources.storage import Storage

    write_docs(tmp / "a.jsonl", 1)
    _, base = serve(str(tmp))
    url = f"{base}/a.jsonl"

    def make():
        return PackedLoader(Storage(block_size=1 << 10).paths(url), tokenizer=None, num_threads=0,
                            config=PlanConfig(strategy="fixed", max_tokens=128, context=128, tokens_per_step=256))

    first = make()
    it = iter(first)
    for _ in range(3):
        next(it)
    state = first.state_dict()
    write_docs(tmp / "a.jsonl", 2)
    return lambda: make().load_state_dict(state)


def _broken_plugin_plan(tmp, strategy):
    np.save(tmp / "l.npy", np.array([700, 300, 1500, 40, 900, 2000, 60, 1200]))
    return lambda: cli("plan", "--lengths", str(tmp / "l.npy"), "--plugin", "plugins.broken_planners", "--strategy",
                       strategy, "--dp", "2", "--max-tokens", "2048", "--context", "2048", "--tokens-per-step",
                       "6701", "--model", "tiny", "--out", str(tmp / "plan.jsonl"))


def plugin_planner_overfills_a_micro_batch(tmp):
    return _broken_plugin_plan(tmp, "broken_one_micro_batch")


def plugin_planner_drops_a_piece(tmp):
    return _broken_plugin_plan(tmp, "broken_drop_piece")


def plugin_planner_in_the_loader(tmp):
    """The same plugin's planner (one piece listed twice) as the loader's strategy: refused before any batch."""
    from packloader.balancers.planners.registry import load_plugins

    load_plugins(["plugins.broken_planners"])
    docs = [np.arange(n, dtype=np.int32) % 200 for n in (100, 50, 200, 30, 120, 80)]
    ld = PackedLoader(IterableSource(docs), config=PlanConfig(strategy="broken_duplicate_piece", max_tokens=256,
                                                              context=256, tokens_per_step=512), num_threads=0)
    return lambda: next(iter(ld))


def trainer_dp_merge_micro_batch(tmp):
    """SlimPack at dp 3 merges each 900-token document over two DP ranks; rank 0's first micro-batch to hf_batch
    (what PackedTrainer trains)."""
    from packloader_integrations.hf import hf_batch

    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 101, size=n).astype(np.int32) for n in [900, 50, 60, 40, 70, 30, 20, 25, 900, 40, 30, 60]]
    cfg = PlanConfig(strategy="slimpack", parallel=ParallelConfig(dp=3), max_tokens=1024, context=1024,
                     tokens_per_step=1200, model="tiny", allow_slicing=False)
    batch = next(iter(PackedLoader(IterableSource(docs), config=cfg, dp_rank=0, num_threads=0, append_eos=False)))
    return lambda: hf_batch(batch)


def _checkpoint(tmp, name, step, run, state_step):
    """A checkpoint folder as PackedTrainer writes it: trainer_state.json (global step, run) and a loader state
    bound to `state_step` of `run`."""
    from packloader_integrations.hf_resume import save_loader_state

    ld = PackedLoader(IterableSource([np.arange(20, dtype=np.int32)]), config=PlanConfig(strategy="fixed",
                      max_tokens=16, context=16, tokens_per_step=16), num_threads=0)
    folder = tmp / name
    save_loader_state(ld, str(folder), 0, global_step=state_step, run=run)
    (folder / "trainer_state.json").write_text(json.dumps(
        {"global_step": step, "stateful_callbacks": {"PackloaderRun": {"args": {"run": "r1"}, "attributes": {}}}}))
    return ld, folder


def trainer_state_of_a_later_checkpoint(tmp):
    from packloader_integrations.hf_resume import load_loader_state

    ld, folder = _checkpoint(tmp, "checkpoint-2", 2, "r1", 4)
    return lambda: load_loader_state(ld, str(folder), 0)


def trainer_state_of_another_run(tmp):
    from packloader_integrations.hf_resume import load_loader_state

    ld, folder = _checkpoint(tmp, "checkpoint-2", 2, "r0", 2)
    return lambda: load_loader_state(ld, str(folder), 0)


def _config_plan(tmp, name, text):
    np.save(tmp / "ok.npy", np.array([10, 20, 30]))
    (tmp / name).write_text(text.replace("LENGTHS", str(tmp / "ok.npy")))
    return lambda: cli("plan", "--config", str(tmp / name), "--out", str(tmp / "p.jsonl"))


def config_file_key_twice_json(tmp):
    return _config_plan(tmp, "run.json", '{"lengths": "LENGTHS", "max_tokens": 2048, "max_tokens": 4096}')


def config_file_key_twice_yaml(tmp):
    return _config_plan(tmp, "run.yaml", "lengths: LENGTHS\nmax_tokens: 2048\ncontext: 1024\nmax_tokens: 4096\n")


def config_file_two_spellings(tmp):
    return _config_plan(tmp, "run.json", '{"lengths": "LENGTHS", "max_tokens": 2048, "max-tokens": 4096}')


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


def _foreign_state(tmp):
    """A loader and a state saved by one configured with another max_tokens and context."""
    docs = [np.arange(1, 1 + n, dtype=np.int32) for n in (5, 70, 30, 200, 12) * 10]
    a = PackedLoader(IterableSource(docs), config=_config(), num_threads=0)
    next(iter(a))
    state = a.state_dict()
    b = PackedLoader(IterableSource(docs), config=_config(max_tokens=512, context=512), num_threads=0)
    return b, state


def state_from_another_config(tmp):
    b, state = _foreign_state(tmp)
    return lambda: b.load_state_dict(state)


def state_from_another_config_not_strict(tmp):
    b, state = _foreign_state(tmp)
    return lambda: b.load_state_dict(state, strict=False)


def config_file_unknown_key(tmp):
    np.save(tmp / "ok.npy", np.array([10, 20, 30]))
    (tmp / "run.json").write_text(json.dumps({"lengths": str(tmp / "ok.npy"), "parallel": {"dp": 2}, "max_tokenz": 8}))
    return lambda: cli("plan", "--config", str(tmp / "run.json"))


def config_file_misspelt_key_no_layout(tmp):
    jsonl(tmp / "in.jsonl", ['{"text": "a b"}'])
    (tmp / "tok.toml").write_text('tokenizr = "bytes"\n')
    return lambda: cli("tokenize", str(tmp / "in.jsonl"), "--out", str(tmp / "out"), "--config", str(tmp / "tok.toml"))


def report_out_not_creatable(tmp):
    np.save(tmp / "ok.npy", np.array([10, 20, 30]))
    (tmp / "f.txt").write_text("")
    return lambda: cli("report", "--lengths", str(tmp / "ok.npy"), "--out", str(tmp / "f.txt" / "r"), "--no-progress")


def plan_given_a_corpus(tmp):
    jsonl(tmp / "c.jsonl", ['{"text": "a b"}'])
    return lambda: cli("plan", "--lengths", str(tmp / "c.jsonl"), "--quiet")


def tokenize_out_already_holds_shards(tmp):
    jsonl(tmp / "in.jsonl", ['{"text": "a b"}'])
    argv = ("tokenize", str(tmp / "in.jsonl"), "--tokenizer", "bytes", "--out", str(tmp / "out"), "--no-progress")
    cli(*argv)
    return lambda: cli(*argv)


def model_shape_incomplete(tmp):
    from packloader.balancers.cost.resolve import load_cost_model

    return lambda: load_cost_model("shape:mine:hidden=4096,layers=32")


def mid_step_state_at_another_layout(tmp):
    docs = [np.arange(1, 1 + n, dtype=np.int32) for n in (5, 70, 30, 200, 12) * 10]
    par = ParallelConfig(dp=2)
    a = PackedLoader(IterableSource(docs), config=_config(parallel=par), dp_rank=0, num_threads=0)
    next(iter(a))
    state = a.state_dict()
    b = PackedLoader(IterableSource(docs), config=_config(parallel=ParallelConfig(dp=4)), dp_rank=0, num_threads=0)
    return lambda: b.load_state_dict(state)


def worker_state_at_another_worker_count(tmp):
    from packloader.loader.dataset import PackedDataset, _StepIterator

    docs = [np.arange(1, 1 + n, dtype=np.int32) for n in (5, 70, 30, 200, 12) * 10]
    ds = PackedDataset(IterableSource(docs), config=_config(), num_threads=0)
    it = iter(ds)  # the main process: worker 0 of 1
    next(it)
    state = it.state_dict()
    it.close()
    return lambda: _StepIterator(ds, 1, 2).load_state_dict(state)


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


def state_first_drawn_not_pending(tmp):
    return _state_with(lambda s: s["loader"]["step_state"].update(first_drawn=[[0, 0]]))


def cli_tokens_per_step_below_max_tokens(tmp):
    np.save(tmp / "ok.npy", np.array([10, 20, 30]))
    return lambda: cli("plan", "--lengths", str(tmp / "ok.npy"), "--max-tokens", "1024", "--tokens-per-step", "512",
                       "--quiet")


def dynamic_cp_unpriced_schedule(tmp):
    from packloader.balancers.factory import make_planner

    cfg = PlanConfig(parallel=ParallelConfig(dp=2, pp=2, vpp=2, cp=2), schedule="zb-v", cp_mode="dynamic")
    return lambda: make_planner(cfg)


def cli_zbv_without_two_chunks(tmp):
    np.save(tmp / "ok.npy", np.array([10, 20, 30]))
    return lambda: cli("plan", "--lengths", str(tmp / "ok.npy"), "--pp", "2", "--schedule", "zb-v", "--quiet")


def cli_planner_option_unknown(tmp):
    np.save(tmp / "ok.npy", np.array([10, 20, 30]))
    return lambda: cli("plan", "--lengths", str(tmp / "ok.npy"), "--planner-options", '{"wlb": {"fil": 0.5}}', "--quiet")


def cli_plugin_not_importable(tmp):
    np.save(tmp / "ok.npy", np.array([10, 20, 30]))
    return lambda: cli("plan", "--lengths", str(tmp / "ok.npy"), "--plugin", "no_such_planners", "--quiet")


def planner_options_unknown_planner(tmp):
    from packloader.loader.state import validate_config

    return lambda: validate_config(dict(strategy="wlb", planner_options={"slimpak": {}}))


def device_unknown(tmp):
    np.save(tmp / "ok.npy", np.array([10, 20, 30]))
    return lambda: cli("plan", "--lengths", str(tmp / "ok.npy"), "--device", "b200", "--quiet")


def device_file_misnamed(tmp):
    from packloader.balancers.cost.devices import DEVICES_DIR, register_device

    spec = json.loads((DEVICES_DIR / "h200.json").read_text())
    (tmp / "b200.json").write_text(json.dumps(dict(spec, name="h200")))
    return lambda: register_device(tmp / "b200.json")


def device_cp_shard_size_missing(tmp):
    from packloader.balancers.cost.devices import DEVICES_DIR, register_device
    from packloader.balancers.cost.resolve import load_cost_model

    spec = json.loads((DEVICES_DIR / "h200.json").read_text())
    (tmp / "b200.json").write_text(json.dumps(dict(spec, name="b200", cp_shard={"fwd": {"2": 1.2}, "bwd": {"2": 1.3}})))
    register_device(tmp / "b200.json")
    return lambda: load_cost_model("llama3-8b", ParallelConfig(cp=4, tp=8), device="b200")


def cli_context_beyond_max_tokens_unsliced(tmp):
    np.save(tmp / "ok.npy", np.array([10, 20, 30]))
    return lambda: cli("plan", "--lengths", str(tmp / "ok.npy"), "--strategy", "fixed", "--max-tokens", "1024",
                       "--context", "2048", "--tokens-per-step", "4096", "--quiet")


def cli_cp_mode_dynamic_with_fixed_cp_strategy(tmp):
    np.save(tmp / "ok.npy", np.array([10, 20, 30]))
    return lambda: cli("plan", "--lengths", str(tmp / "ok.npy"), "--strategy", "wlb", "--cp-mode", "dynamic", "--quiet")


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


def dynamic_cp_misaligned_group(tmp):
    from packloader.collate.cp_document_shards import plan_dynamic_cp
    from packloader.contracts import CPPlacement, MicroBatch, Segment

    mb = MicroBatch(segments=[Segment(2, 0, 10, 0), Segment(9, 4, 12, 4)], cp=[CPPlacement(1, 1), CPPlacement(2, 1)])
    return lambda: plan_dynamic_cp(mb, gpu=1, pool=4)


def dynamic_cp_chain_slice(tmp):
    from packloader.contracts import CPPlacement, MicroBatch, Segment
    from packloader.loader.pool import localize_step

    # a chain's second slice (tokens 8192.. of document 3 after its first 8192) on GPU 0 alone, its first slice on
    # GPUs 0..1: the earlier keys were kept on another CP group
    mbs = [MicroBatch(segments=[Segment(3, 0, 8192, 0)], cp=[CPPlacement(2, 0)]),
           MicroBatch(segments=[Segment(5, 0, 100, 0), Segment(3, 8192, 16384, 0)], cp=[CPPlacement(1, 0)] * 2)]
    return lambda: localize_step([], mbs, 0, 2)


def dynamic_cp_without_cp_rank(tmp):
    import msgspec

    from packloader.balancers.planners.fixed import FixedPlanner
    from packloader.contracts import CPPlacement, RankPlan

    cfg = _config(parallel=ParallelConfig(dp=1, cp=2), allow_slicing=False)

    class OneGpuEach:  # the fixed plan as per-document CP: each micro-batch whole on pool GPU 0, GPU 1 idle
        def plan(self, window, state, layout):
            plan, st = FixedPlanner(cfg).plan(window, state, layout)
            mbs = [msgspec.structs.replace(mb, cp=[CPPlacement(1, 0)] * len(mb.segments))
                   for mb in plan.ranks[0].micro_batches]
            idle = [msgspec.structs.replace(mb, segments=[], cp=[]) for mb in mbs]
            ranks = [RankPlan(micro_batches=mbs), RankPlan(micro_batches=idle)]
            return msgspec.structs.replace(plan, ranks=ranks, cp_mode="dynamic"), st

    loader = PackedLoader(IterableSource([np.arange(40, dtype=np.int32)]), config=cfg, planner=OneGpuEach(),
                          dp_rank=0, num_threads=0)
    return lambda: next(iter(loader))
# --- what the user did not mean: shards known by content, files read twice, tokenizers, columns (issue 22) -----------


def mixed_tokenizers(tmp):
    out = []
    for name, tok in (("a-bytes", "bytes"), ("b-tekken", "tekken")):
        summary = tokenize_to_parquet(IterableSource(texts(8)), get_tokenizer(tok, num_threads=1), tmp / tok,
                                      progress=False)
        out.append(shutil.move(summary.files[0], tmp / f"{name}.parquet"))
    return lambda: ParquetSource(out)


def token_beyond_named_tokenizer(tmp):
    p = token_table(tmp / "ids.parquet", [[1, 2, 3], [4, 300]], length=False)
    return lambda: list(PackedLoader(str(p), tokenizer="bytes", config=_config(), num_threads=0, shuffle=False))


def unknown_tokenizer_for_tokens(tmp):
    p = token_table(tmp / "ids.parquet", [[1, 2, 3], [4, 5]])
    return lambda: PackedLoader(str(p), tokenizer="tekkenn", config=_config(), num_threads=0)


def parquet_text_beside_tokens(tmp):
    pq.write_table(pa.table({"text": ["a b", "c"], "input_ids": pa.array([[1, 2], [3]], pa.list_(pa.int32()))}),
                   tmp / "both.parquet")
    return lambda: open_source(tmp / "both.parquet")


def jsonl_text_beside_tokens(tmp):
    p = jsonl(tmp / "both.jsonl", ['{"text": "a b", "tokens": [1, 2]}'])
    return lambda: open_source(p)


def shard_listed_twice(tmp):
    p = token_table(tmp / "twice.parquet", [[1, 2], [3]])
    return lambda: open_source([str(p), str(p)])


def shard_through_symlink_alias(tmp):
    (tmp / "d" / "sub").mkdir(parents=True)
    jsonl(tmp / "d" / "sub" / "x.jsonl", ['{"text": "once"}'])
    os.symlink("sub", tmp / "d" / "alias")
    return lambda: open_source(tmp / "d")


def _mixture_loader(*entries, tokenizer="tekken"):
    """A PackedLoader over a mixture of (name, source, fields) entries (issue 36's bad-input cases)."""
    from packloader.sources.mixture import Mixture, MixtureEntry

    mixture = Mixture(entries=[MixtureEntry(name=n, source=s, **kw) for n, s, kw in entries])
    return lambda: PackedLoader(mixture, tokenizer=tokenizer, config=PlanConfig(max_tokens=256, context=256,
                                                                                tokens_per_step=1024))


def _two_jsonl(tmp):
    web, code = tmp / "web.jsonl", tmp / "code.jsonl"
    web.write_text('{"text": "a page"}\n{"text": "another page"}\n')
    code.write_text('{"text": "def f(): pass"}\n')
    return str(web), str(code)


def mixture_negative_weight(tmp):
    web, code = _two_jsonl(tmp)
    return _mixture_loader(("web", web, {"weight": 0.7}), ("code", code, {"weight": -0.3}))


def mixture_nan_weight(tmp):
    web, code = _two_jsonl(tmp)
    return _mixture_loader(("web", web, {"weight": float("nan")}), ("code", code, {"weight": 0.3}))


def mixture_all_zero_weights(tmp):
    web, code = _two_jsonl(tmp)
    return _mixture_loader(("web", web, {"weight": 0.0}), ("code", code, {"weight": 0.0}))


def mixture_empty_entry(tmp):
    web, _ = _two_jsonl(tmp)
    (tmp / "math.jsonl").write_text("")
    return _mixture_loader(("web", web, {"weight": 0.7}), ("math", str(tmp / "math.jsonl"), {"weight": 0.3}))


def mixture_same_file_twice(tmp):
    web, code = _two_jsonl(tmp)
    return _mixture_loader(("web", web, {"weight": 0.5}), ("code", [code, web], {"weight": 0.5}))


def mixture_tokenizers_differ(tmp):
    web, code = _two_jsonl(tmp)
    return _mixture_loader(("web", web, {"weight": 0.5}), ("code", code, {"weight": 0.5, "tokenizer": "bytes"}))


def shard_hard_link(tmp):
    p = token_table(tmp / "a.parquet", [[1, 2], [3]])
    os.link(p, tmp / "b.parquet")
    return lambda: open_source([str(p), str(tmp / "b.parquet")])


def glob_through_symlink_loop(tmp):
    """Read once, not an error: the documents a recursive glob through `sub/loop -> ..` and `self -> .` yields."""
    (tmp / "d" / "sub").mkdir(parents=True)
    jsonl(tmp / "d" / "sub" / "x.jsonl", ['{"text": "one"}', '{"text": "two"}'])
    os.symlink("..", tmp / "d" / "sub" / "loop")
    os.symlink(".", tmp / "d" / "self")

    def run():
        src = open_source(str(tmp / "d" / "**" / "*.jsonl"))
        return (f"{len(src.shards)} shard ({', '.join(Path(str(s.name)).name for s in src.shards)}), "
                f"documents {read_all(src)}")
    return run


def _resume_after(tmp, change):
    paths = [token_table(tmp / f"s{i}.parquet", [[i + 1] * (3 + (r * 7) % 11) for r in range(30)]) for i in range(2)]
    a = PackedLoader([str(p) for p in paths], tokenizer="bytes", config=_config(), num_threads=0)
    next(iter(a))
    state = a.state_dict()
    change(paths[1])
    b = PackedLoader(str(tmp / "s*.parquet"), tokenizer="bytes", config=_config(), num_threads=0)
    return lambda: b.load_state_dict(state)


def _replace(path):
    token_table(path.with_suffix(".new"), [[9] * (5 + r % 3) for r in range(30)])  # same name and row count
    os.replace(path.with_suffix(".new"), path)


def shard_renamed_before_resume(tmp):
    return _resume_after(tmp, lambda p: os.rename(p, p.with_name("s9.parquet")))


def _stale_copy_rank(rank: int, world: int, paths: list[list[str]]):
    """A gloo rank reading its own copy of the shards: what its loader raised before or at the first batch."""
    import torch.distributed as dist

    try:
        loader = PackedLoader(paths[rank], tokenizer="bytes", config=_config(parallel=ParallelConfig(dp=world)),
                              num_threads=1, timeout=30)
        next(iter(loader))
        return None
    except Exception as e:  # noqa: BLE001 - handed back to the case, which raises it
        return e
    finally:
        dist.barrier()


def rank_reads_stale_copy(tmp):
    """Rank 1's tok-000 is a byte-for-byte copy of rank 0's; its tok-001 has the same name and rows, other
    tokens."""
    from helpers.distributed import run_ranks
    from helpers.docs import token_docs, write_token_shards

    docs = token_docs(60, seed=10)
    (tmp / "r0").mkdir()
    (tmp / "r1").mkdir()
    paths = [write_token_shards(tmp / "r0", docs, shards=2),
             write_token_shards(tmp / "r1", docs[:30] + token_docs(30, seed=11), shards=2)]
    shutil.copyfile(paths[0][0], paths[1][0])

    def run():
        errors = run_ranks(_stale_copy_rank, 2, paths, timeout=90)
        assert all(isinstance(e, Exception) for e in errors), errors
        raise errors[1]
    return run


def shard_replaced_before_resume(tmp):
    return _resume_after(tmp, _replace)


def shard_deleted_before_resume(tmp):
    return _resume_after(tmp, os.unlink)


def shard_replaced_while_open(tmp):
    p = tmp / "live.parquet"
    pq.write_table(pa.table({"tokens": pa.array([[1] * (r + 1) for r in range(40)], pa.list_(pa.int32()))}), p,
                   row_group_size=5)
    src = ParquetSource(p)
    list(src.read(0, np.arange(2)))
    _replace(p)
    return lambda: read_all(src)


def _truncated_while_read(path: Path):
    src = open_source(path)
    list(src.read(0, np.arange(2)))

    def run():
        with open(path, "r+b") as f:  # another process cuts the shard in place (SIGBUS under a memory map)
            f.truncate(0)
        for row in range(src.shards[0].num_rows):
            list(src.read(0, np.array([row])))
    return run


def jsonl_truncated_while_read(tmp):
    return _truncated_while_read(jsonl(tmp / "cut.jsonl", [json.dumps({"text": t}) for t in texts(400)]))


def parquet_truncated_while_read(tmp):
    path, _ = tokenized(tmp)
    return _truncated_while_read(Path(shutil.move(path, tmp / "cut.parquet")))


def _megatron_pair(tmp: Path, name: str, sizes=(5, 9, 3)) -> str:
    """A .bin/.idx pair written by megatron-core's own IndexedDatasetBuilder."""
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(str(tmp / f"{name}.bin"), dtype=np.uint16)
    for n in sizes:
        builder.add_document(torch.arange(n), [n])
    builder.finalize(str(tmp / f"{name}.idx"))
    return str(tmp / name)


def tokenize_part_missing(tmp):
    from packloader.sources.tokenize_parts import tokenize_part

    (tmp / "in.jsonl").write_text("".join(f'{{"text": "document {i}"}}\n' for i in range(9)))
    for i in (0, 2):
        tokenize_part(open_source(str(tmp / "in.jsonl")), get_tokenizer("bytes"), tmp / "out", i, 3, progress=False)
    return lambda: open_source(str(tmp / "out"))


def megatron_truncated_bin(tmp):
    prefix = _megatron_pair(tmp, "t")
    data = Path(prefix + ".bin").read_bytes()
    Path(prefix + ".bin").write_bytes(data[:10])
    return lambda: open_source(prefix + ".bin")


def megatron_truncated_while_read(tmp):
    return _truncated_while_read(Path(_megatron_pair(tmp, "cut", sizes=(3000,) * 40) + ".bin"))


def megatron_truncated_idx(tmp):
    prefix = _megatron_pair(tmp, "t")
    data = Path(prefix + ".idx").read_bytes()
    Path(prefix + ".idx").write_bytes(data[:-4])
    return lambda: open_source(prefix + ".idx")


def megatron_bad_header(tmp):
    prefix = _megatron_pair(tmp, "bad")
    data = Path(prefix + ".idx").read_bytes()
    Path(prefix + ".idx").write_bytes(b"NOTANIDX!" + data[9:])
    return lambda: open_source(prefix, format="megatron")


def arrow_not_readable(tmp):
    (tmp / "bad.arrow").write_bytes(b"not an arrow file" * 8)
    return lambda: open_source(tmp / "bad.arrow")


def hf_text_beside_tokens(tmp):
    import datasets

    ds = datasets.Dataset.from_dict({"text": ["ab", "cd"], "input_ids": [[1, 2], [3]]})
    return lambda: PackedLoader(ds, config=_config(), num_threads=0)


def hf_datasetdict_splits(tmp):
    import datasets

    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["a"]}),
                               "test": datasets.Dataset.from_dict({"text": ["b"]})})
    return lambda: PackedLoader(dd, config=_config(), num_threads=0)


def hf_iterable_not_resumable(tmp):
    import datasets

    from packloader.sources.hf_iterable import IterableDatasetSource

    ids = datasets.Dataset.from_dict({"text": [f"doc {i}" for i in range(40)]}).to_iterable_dataset()
    src = IterableDatasetSource(ids.shuffle(seed=1, buffer_size=8), block_rows=10)
    return lambda: list(src.read(1, np.arange(10)))


def list_mixes_paths_and_texts(tmp):
    (tmp / "a.jsonl").write_text('{"text": "x"}\n')
    return lambda: PackedLoader([str(tmp / "a.jsonl"), "a text, not a path"], config=_config(), num_threads=0)


def url_unsupported(tmp):
    return lambda: PackedLoader("ftp://host/shards/*.parquet", config=_config(), num_threads=0)


def http_url_glob(tmp):
    return lambda: PackedLoader("http://127.0.0.1:9/shards/*.parquet", config=_config(), num_threads=0)


def http_server_ignores_range(tmp):
    """The standard library's file server answers a ranged GET with the whole file (200)."""
    import functools
    import threading
    from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

    pq.write_table(pa.table({"text": ["a", "b"]}), tmp / "a.parquet")
    handler = functools.partial(SimpleHTTPRequestHandler, directory=str(tmp))
    handler.log_message = lambda *a: None
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/a.parquet"
    return lambda: PackedLoader(url, config=_config(), num_threads=0)


def filesystem_object_unsupported(tmp):
    import pyarrow.fs

    return lambda: PackedLoader(pyarrow.fs.LocalFileSystem(), config=_config(), num_threads=0)


def unknown_object_unsupported(tmp):
    return lambda: PackedLoader(object(), config=_config(), num_threads=0)


def profile_slice_term_negative(tmp):
    """A cost profile whose measured slice term has a negative per-pair rate (edited by hand?)."""
    from packloader.balancers.cost.measured import base_profile
    from packloader.balancers.cost.profile_io import load_profile, save_profile

    path = tmp / "termed.json"
    save_profile(base_profile(), path)
    data = json.loads(path.read_text())
    data["slice_term"] = {"tile": 1, "x_fwd": -2e-11, "y_fwd": 0.0, "x_bwd": 0.0, "y_bwd": 0.0}
    path.write_text(json.dumps(data))
    return lambda: load_profile(path)


def _profile_file(tmp, name: str, edit) -> Path:
    """The shipped measured profile written to `name` with `edit(data)` applied (a hand-edited profile)."""
    from packloader.balancers.cost.measured import base_profile
    from packloader.balancers.cost.profile_io import save_profile

    path = tmp / name
    save_profile(base_profile(), path)
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))
    return path


def profile_lin_floor_negative(tmp):
    """A profile whose forward per-micro-batch floor is negative: was a schedule deadlock in the loader and a
    `wgt:` error in `plan`, neither naming the file."""
    path = _profile_file(tmp, "floor.json", lambda d: d["lin_fwd"].__setitem__(2, -0.01))
    np.save(tmp / "ok.npy", np.full(200, 1500))
    return lambda: cli("plan", "--lengths", str(tmp / "ok.npy"), "--model", str(path), "--max-tokens", "4096",
                       "--steps", "1", "--quiet")


def profile_attention_negative(tmp):
    """A negative attention coefficient (was accepted, planned with exit 0), through the loader."""
    path = _profile_file(tmp, "attn.json", lambda d: d["attn_bwd"].__setitem__(0, -1e-9))
    docs = [np.arange(1, 60, dtype=np.int32)] * 8
    return lambda: PackedLoader(IterableSource(docs), config=_config(model=str(path)), num_threads=0)


def hf_iterable_iterated_before(tmp):
    """An IterableDataset iterated once (to look at it) before it is handed over: its state_dict then stands at the
    end of that pass, which is not where the next pass starts (was refused, blaming a shuffle buffer)."""
    import datasets

    from packloader.sources.hf_iterable import IterableDatasetSource

    ids = datasets.Dataset.from_dict({"text": [f"doc {i}" for i in range(25)]}).to_iterable_dataset()
    expected = [x["text"] for x in ids]  # the look: a whole pass, the reference for what the source must read
    src = IterableDatasetSource(ids, block_rows=10)
    blocks = {s: list(src.read(s, np.arange(src.shards[s].num_rows))) for s in (2, 0, 1)}  # block 0 last read
    same = all(blocks[s] == expected[10 * s : 10 * s + 10] for s in blocks)
    return lambda: f"{sum(map(len, blocks.values()))} rows in 3 blocks, {'each' if same else 'not'} as the pass read them"


def config_file_path_not_a_string(tmp):
    (tmp / "run.json").write_text(json.dumps({"lengths": 0}))
    return lambda: cli("plan", "--config", str(tmp / "run.json"), "--quiet")


def config_file_out_not_a_string(tmp):
    """`"out": 2` was open(2): the plan written into stderr."""
    np.save(tmp / "ok.npy", np.array([10, 20, 30]))
    (tmp / "run.yaml").write_text(f"lengths: {tmp / 'ok.npy'}\nout: 2\n")
    return lambda: cli("plan", "--config", str(tmp / "run.yaml"), "--quiet")


def config_file_number_is_boolean(tmp):
    np.save(tmp / "ok.npy", np.array([10, 20, 30]))
    (tmp / "run.toml").write_text(f'lengths = "{tmp / "ok.npy"}"\nsteps = true\n')
    return lambda: cli("plan", "--config", str(tmp / "run.toml"), "--quiet")


def config_file_plugin_string(tmp):
    """`plugin` as one module name (was imported letter by letter: `--plugin n: cannot import it`)."""
    np.save(tmp / "ok.npy", np.array([10, 20, 30]))
    (tmp / "run.json").write_text(json.dumps({"lengths": str(tmp / "ok.npy"), "plugin": "no_such_planners"}))
    return lambda: cli("plan", "--config", str(tmp / "run.json"), "--quiet")


def config_file_plugin_list(tmp):
    """`plugin` as a list (was refused): the first imports and registers its planner, the second is named."""
    np.save(tmp / "ok.npy", np.array([10, 20, 30]))
    (tmp / "one.toml").write_text(f'lengths = "{tmp / "ok.npy"}"\nplugin = ["plugins.round_robin"]\n')
    assert main(["plan", "--config", str(tmp / "one.toml"), "--strategy", "round_robin_test", "--out",
                 str(tmp / "p.jsonl"), "--quiet"]) == 0  # a list of one works
    (tmp / "run.toml").write_text(f'lengths = "{tmp / "ok.npy"}"\nplugin = ["plugins.round_robin", "no_such_planners"]\n')
    return lambda: cli("plan", "--config", str(tmp / "run.toml"), "--quiet")


def _plugin_module(tmp, name: str, body: str) -> None:
    import sys

    (tmp / f"{name}.py").write_text(body)
    sys.path.insert(0, str(tmp))  # in the forked child only


def plugin_raises_at_import(tmp):
    _plugin_module(tmp, "broken_planners", "raise RuntimeError('no GPU found')\n")
    np.save(tmp / "ok.npy", np.array([10, 20, 30]))
    return lambda: cli("plan", "--lengths", str(tmp / "ok.npy"), "--plugin", "broken_planners", "--quiet")


def plugin_syntax_error(tmp):
    _plugin_module(tmp, "typo_planners", "def planner(:\n    pass\n")
    np.save(tmp / "ok.npy", np.array([10, 20, 30]))
    return lambda: cli("plan", "--lengths", str(tmp / "ok.npy"), "--plugin", "typo_planners", "--quiet")


def _hf_hub(endpoint: str | None = None, offline: bool = False):
    """huggingface_hub pointed at a dead endpoint or in offline mode, in this (forked) process only; the default
    storage retries quickly."""
    import huggingface_hub.constants
    from huggingface_hub import HfFileSystem

    from packloader.sources import storage as storage_mod
    from packloader.sources.remote import RetryPolicy

    if endpoint is not None:
        huggingface_hub.constants.ENDPOINT = endpoint
    huggingface_hub.constants.HF_HUB_OFFLINE = offline
    HfFileSystem.clear_instance_cache()
    storage_mod._DEFAULT[os.getpid()] = storage_mod.Storage(retry=RetryPolicy(attempts=2, base_delay_s=0.01))


def hf_glob_hub_offline(tmp):
    _hf_hub(offline=True)
    return lambda: open_source("hf://datasets/org/name/data/*.parquet")


def hf_folder_hub_unreachable(tmp):
    _hf_hub(endpoint="http://127.0.0.1:9")  # nothing listens there
    return lambda: open_source("hf://datasets/org/name/data/")


def _trainer_state(tmp, damage) -> tuple:
    """A checkpoint folder whose loader state file (as PackedTrainer writes it) is then damaged by `damage(bytes)`."""
    from packloader_integrations.hf_resume import load_loader_state, save_loader_state

    a = PackedLoader(IterableSource([np.arange(1, 9, dtype=np.int32)] * 4), config=_config(), num_threads=0)
    path = Path(save_loader_state(a, str(tmp / "checkpoint-2"), 0))
    path.write_bytes(damage(path.read_bytes()))
    return lambda: load_loader_state(a, str(tmp / "checkpoint-2"), 0)


def trainer_state_file_truncated(tmp):
    return _trainer_state(tmp, lambda b: b[: len(b) // 2])


def trainer_state_file_garbage(tmp):
    return _trainer_state(tmp, lambda b: bytes(random.Random(3).randrange(256) for _ in range(len(b))))


def merge_states_of_a_merged_state(tmp):
    """merge_states([merged, rank 0, rank 1]): a merged state passed again among the ranks' states."""
    from packloader.loader.elastic import merge_states

    docs = [np.arange(1, 1 + n, dtype=np.int32) for n in (5, 70, 30, 200, 12) * 10]
    states = []
    for rank in (0, 1):
        a = PackedLoader(IterableSource(docs), config=_config(parallel=ParallelConfig(dp=2)), dp_rank=rank,
                         num_threads=0)
        next(iter(a))
        states.append(a.state_dict())
    merged = merge_states(states)
    return lambda: merge_states([merged, *states])


def env_cache_bytes_not_a_size(tmp):
    """`PACKLOADER_CACHE_BYTES=lots` (units such as 1G or 512Mi are read: tests/test_bad_input_focused.py)."""
    from packloader.sources.storage import default_storage

    os.environ["PACKLOADER_CACHE_DIR"] = str(tmp / "cache")
    os.environ["PACKLOADER_CACHE_BYTES"] = "lots"
    return default_storage


def env_cache_dir_without_bytes(tmp):
    from packloader.sources.storage import default_storage

    os.environ["PACKLOADER_CACHE_DIR"] = str(tmp / "cache")
    os.environ.pop("PACKLOADER_CACHE_BYTES", None)
    return default_storage


def arrow_null_token_id(tmp):
    """A null inside a token row of a pyarrow table (was read as token id -2147483648)."""
    table = pa.table({"input_ids": pa.array([[1, 2, 3], [4, None, 6]], pa.list_(pa.int64()))})
    return lambda: read_all(open_source(table))


def hf_dataset_null_token_id(tmp):
    import datasets

    ds = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3], [4, 5, None, 6]]})
    return lambda: read_all(open_source(ds))


def storage_cache_dir_without_bytes(tmp):
    """A disk cache without its bound (was accepted, and nothing was ever cached)."""
    from packloader.sources.storage import Storage

    return lambda: Storage(cache_dir=str(tmp / "cache"))


def storage_block_size_too_small(tmp):
    """`block_size=1`: a request per byte (a 275 KB JSONL was still being read after 10 minutes)."""
    from packloader.sources.storage import Storage

    return lambda: Storage(block_size=1)


def slice_csv_two_launches(tmp):
    """A slice table whose rows name two launches (two tables pasted together?): the fit's assembly term needs
    the one launch its slices were timed beside."""
    from packloader.balancers.cost.slice_fit import read_slice_csv

    path = tmp / "slices.csv"
    path.write_text("q,p,fwd_ms,bwd_ms,launch_segments,launch_tokens\n128,0,0.1,0.3,33,16385\n256,0,0.1,0.3,17,8193\n")
    return lambda: read_slice_csv(path)


def action_list_slice_order(tmp):
    """Written action lists (a `packloader plan` record) whose stage 0 runs the backward of micro-batch 0 before
    that of micro-batch 1, which holds the next slice of micro-batch 0's document."""
    from packloader.contracts import MicroBatch, Segment
    from packloader.runtime.pipeline import _readers
    from packloader.runtime.pipeline_actions import engine_actions

    mbs = [MicroBatch(segments=[Segment(0, 0, 8, 0)]), MicroBatch(segments=[Segment(0, 8, 16, 0)])]
    lists = [[["F", 0, 0], ["F", 1, 0], ["B", 0, 0], ["B", 1, 0]], [["F", 0, 1], ["F", 1, 1], ["B", 1, 1], ["B", 0, 1]]]
    return lambda: engine_actions(lists, 2, 2, readers=_readers(mbs))


def action_list_missing_action(tmp):
    from packloader.runtime.pipeline_actions import engine_actions

    lists = [[["F", 0, 0], ["B", 0, 0], ["F", 1, 0]]]
    return lambda: engine_actions(lists, 2, 1)


def rollouts_sequence_over_cap(tmp):
    from packloader import balance_rollouts

    return lambda: balance_rollouts([100, 9000, 50], 8192, 2)


def rollouts_loss_tokens_over_length(tmp):
    from packloader import balance_rollouts

    return lambda: balance_rollouts([10, 20], 8192, loss_tokens=[5, 25])


def _verl_batch(lengths):
    import torch
    from tensordict import TensorDict

    ids = torch.nested.as_nested_tensor([torch.zeros(n, dtype=torch.long) for n in lengths], layout=torch.jagged)
    return TensorDict({"input_ids": ids}, batch_size=[len(lengths)])


def verl_row_over_max_token_len(tmp):
    from packloader_integrations.verl import rearrange_micro_batches

    return lambda: rearrange_micro_batches(_verl_batch([100, 9000, 50]), 8192)


def verl_group_over_max_token_len(tmp):
    from packloader_integrations.verl import rearrange_micro_batches

    return lambda: rearrange_micro_batches(_verl_batch([100, 9000, 50, 4000]), 9050, force_group_size=2)


def verl_more_micro_batches_than_rows(tmp):
    from packloader_integrations.verl import rearrange_micro_batches

    return lambda: rearrange_micro_batches(_verl_batch([100, 200, 50]), 8192, min_num_micro_batch=5)


def _config(**kw) -> PlanConfig:
    base = dict(strategy="fixed", max_tokens=256, context=256, tokens_per_step=1024)
    base.update(kw)
    return PlanConfig(**base)


@dataclass(frozen=True)
class Case:
    name: str
    build: Callable  # tmp_path -> thunk
    raises: type[BaseException] | None  # None: a documented skip (`skipped`) or, without one, what was read
    fragments: tuple[str, ...]  # substrings of the message (file names, rows, fields, what was expected)
    skipped: tuple[str, int] | None = None  # (reason, count) in source.skipped


def _seeded(seed: int) -> Callable:
    return lambda tmp: corrupt_page_data(tmp, seed)


CASES = [
    *(Case(f"corrupt_parquet_pages_seed{s}", _seeded(s), SourceError,
           ("corrupt.parquet", "row group 0 (rows 0..", "column 'tokens'", "CRC checksum")) for s in (1, 2, 3, 4)),
    Case("truncated_parquet", truncated_parquet, SourceError, ("cut.parquet", "not a readable Parquet file")),
    Case("parquet_wrong_column", parquet_wrong_column, SourceError,
         ("cols.parquet", "no text or token column found among ['body']", "(--column on the command line)")),
    Case("parquet_wrong_type", parquet_wrong_type, SourceError, ("floats.parquet", "column 'text'", "type double")),
    Case("parquet_negative_token", parquet_negative_token, SourceError,
         ("neg.parquet", "row 1", "column 'tokens'", "token id -7 at position 1", "expected an id >= 0")),
    Case("parquet_token_beyond_vocab", parquet_token_beyond_vocab, SourceError,
         ("vocab.parquet", "row 1", "token id 1000 at position 2", "[0, 1000), the vocabulary")),
    Case("parquet_length_mismatch", parquet_length_mismatch, SourceError,
         ("len.parquet", "row 1", "column 'length': says 9 tokens")),
    Case("parquet_length_statistics_mismatch", parquet_length_statistics_mismatch, SourceError,
         ("stats.parquet", "row 0", "statistics say every length is 299", "holds 300 tokens")),
    Case("length_index_corrupt", length_index_corrupt, SourceError,
         ("_idx.parquet.index", "the length index is corrupt")),
    Case("length_index_of_another_shard", length_index_of_another_shard, SourceError,
         ("_idx.parquet.index", "the length index describes another shard", "the shard was rewritten after its index")),
    Case("length_index_lengths_disagree", length_index_lengths_disagree, SourceError,
         ("idx.parquet, row group 0, page at byte", "its ids and rows disagree with the length index")),
    Case("local_indexed_page_corrupt", local_indexed_page_corrupt, SourceError,
         ("idx.parquet: row group 0 (rows 0..", "column 'tokens'", "CRC checksum verification failed for the page")),
    Case("local_length_index_lengths_disagree", local_length_index_lengths_disagree, SourceError,
         ("loc.parquet: row group 0 (rows 0..2), column 'tokens'", "the page at byte 4",
          "its ids and rows disagree with the length index; the index is not this shard's")),
    Case("cache_block_size_changed", cache_block_size_changed, None,
         ("300 documents at 4 KiB blocks, equal to the file's: True",)),
    Case("http_shard_without_version_replaced", http_shard_without_version_replaced, ValueError,
         ("differently configured loader (source.a.jsonl: saved '80 rows, ", "so it is refused")),
    Case("plugin_planner_overfills_a_micro_batch", plugin_planner_overfills_a_micro_batch, CliExit,
         ("exit 2", "planner 'broken_one_micro_batch' (its plan names 'fixed') broke the planner contract at step 0",
          "holds 6700 tokens, more than max_tokens=2048", "The plan is refused rather than trained")),
    Case("plugin_planner_drops_a_piece", plugin_planner_drops_a_piece, CliExit,
         ("exit 2", "planner 'broken_drop_piece' (its plan names 'fixed') broke the planner contract at step 0",
          "tokens of the drawn pieces appear nowhere, e.g. (doc, start, end)")),
    Case("plugin_planner_in_the_loader", plugin_planner_in_the_loader, PlanContractError,
         ("planner 'broken_duplicate_piece' (its plan names 'fixed') broke the planner contract at step 0",
          "tokens appear more than once")),
    Case("trainer_dp_merge_micro_batch", trainer_dp_merge_micro_batch, ValueError,
         ("cannot run DP-Merge micro-batches: step 0, micro-batch 0 is shared by DP ranks [0, 1]",
          "its 900 tokens would train 2 times", "'dp_merge': False")),
    Case("trainer_state_of_a_later_checkpoint", trainer_state_of_a_later_checkpoint, ValueError,
         ("packloader_state-rank0.pt was saved at global step 4 (run r1), but checkpoint ",
          "checkpoint-2 is at global step 2", "belongs to another checkpoint")),
    Case("trainer_state_of_another_run", trainer_state_of_another_run, ValueError,
         ("packloader_state-rank0.pt was saved by run r0 at global step 2, but checkpoint ",
          "checkpoint-2 was saved by run r1", "belongs to another run's checkpoint")),
    Case("config_file_key_twice_json", config_file_key_twice_json, CliExit,
         ("exit 2", "run.json: key 'max_tokens' is given twice in one table (values 2048 and 4096)",
          "the last would silently win")),
    Case("config_file_key_twice_yaml", config_file_key_twice_yaml, CliExit,
         ("exit 2", "run.yaml: key 'max_tokens' is given twice in one mapping (lines 2 and 4)")),
    Case("config_file_two_spellings", config_file_two_spellings, CliExit,
         ("exit 2", "run.json: keys 'max_tokens' and 'max-tokens' name the same option (max_tokens)")),
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
    Case("jsonl_wrong_field", jsonl_wrong_field, SourceError,
         ("field.jsonl", "line 1", "no text or token field", "--column on the command line")),
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
    Case("pattern_matches_nothing", pattern_matches_nothing, CliExit, ("exit 2", "no files match '*.py'")),
    Case("state_from_another_config", state_from_another_config, ValueError,
         ("differently configured loader", "config.context: saved 256, now 512")),
    Case("mid_step_state_at_another_layout", mid_step_state_at_another_layout, ValueError,
         ("saved inside a step", "on DP rank 0 of dp=2", "merge_states([state of rank 0, ..., state of rank 1])")),
    Case("state_from_another_config_not_strict", state_from_another_config_not_strict, ValueError,
         ("differently configured loader", "so it is refused")),
    Case("config_file_unknown_key", config_file_unknown_key, CliExit,
         ("exit 2", "run.json: unknown key 'max_tokenz' for this command; expected one of:", "max_tokens",
          "did you mean 'max_tokens'?")),
    Case("config_file_misspelt_key_no_layout", config_file_misspelt_key_no_layout, CliExit,
         ("exit 2", "tok.toml: unknown key 'tokenizr' for this command; expected one of:", "did you mean 'tokenizer'?")),
    Case("plan_given_a_corpus", plan_given_a_corpus, CliExit,
         ("exit 2", "c.jsonl", "Is it a corpus?", "`packloader tokenize CORPUS --out DIR`")),
    Case("report_out_not_creatable", report_out_not_creatable, CliExit,
         ("exit 2", "--out ", "f.txt/r: cannot create the directory")),
    Case("tokenize_out_already_holds_shards", tokenize_out_already_holds_shards, CliExit,
         ("exit 2", "out already holds token shards (part-00000.parquet, ...)", "(--overwrite on the command line)")),
    Case("model_shape_incomplete", model_shape_incomplete, KeyError,
         ("shape:mine:hidden=4096,layers=32", "missing: heads, kv_heads, head_dim, ffn, vocab, gated_mlp")),
    Case("worker_state_at_another_worker_count", worker_state_at_another_worker_count, ValueError,
         ("DataLoader worker 0 of 1, loaded into worker 1 of 2", "dataloader_state_for(state, num_workers)")),
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
    Case("state_first_drawn_not_pending", state_first_drawn_not_pending, ValueError,
         ("state field loader.step_state.first_drawn[0] = [0, 0]: expected one pair per document",)),
    Case("cli_tokens_per_step_below_max_tokens", cli_tokens_per_step_below_max_tokens, CliExit,
         ("exit 2", "(--tokens-per-step, --max-tokens)", "tokens_per_step=512 is below max_tokens=1024")),
    Case("dynamic_cp_unpriced_schedule", dynamic_cp_unpriced_schedule, ValueError,
         ("the per-document CP planner cannot price schedule 'zb-v'", "it prices ['1f1b', 'gpipe', 'interleaved', 'zb-h1']")),
    Case("cli_zbv_without_two_chunks", cli_zbv_without_two_chunks, CliExit,
         ("exit 2", "(--schedule, --vpp)", "PlanConfig.schedule='zb-v' with parallel.vpp=1: expected vpp=2")),
    Case("cli_planner_option_unknown", cli_planner_option_unknown, CliExit,
         ("exit 2", "(--planner-options)", "planner_options['wlb']", "unknown field `fil`", "expected fields of WLBOptions")),
    Case("cli_plugin_not_importable", cli_plugin_not_importable, CliExit,
         ("exit 2", "--plugin no_such_planners: cannot import it", "that calls register_planner")),
    Case("planner_options_unknown_planner", planner_options_unknown_planner, ValueError,
         ("planner_options names 'slimpak', which is no planner", "expected names from [")),
    Case("device_unknown", device_unknown, CliExit,
         ("exit 2", "invalid configuration (--device): PlanConfig.device='b200': unknown device 'b200'; known devices: h100, h200", "PACKLOADER_DEVICE_PATH")),
    Case("device_file_misnamed", device_file_misnamed, ValueError,
         ("b200.json: its name field is 'h200'; expected the file's name 'b200'",)),
    Case("device_cp_shard_size_missing", device_cp_shard_size_missing, ValueError,
         ("b200.json: cp_shard.fwd has no factor for CP size 4 (it lists [2])", "packloader calibrate --cp-shards")),
    Case("cli_context_beyond_max_tokens_unsliced", cli_context_beyond_max_tokens_unsliced, CliExit,
         ("exit 2", "(--context, --max-tokens, --no-slicing, --strategy)",
          "PlanConfig.context=2048 exceeds max_tokens=1024 with strategy='fixed', which does not slice")),
    Case("cli_cp_mode_dynamic_with_fixed_cp_strategy", cli_cp_mode_dynamic_with_fixed_cp_strategy, CliExit,
         ("exit 2", "(--strategy, --cp-mode)", "PlanConfig.cp_mode='dynamic' plans every step with the dynamic-cp "
          "planner, so strategy='wlb' would never run")),
    Case("lengths_forty_digits", lengths_forty_digits, CliExit,
         ("exit 2", "big.txt, line 2", "is beyond the largest length 9,223,372,036,854,775,807")),
    Case("lengths_uint64_max", lengths_uint64_max, CliExit,
         ("exit 2", "u64.npy: entry 1 is 18,446,744,073,709,551,615, beyond the largest length")),
    Case("stdout_closed", stdout_closed, CliExit, ("exit 141: ",)),
    Case("to_hf_with_slices", to_hf_with_slices, SlicesNotSupported,
         ("PackedBatch.to_hf(): step 5, micro-batch 2 holds a slice of document 7", "allow_slicing=False")),
    Case("dynamic_cp_misaligned_group", dynamic_cp_misaligned_group, ValueError,
         ("segment 1 (document 9, tokens 4..11): CP group starts at GPU 1, not a multiple of its size 2",)),
    Case("dynamic_cp_chain_slice", dynamic_cp_chain_slice, ValueError,
         ("micro-batch 1 of pool GPU 0: segment 1 (document 3, tokens 8192..16383) is a slice on GPUs 0..0, but "
          "token 0 of its document", "the same CPPlacement")),
    Case("dynamic_cp_without_cp_rank", dynamic_cp_without_cp_rank, ValueError,
         ("step 0 is planned with per-document context parallelism (cp_mode 'dynamic', cp=2)",
          "PackedLoader(..., cp_rank=...)")),
    Case("profile_slice_term_negative", profile_slice_term_negative, ValueError,
         ("termed.json: not a cost profile: Expected `float` >= 0.0 - at `$.slice_term.x_fwd`",)),
    Case("profile_lin_floor_negative", profile_lin_floor_negative, CliExit,
         ("exit 2", "floor.json: not a cost profile: Expected `float` >= 0.0 - at `$.lin_fwd[2]`")),
    Case("profile_attention_negative", profile_attention_negative, ValueError,
         ("attn.json: not a cost profile: Expected `float` >= 0.0 - at `$.attn_bwd[0]`",)),
    Case("hf_iterable_iterated_before", hf_iterable_iterated_before, None,
         ("25 rows in 3 blocks, each as the pass read them",)),
    Case("config_file_path_not_a_string", config_file_path_not_a_string, CliExit,
         ("exit 2", "run.json: key 'lengths' (--lengths): expected a string (a path or name, as the flag takes it), "
                    "got int 0")),
    Case("config_file_out_not_a_string", config_file_out_not_a_string, CliExit,
         ("exit 2", "run.yaml: key 'out' (--out): expected a string", "got int 2")),
    Case("config_file_number_is_boolean", config_file_number_is_boolean, CliExit,
         ("exit 2", "run.toml: key 'steps' (--steps): expected a value as --steps takes it, got true")),
    Case("config_file_plugin_string", config_file_plugin_string, CliExit,
         ("exit 2", "--plugin no_such_planners: cannot import it (No module named 'no_such_planners')")),
    Case("config_file_plugin_list", config_file_plugin_list, CliExit,
         ("exit 2", "--plugin no_such_planners: cannot import it")),
    Case("plugin_raises_at_import", plugin_raises_at_import, CliExit,
         ("exit 2", "--plugin broken_planners: importing it raised RuntimeError: no GPU found")),
    Case("plugin_syntax_error", plugin_syntax_error, CliExit,
         ("exit 2", "--plugin typo_planners: importing it raised SyntaxError: ", "(typo_planners.py, line 1)")),
    Case("hf_glob_hub_offline", hf_glob_hub_offline, RemoteError,
         ("hf://datasets/org/name/data/*.parquet: list failed (OfflineModeIsEnabled: ", "HF_HUB_OFFLINE")),
    Case("hf_folder_hub_unreachable", hf_folder_hub_unreachable, RemoteError,
         ("hf://datasets/org/name/data/: list failed after 2 attempts", "HF_ENDPOINT")),
    Case("trainer_state_file_truncated", trainer_state_file_truncated, ValueError,
         ("checkpoint-2/packloader_state-rank0.pt: not a readable packloader loader state (RuntimeError: ",
          "truncated or damaged")),
    Case("trainer_state_file_garbage", trainer_state_file_garbage, ValueError,
         ("checkpoint-2/packloader_state-rank0.pt: not a readable packloader loader state (UnpicklingError: ",)),
    Case("merge_states_of_a_merged_state", merge_states_of_a_merged_state, ValueError,
         ("merge_states: states[0] is a merged state already", "expected the state_dict() of each DP rank")),
    Case("env_cache_bytes_not_a_size", env_cache_bytes_not_a_size, ValueError,
         ("PACKLOADER_CACHE_BYTES='lots': expected a whole number of bytes, or a number with a unit: 1G",)),
    Case("env_cache_dir_without_bytes", env_cache_dir_without_bytes, ValueError,
         ("without PACKLOADER_CACHE_BYTES (or with 0): the cache would hold nothing",)),
    Case("arrow_null_token_id", arrow_null_token_id, SourceError,
         ("row 1, column 'input_ids': a null token id at position 1, expected an id in [0, 2^31)",)),
    Case("hf_dataset_null_token_id", hf_dataset_null_token_id, SourceError,
         ("datasets.Dataset(", "row 1, column 'input_ids': a null token id at position 2")),
    Case("storage_cache_dir_without_bytes", storage_cache_dir_without_bytes, ValueError,
         ("without cache_bytes: the disk cache would hold nothing",)),
    Case("storage_block_size_too_small", storage_block_size_too_small, ValueError,
         ("block_size=1: expected 0 (exact ranges) or a whole number of bytes >= 512",)),
    Case("slice_csv_two_launches", slice_csv_two_launches, ValueError,
         ("slices.csv: expected one launch (launch_segments, launch_tokens) for every row, got [(17, 8193), (33, 16385)]",)),
    Case("action_list_slice_order", action_list_slice_order, ValueError,
         ("action lists: pipeline rank 0, stage 0: backward of micro-batch 0 before that of micro-batch 1, which reads "
          "its keys",)),
    Case("action_list_missing_action", action_list_missing_action, ValueError,
         ("action lists: pipeline rank 0 never runs [['B', 1, 0]]",)),
    Case("tokenize_part_missing", tokenize_part_missing, SourceError,
         ("part 1/3 is missing (2 of 3 parts written); run `packloader tokenize ... --part 1/3`",)),
    Case("megatron_truncated_bin", megatron_truncated_bin, SourceError,
         ("t.bin: 10 bytes, but", "t.idx describes 17 uint16 tokens (34 bytes): truncated")),
    Case("megatron_truncated_while_read", megatron_truncated_while_read, ShardChanged,
         ("cut.bin: the file changed since the source opened it", "size and content hash")),
    Case("megatron_truncated_idx", megatron_truncated_idx, SourceError,
         ("t.idx: not a readable Megatron index (", "truncated")),
    Case("megatron_bad_header", megatron_bad_header, SourceError,
         ("bad.idx: not a readable Megatron index (header b'NOTANIDX!', expected b'MMIDIDX\\x00\\x00')",)),
    Case("arrow_not_readable", arrow_not_readable, SourceError, ("bad.arrow: not a readable Arrow IPC file or stream",)),
    Case("hf_text_beside_tokens", hf_text_beside_tokens, SourceError,
         ("holds text ('text') and tokens ('input_ids'); which to train is not guessed: pass column='input_ids'",)),
    Case("hf_datasetdict_splits", hf_datasetdict_splits, SourceError,
         ("has splits ['train', 'test']; which to train is not guessed: pass one split, e.g. dd['train']",)),
    Case("hf_iterable_not_resumable", hf_iterable_not_resumable, SourceError,
         ("datasets.IterableDataset, rows 10..19: restored through the dataset's state_dict", "does not resume exactly")),
    Case("list_mixes_paths_and_texts", list_mixes_paths_and_texts, SourceError,
         ("the list of 2 strings mixes paths (1, e.g.", "a.jsonl", "and texts (1, e.g. 'a text, not a path')")),
    Case("url_unsupported", url_unsupported, UnsupportedSourceError,
         ("ftp://host/shards/*.parquet: ftp:// URLs are not supported", "supported: local paths")),
    Case("http_url_glob", http_url_glob, UnsupportedSourceError,
         ("http://127.0.0.1:9/shards/*.parquet: HTTP has no listing", "pass each shard's URL")),
    Case("http_server_ignores_range", http_server_ignores_range, RemoteError,
         ("/a.parquet: GET bytes 0..0 failed", "the server ignores Range requests")),
    Case("filesystem_object_unsupported", filesystem_object_unsupported, UnsupportedSourceError,
         ("a filesystem object (pyarrow._fs.LocalFileSystem) is not a source by itself",
          "Storage(filesystem=fs).paths(", "supported: local paths")),
    Case("unknown_object_unsupported", unknown_object_unsupported, UnsupportedSourceError,
         ("builtins.object is not a supported source; supported: local paths",)),
    Case("mixed_tokenizers", mixed_tokenizers, SourceError,
         ("a-bytes.parquet and ", "b-tekken.parquet were tokenized differently", "tokenizer 'bytes'",
          "tokenizer 'tekken'")),
    Case("token_beyond_named_tokenizer", token_beyond_named_tokenizer, SourceError,
         ("ids.parquet, row 1: token id 300 at position 1", "[0, 257), the vocabulary of tokenizer 'bytes'",
          "tokenizer=None")),
    Case("unknown_tokenizer_for_tokens", unknown_tokenizer_for_tokens, ValueError, ("unknown tokenizer 'tekkenn'",)),
    Case("parquet_text_beside_tokens", parquet_text_beside_tokens, SourceError,
         ("both.parquet: holds text ('text') and tokens ('input_ids')", "column='input_ids'", "column='text'")),
    Case("jsonl_text_beside_tokens", jsonl_text_beside_tokens, SourceError,
         ("both.jsonl, line 1: holds text ('text') and tokens ('tokens')", "field='tokens'", "field='text'")),
    Case("shard_listed_twice", shard_listed_twice, SourceError, ("twice.parquet and ", "are the same file")),
    Case("shard_hard_link", shard_hard_link, SourceError, ("a.parquet and ", "b.parquet are the same file")),
    Case("glob_through_symlink_loop", glob_through_symlink_loop, None,
         ("1 shard (x.jsonl), documents ['one', 'two']",)),
    Case("mixture_negative_weight", mixture_negative_weight, ValueError,
         ("mixture entry 'code': weight -0.3, expected a finite number >= 0",)),
    Case("mixture_nan_weight", mixture_nan_weight, ValueError,
         ("mixture entry 'web': weight nan, expected a finite number >= 0",)),
    Case("mixture_all_zero_weights", mixture_all_zero_weights, ValueError,
         ("every weight is 0 (entries ['web', 'code'])", "expected at least one weight > 0")),
    Case("mixture_empty_entry", mixture_empty_entry, ValueError, ("mixture entry 'math': ", "math.jsonl: no documents")),
    Case("mixture_same_file_twice", mixture_same_file_twice, ValueError,
         ("mixture entries 'web' and 'code' both read ", "web.jsonl", "a file belongs to one entry")),
    Case("mixture_tokenizers_differ", mixture_tokenizers_differ, ValueError,
         ("mixture entry 'code' has tokenizer 'bytes', entry 'web' 'tekken'", "expected one tokenizer")),
    Case("shard_through_symlink_alias", shard_through_symlink_alias, SourceError,
         ("d/alias/x.jsonl and ", "d/sub/x.jsonl are the same file", "symlink")),
    Case("shard_replaced_before_resume", shard_replaced_before_resume, ValueError,
         ("differently configured loader", "source.s1.parquet: saved '30 rows, ")),
    Case("shard_renamed_before_resume", shard_renamed_before_resume, ValueError,
         ("differently configured loader", "source.s1.parquet: saved '30 rows, ", "now None",
          "source.s9.parquet: saved None, now '30 rows, ")),
    Case("rank_reads_stale_copy", rank_reads_stale_copy, RuntimeError,
         ("before the first step: ranks disagree on the loader settings", "source.tok-001.parquet: ranks [0] have "
          "'30 rows, ", "ranks [1] have '30 rows, ")),
    Case("shard_deleted_before_resume", shard_deleted_before_resume, ValueError,
         ("differently configured loader", "source.s1.parquet: saved '30 rows, ", "now None")),
    Case("shard_replaced_while_open", shard_replaced_while_open, ShardChanged,
         ("live.parquet: the file changed since the source opened it", "size and content hash")),
    Case("jsonl_truncated_while_read", jsonl_truncated_while_read, ShardChanged,
         ("cut.jsonl: the file changed since the source opened it",)),
    Case("parquet_truncated_while_read", parquet_truncated_while_read, ShardChanged,
         ("cut.parquet: the file changed since the source opened it",)),
    *(Case(*entry) for entry in SFT_CASES),  # the SFT source's (tests/helpers/sft_bad_input.py)

    Case("rollouts_sequence_over_cap", rollouts_sequence_over_cap, ValueError,
         ("balance_rollouts: sequence 1 has 9000 tokens, over max_tokens_per_micro_batch=8192",
          "expected every sequence to fit one micro-batch")),
    Case("rollouts_loss_tokens_over_length", rollouts_loss_tokens_over_length, ValueError,
         ("balance_rollouts: loss_tokens[1]=25 exceeds sequence 1's 20 tokens", "expected 0 <= loss tokens <= length")),
    Case("verl_row_over_max_token_len", verl_row_over_max_token_len, ValueError,
         ("rearrange_micro_batches: row 1 holds 9000 tokens, over max_token_len=8192",)),
    Case("verl_group_over_max_token_len", verl_group_over_max_token_len, ValueError,
         ("rearrange_micro_batches: rows 0..1 (one group) hold 9100 tokens, over max_token_len=9050",
          "expected each group to fit one micro-batch")),
    Case("verl_more_micro_batches_than_rows", verl_more_micro_batches_than_rows, ValueError,
         ("rearrange_micro_batches: 5 micro-batches", "for 3 sequences (groups) on this rank",
          "expected at most one micro-batch per sequence")),
]

CASE_TIMEOUT = 120  # seconds: a case that hangs is killed and fails, naming itself


def _attempt(case: Case, tmp: Path):
    """Run in the child: build the case, run it. Returns ("returned",), ("skipped", count, message), ("read",
    what was read) or ("build failed", traceback); what the thunk raises goes back as the child's exception."""
    try:
        thunk = case.build(tmp)
    except BaseException:  # noqa: BLE001 - a case that cannot be built fails as such, not as its expected error
        return ("build failed", traceback.format_exc())
    if case.raises is None and case.skipped is None:
        return ("read", str(thunk()))
    if case.raises is None:
        src = thunk()
        reason, _ = case.skipped
        return ("skipped", src.skipped[reason], "; ".join(src.skipped.examples) + "; " + src.skipped.summary())
    thunk()
    return ("returned",)


@pytest.mark.multiprocess
@pytest.mark.timeout(CASE_TIMEOUT + 60)
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input(case: Case, tmp_path):
    """Each case in a child forked from this process (a signal or a hang fails that case alone, naming it)."""
    out = run_forked(lambda: _attempt(case, tmp_path), name=case.name, timeout=CASE_TIMEOUT)
    if out.raised:
        assert case.raises is not None, f"a documented skip raised {out.raised[0]}: {out.trace}"
        assert qualified(case.raises) in out.raised, f"expected {case.raises.__name__}, got {out.trace}"
        message = out.message
    else:
        assert out.value[0] != "build failed", out.value[1]
        assert case.raises is None, f"{case.raises.__name__} not raised ({out.value[0]})"
        if case.skipped is None:
            _, message = out.value
        else:
            _, count, message = out.value
            assert count == case.skipped[1], message
    for fragment in case.fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"


def _die_by_sigbus():
    faulthandler.disable()  # pytest's would print every thread's stack: noise for a death on purpose
    os.kill(os.getpid(), signal.SIGBUS)


def _hang():
    time.sleep(60)


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_a_case_that_dies_or_hangs_fails_naming_itself():
    """What the harness does with a case that kills its process (as SIGBUS did) or never ends: fails it by name."""
    with pytest.raises(ChildFailed, match=r"case sigbus: the child died without an answer \(killed by signal 7\)"):
        run_forked(_die_by_sigbus, name="sigbus", timeout=30)
    with pytest.raises(ChildFailed, match=r"case hang: no answer within 1 s \(killed\)"):
        run_forked(_hang, name="hang", timeout=1)
    assert run_forked(lambda: 6 * 7, name="fine", timeout=30).value == 42


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
    names = [c.name for c in CASES if not c.name.startswith("corrupt_parquet_pages_seed")]
    assert sorted(rows) == sorted(names + ["corrupt_parquet_pages"])
    for case in CASES:
        line = rows["corrupt_parquet_pages" if case.name.startswith("corrupt_parquet_pages_seed") else case.name]
        for fragment in case.fragments:
            assert fragment.replace("|", "\\|") in line, (case.name, fragment)
