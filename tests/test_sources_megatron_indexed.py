"""Megatron `.bin`/`.idx` pairs written by megatron-core's own IndexedDatasetBuilder, read by packloader's reader."""

from __future__ import annotations

import os

import numpy as np
import pytest
from helpers.source_resume import check_exact_resume, check_exactly_once, small_config

from packloader.loader.loader import PackedLoader
from packloader.sources.errors import EmptyDocumentError, SourceError
from packloader.sources.megatron_indexed import MegatronIndexedSource
from packloader.sources.open import open_source

torch = pytest.importorskip("torch")
indexed = pytest.importorskip("megatron.core.datasets.indexed_dataset")


def docs_of(n: int, seed: int, vocab: int = 50_000) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=int(rng.integers(1, 400))).astype(np.int64) for _ in range(n)]


def write_pair(prefix, docs, dtype=np.uint16, split_sequences=False) -> str:
    """Write `docs` with megatron-core's builder; with split_sequences each document is two sequences."""
    builder = indexed.IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for d in docs:
        lengths = [len(d) // 2, len(d) - len(d) // 2] if split_sequences and len(d) > 1 else [len(d)]
        builder.add_document(torch.from_numpy(d), lengths)
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


def read_all(src) -> list[np.ndarray]:
    return [d for k, s in enumerate(src.shards) for d in src.read(k, np.arange(s.num_rows))]


@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.int64])
@pytest.mark.parametrize("split_sequences", [False, True])
def test_tokens_and_document_order_equal_what_megatron_core_wrote(tmp_path, dtype, split_sequences):
    docs = docs_of(40, seed=1)
    prefix = write_pair(tmp_path / "corpus_text_document", docs, dtype, split_sequences)
    src = MegatronIndexedSource(prefix)
    assert src.pretokenized and [s.num_rows for s in src.shards] == [40]
    got = read_all(src)
    assert all(g.dtype == np.int32 for g in got)
    assert [g.tolist() for g in got] == [d.tolist() for d in docs]
    assert src.lengths(0).tolist() == [len(d) for d in docs]
    # megatron-core's own reader sees the same documents (a second, independent parse of the same files)
    mds = indexed.IndexedDataset(prefix)
    assert len(mds.document_indices) - 1 == len(docs)


def test_rows_in_any_order_are_the_documents_written(tmp_path):
    """Rows asked in runs adjacent in the file and apart, backwards and twice (the reader reads each run of
    adjacent documents at once): each is the document the builder was given."""
    docs = docs_of(40, seed=3)
    src = MegatronIndexedSource(write_pair(tmp_path / "c", docs))
    rows = np.array([5, 6, 7, 2, 3, 30, 0, 39, 1, 1, 38, 37, 8])
    assert [g.tolist() for g in src.read(0, rows)] == [docs[r].tolist() for r in rows]


def test_pairs_are_shards_in_the_order_given_and_open_source_finds_them(tmp_path):
    a, b = docs_of(10, 2), docs_of(7, 3)
    pa_, pb = write_pair(tmp_path / "a", a), write_pair(tmp_path / "b", b, np.int32)
    for spec in ([pa_, pb], [pa_ + ".bin", pb + ".idx"], str(tmp_path / "*.idx")):
        src = open_source(spec)
        assert isinstance(src, MegatronIndexedSource)
        assert [g.tolist() for g in read_all(src)] == [d.tolist() for d in a + b]
    assert isinstance(open_source(pa_, format="megatron"), MegatronIndexedSource)


def test_packed_loader_trains_every_token_once_and_resumes_exactly(tmp_path):
    docs = docs_of(60, seed=4, vocab=1000)
    prefix = write_pair(tmp_path / "c", docs)
    loader = PackedLoader(prefix, config=small_config(), num_threads=0, tokenizer=None)
    assert loader.lengths_mode == "column"  # lengths come from the index, no tokens read to plan
    check_exactly_once(loader, docs)
    for threads in (0, 2):
        check_exact_resume(lambda: PackedLoader(prefix, config=small_config(), num_threads=threads, epochs=2,
                                                tokenizer=None), stop=7)


def test_a_bin_replaced_before_resume_with_as_many_tokens_is_refused_naming_it(tmp_path):
    """Same name, same index, same size: only the tokens differ. The state knows the pair by its content."""
    docs = docs_of(30, seed=5, vocab=1000)
    prefix = write_pair(tmp_path / "c", docs)
    loader = PackedLoader(prefix, config=small_config(), num_threads=0, tokenizer=None)
    next(iter(loader))
    state = loader.state_dict()
    other = [(d + 1) % 1000 for d in docs]
    write_pair(tmp_path / "new", other)
    os.replace(tmp_path / "new.bin", prefix + ".bin")
    assert os.path.getsize(prefix + ".bin") == sum(map(len, docs)) * 2
    fresh = PackedLoader(prefix, config=small_config(), num_threads=0, tokenizer=None)
    with pytest.raises(ValueError, match=r"differently configured loader \(source\.c\.bin: saved '30 rows, "):
        fresh.load_state_dict(state)


def test_a_truncated_bin_is_an_error_naming_it(tmp_path):
    prefix = write_pair(tmp_path / "t", docs_of(5, 5))
    data = (tmp_path / "t.bin").read_bytes()
    (tmp_path / "t.bin").write_bytes(data[: len(data) // 2])
    with pytest.raises(SourceError, match=r"t\.bin: \d+ bytes, but .*t\.idx describes \d+ uint16 tokens .*truncated"):
        MegatronIndexedSource(prefix)


@pytest.mark.parametrize("cut", [10, 40, -3])
def test_a_truncated_idx_is_an_error_naming_it(tmp_path, cut):
    prefix = write_pair(tmp_path / "t", docs_of(5, 6))
    data = (tmp_path / "t.idx").read_bytes()
    (tmp_path / "t.idx").write_bytes(data[:cut])
    with pytest.raises(SourceError, match=r"t\.idx: not a readable Megatron index \(.*(truncated|shorter)"):
        MegatronIndexedSource(prefix)


def test_a_corrupt_idx_is_an_error_naming_it(tmp_path):
    prefix = write_pair(tmp_path / "t", docs_of(5, 7))
    idx = bytearray((tmp_path / "t.idx").read_bytes())
    (tmp_path / "bad_magic.idx").write_bytes(b"XXXXXXXXX" + idx[9:])
    (tmp_path / "bad_magic.bin").write_bytes((tmp_path / "t.bin").read_bytes())
    with pytest.raises(SourceError, match=r"bad_magic\.idx: not a readable Megatron index \(header"):
        MegatronIndexedSource(str(tmp_path / "bad_magic"))
    s = int.from_bytes(idx[18:26], "little")
    off = 34 + 4 * s + 8  # the second sequence's byte offset
    idx[off : off + 8] = (12345).to_bytes(8, "little")
    (tmp_path / "t.idx").write_bytes(bytes(idx))
    with pytest.raises(SourceError, match=r"t\.idx: .*sequence 1 starts at byte 12345"):
        MegatronIndexedSource(prefix)


def test_a_missing_half_of_the_pair_is_named(tmp_path):
    prefix = write_pair(tmp_path / "m", docs_of(3, 8))
    (tmp_path / "m.bin").unlink()
    with pytest.raises(FileNotFoundError, match=r"m\.bin"):
        MegatronIndexedSource(prefix)


def test_empty_documents_are_an_error_or_skipped_and_counted(tmp_path):
    docs = [np.arange(5), np.zeros(0, dtype=np.int64), np.arange(3)]
    prefix = write_pair(tmp_path / "e", docs)
    with pytest.raises(EmptyDocumentError, match=r"e\.bin, document 1: empty document"):
        list(MegatronIndexedSource(prefix).read(0, np.arange(3)))
    src = MegatronIndexedSource(prefix, empty="skip")
    assert [d.tolist() for d in read_all(src)] == [[0, 1, 2, 3, 4], [0, 1, 2]]
    assert src.skipped["empty documents"] == 1


def _rank_segments(rank, world, prefix):
    from packloader.contracts import ParallelConfig, PlanConfig

    cfg = PlanConfig(strategy="fixed", max_tokens=256, context=256, tokens_per_step=500 * world,
                     parallel=ParallelConfig(dp=world))
    loader = PackedLoader(prefix, tokenizer=None, config=cfg, num_threads=1, timeout=60)
    assert loader.dp_rank == rank and loader.lengths_mode == "column"
    out = [[(s.doc, s.start, s.end) for s in b.segments] for b in loader]
    loader.close()
    return out


@pytest.mark.multiprocess
def test_gloo_ranks_cover_every_token_once(tmp_path):
    from helpers.distributed import run_ranks

    from packloader.sources.stream import DocumentStream
    from tests.helpers.ledger import TokenLedger

    docs = docs_of(80, seed=9, vocab=1000)
    prefix = write_pair(tmp_path / "g", docs)
    per_rank = run_ranks(_rank_segments, 2, prefix)
    assert all(per_rank)
    stream = DocumentStream(MegatronIndexedSource(prefix), tokenizer=None, seed=0)
    ledger = TokenLedger(stream)
    for segs in (s for rank in per_rank for s in rank):
        ledger.add([{"segments": [tuple(x) for x in segs]}])
    assert ledger.check_epoch(0) == sum(len(d) for d in docs)


def test_a_negative_token_id_is_an_error_naming_the_document(tmp_path):
    prefix = write_pair(tmp_path / "n", [np.arange(4), np.array([3, -7, 2])], dtype=np.int32)
    src = MegatronIndexedSource(prefix)
    assert next(src.read(0, np.array([0]))).tolist() == [0, 1, 2, 3]
    with pytest.raises(SourceError, match=r"n\.bin, document 1: token id -7 at position 1, expected an id in \[0, 2\^31\)"):
        list(src.read(0, np.array([1])))


def test_the_index_parses_from_bytes_as_well_as_a_file(tmp_path):
    """The seam for other storage: parse_index takes any buffer; errors name the name given."""
    from packloader.sources.megatron_indexed import parse_index

    docs = docs_of(6, 10)
    prefix = write_pair(tmp_path / "b", docs)
    index = parse_index((tmp_path / "b.idx").read_bytes(), "mem://b.idx")
    assert index.lengths.tolist() == [len(d) for d in docs] and index.dtype == np.uint16
    with pytest.raises(SourceError, match=r"mem://b\.idx: not a readable Megatron index"):
        parse_index((tmp_path / "b.idx").read_bytes()[:-1], "mem://b.idx")
    assert prefix
