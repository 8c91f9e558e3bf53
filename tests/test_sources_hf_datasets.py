"""Hugging Face datasets (Dataset, DatasetDict splits, save_to_disk folders, Arrow files, IterableDataset), Python
lists and generators, and unsupported sources, as PackedLoader sources: exactly once and exact resume."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from helpers.source_resume import check_exact_resume, check_exactly_once, small_config

from packloader.loader.loader import PackedLoader
from packloader.sources.arrow_table import ArrowTableSource
from packloader.sources.dispatch import open_any
from packloader.sources.errors import EmptyDocumentError, SourceError
from packloader.sources.hf_datasets import dataset_source
from packloader.sources.hf_iterable import IterableDatasetSource
from packloader.sources.open import open_source
from packloader.sources.unsupported import UnsupportedSourceError

datasets = pytest.importorskip("datasets")


def texts_of(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    words = ["alpha", "beta", "gamma", "délta", "ε", "zeta", "long-word-here"]
    return [f"#{i} " + " ".join(rng.choice(words, size=int(rng.integers(1, 120)))) for i in range(n)]


def token_docs(n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 1000, size=int(rng.integers(1, 300))).tolist() for _ in range(n)]


def bytes_tokens(text: str) -> list[int]:
    """The bytes tokenizer by hand: UTF-8 bytes, then EOS 256."""
    return list(text.encode("utf-8")) + [256]


def read_all(src) -> list:
    return [d if isinstance(d, str) else d.tolist() for k, s in enumerate(src.shards)
            for d in src.read(k, np.arange(s.num_rows))]


def loader(source, **kw) -> PackedLoader:
    kw.setdefault("tokenizer", "bytes")
    return PackedLoader(source, config=small_config(), num_threads=kw.pop("threads", 0), **kw)


# --- Dataset, DatasetDict, save_to_disk, Arrow files -------------------------------------------------------------

def test_a_dataset_of_text_is_tokenized_every_token_once_and_resumes_exactly():
    texts = texts_of(50)
    ds = datasets.Dataset.from_dict({"text": texts, "id": list(range(50))})
    check_exactly_once(loader(ds), [bytes_tokens(t) for t in texts])
    check_exact_resume(lambda: loader(ds, epochs=2, threads=2), stop=9)


def test_a_dataset_of_input_ids_is_used_as_stored_with_lengths_from_the_column():
    docs = token_docs(60, seed=1)
    ds = datasets.Dataset.from_dict({"input_ids": docs, "attention_mask": [[1] * len(d) for d in docs]})
    lo = loader(ds, tokenizer=None)
    assert lo.lengths_mode == "column"
    check_exactly_once(lo, docs)
    check_exact_resume(lambda: loader(ds, tokenizer=None, epochs=2), stop=11)


def test_text_beside_tokens_asks_which_column():
    ds = datasets.Dataset.from_dict({"text": ["ab", "cd"], "input_ids": [[1, 2], [3]]})
    with pytest.raises(SourceError, match=r"holds text \('text'\) and tokens \('input_ids'\); .*pass column='input_ids'"):
        loader(ds)
    assert read_all(open_any(ds, column="input_ids")) == [[1, 2], [3]]
    assert read_all(open_any(ds, column="text")) == ["ab", "cd"]


def test_a_shuffled_or_selected_dataset_reads_the_rows_it_shows():
    ds = datasets.Dataset.from_dict({"tokens": token_docs(30, seed=2)}).shuffle(seed=3).select(range(5, 25))
    assert read_all(open_any(ds)) == [ds[i]["tokens"] for i in range(len(ds))]
    assert open_any(ds).lengths(0).tolist() == [len(ds[i]["tokens"]) for i in range(len(ds))]


def test_a_datasetdict_split_and_the_choice_of_split():
    texts = texts_of(20, seed=4)
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": texts}),
                               "test": datasets.Dataset.from_dict({"text": ["x"]})})
    assert read_all(open_any(dd["train"])) == texts
    with pytest.raises(SourceError, match=r"has splits \['train', 'test'\]; .*dd\['train'\]"):
        open_any(dd)
    assert read_all(open_any(datasets.DatasetDict({"train": dd["train"]}))) == texts


def test_a_save_to_disk_folder_is_a_dataset_not_jsonl(tmp_path):
    texts = texts_of(40, seed=5)
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(tmp_path / "saved"))
    src = open_source(str(tmp_path / "saved"))
    assert read_all(src) == texts and src.shards[0].name == str(tmp_path / "saved")
    check_exactly_once(loader(str(tmp_path / "saved")), [bytes_tokens(t) for t in texts])
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": texts}),
                               "validation": datasets.Dataset.from_dict({"text": ["v"]})})
    dd.save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(SourceError, match=r"dd has splits \['train', 'validation'\]"):
        open_source(str(tmp_path / "dd"))
    assert read_all(open_source(str(tmp_path / "dd" / "train"))) == texts


def test_arrow_files_in_stream_and_file_format(tmp_path):
    docs = token_docs(25, seed=6)
    ds = datasets.Dataset.from_dict({"input_ids": docs})
    ds.save_to_disk(str(tmp_path / "s"))
    stream_file = next((tmp_path / "s").glob("*.arrow"))  # datasets writes the IPC stream format
    table = pa.table({"input_ids": pa.array(docs, type=pa.list_(pa.int32())), "n": [len(d) for d in docs]})
    with pa.ipc.new_file(str(tmp_path / "f.arrow"), table.schema) as w:
        w.write_table(table)
    assert read_all(open_source(str(stream_file))) == docs
    assert read_all(open_source(str(tmp_path / "f.arrow"))) == docs
    both = open_source([str(stream_file), str(tmp_path / "f.arrow")], column=None)
    assert [s.num_rows for s in both.shards] == [25, 25]
    check_exact_resume(lambda: loader([str(stream_file), str(tmp_path / "f.arrow")], tokenizer=None), stop=5)
    (tmp_path / "bad.arrow").write_bytes(b"not arrow at all" * 10)
    with pytest.raises(SourceError, match=r"bad\.arrow: not a readable Arrow IPC file or stream"):
        open_source(str(tmp_path / "bad.arrow"))


def test_null_and_empty_rows_are_named_or_skipped_and_counted():
    ds = datasets.Dataset.from_dict({"text": ["a", None, "c"]})
    with pytest.raises(SourceError, match=r"row 1, column 'text': null, expected text"):
        list(open_any(ds).read(0, np.arange(3)))
    ds = datasets.Dataset.from_dict({"input_ids": [[1], [], [2, 3]]})
    with pytest.raises(EmptyDocumentError, match=r"row 1, column 'input_ids': empty document \(no tokens\)"):
        list(open_any(ds).read(0, np.arange(3)))
    src = dataset_source(ds, empty="skip")
    assert read_all(src) == [[1], [2, 3]] and src.skipped["empty documents"] == 1


# --- IterableDataset -----------------------------------------------------------------------------------------------

def text_rows(n, seed):
    """A module-level generator, so the IterableDataset built on it pickles."""
    for t in texts_of(n, seed):
        yield {"text": t}


def _generated(n, seed):
    return datasets.IterableDataset.from_generator(text_rows, gen_kwargs={"n": n, "seed": seed})


@pytest.mark.parametrize("kind", ["arrow", "generator"])
def test_an_iterable_dataset_is_read_through_its_state_dict_once_and_resumes_exactly(kind):
    texts = texts_of(70, seed=7)
    if kind == "arrow":
        ids = datasets.Dataset.from_dict({"text": texts}).to_iterable_dataset(num_shards=3)
    else:
        ids = _generated(70, 7)
    src = IterableDatasetSource(ids, block_rows=16)
    assert [s.num_rows for s in src.shards] == [16, 16, 16, 16, 6]
    assert read_all(src) == texts
    # blocks read out of order, each restored through the dataset's own state_dict
    assert list(src.read(3, np.array([5, 0]))) == [texts[53], texts[48]]
    check_exactly_once(loader(src), [bytes_tokens(t) for t in texts])
    check_exact_resume(lambda: loader(IterableDatasetSource(ids, block_rows=16), epochs=2, threads=2), stop=10)


def test_an_iterable_dataset_of_tokens_plans_from_recorded_lengths():
    docs = token_docs(40, seed=8)
    ids = datasets.Dataset.from_dict({"input_ids": docs}).to_iterable_dataset()
    lo = loader(ids, tokenizer=None)
    assert lo.lengths_mode == "column"
    check_exactly_once(lo, docs)


def test_an_iterable_dataset_that_does_not_resume_exactly_is_refused():
    ids = datasets.Dataset.from_dict({"text": texts_of(40, seed=9)}).to_iterable_dataset()
    src = IterableDatasetSource(ids.shuffle(seed=1, buffer_size=8), block_rows=10)
    with pytest.raises(SourceError, match=r"rows 10\.\.19: restored through the dataset's state_dict, .* does not "
                                          r"resume exactly"):
        list(src.read(1, np.arange(10)))


# --- Python lists and generators -----------------------------------------------------------------------------------

def test_a_list_of_texts_is_texts_and_never_paths():
    texts = ["hello world", "a second document", "ünïcödé text"]
    assert read_all(open_any(texts)) == texts
    check_exactly_once(loader(texts), [bytes_tokens(t) for t in texts])


def test_a_list_of_paths_is_paths_and_a_mix_is_refused(tmp_path):
    for i in range(2):
        (tmp_path / f"{i}.jsonl").write_text('{"text": "doc %d"}\n' % i)
    paths = [str(tmp_path / "0.jsonl"), str(tmp_path / "1.jsonl")]
    assert read_all(open_any(paths)) == ["doc 0", "doc 1"]
    with pytest.raises(FileNotFoundError, match=r"missing\.jsonl"):
        open_any([paths[0], str(tmp_path / "missing.jsonl")])
    with pytest.raises(SourceError, match=r"mixes paths \(1, e\.g\. .*0\.jsonl'\) and texts \(1, e\.g\. 'a document "
                                          r"with a long first line x{20,30}\.\.\.\)"):
        open_any([paths[0], "a document with a long first line " + "x" * 500])


def test_lists_of_dicts_token_arrays_and_generators():
    rows = [{"text": t, "meta": i} for i, t in enumerate(texts_of(12, seed=10))]
    assert read_all(open_any(rows)) == [r["text"] for r in rows]
    assert read_all(open_any(iter(rows))) == [r["text"] for r in rows]
    docs = token_docs(9, seed=11)
    assert read_all(open_any([np.asarray(d) for d in docs])) == docs
    assert read_all(open_any(d for d in docs)) == docs
    with pytest.raises(SourceError, match=r"holds text \('text'\) and tokens \('tokens'\)"):
        open_any([{"text": "a", "tokens": [1]}])
    with pytest.raises(SourceError, match=r"row 1, column 'text': null"):
        list(open_any([{"text": "a"}, {"body": "b"}]).read(0, np.arange(2)))
    with pytest.raises(SourceError, match=r"row 1: dict .*expected texts like row 0"):
        open_any(["a text", {"text": "b"}])


# --- unsupported ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("url", ["ftp://host/shards/*.parquet", "sftp://host/a.parquet",  # https, hf: read
                                 "oci://bucket/a.parquet", "webhdfs://host/a.parquet"])
def test_urls_are_unsupported_and_the_error_lists_what_is(url):
    for call in (lambda: open_source(url), lambda: loader(url), lambda: open_any([url])):
        with pytest.raises(UnsupportedSourceError, match=r"URLs are not supported .*supported: local paths"):
            call()


def test_filesystem_objects_and_unknown_objects_are_unsupported():
    import pyarrow.fs

    with pytest.raises(UnsupportedSourceError, match=r"a filesystem object \(pyarrow\._fs\.LocalFileSystem\) is not "
                                                     r"a source by itself .*Storage\(filesystem=fs\).*supported: local"):
        loader(pyarrow.fs.LocalFileSystem())
    with pytest.raises(UnsupportedSourceError, match=r"builtins\.object is not a supported source; supported:"):
        loader(object())
    with pytest.raises(TypeError):  # still a TypeError, as before
        loader({"text": "a dict is not a source"})
    assert isinstance(open_any(pa.table({"text": ["a", "b"]})), ArrowTableSource)


def test_sources_survive_pickling_for_spawned_workers(tmp_path):
    import pickle

    texts = texts_of(30, seed=12)
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(tmp_path / "p"))
    saved = open_source(str(tmp_path / "p"))
    ids = IterableDatasetSource(_generated(30, 12), block_rows=8)
    for src in (saved, open_any(datasets.Dataset.from_dict({"text": texts}).shuffle(seed=1)), ids):
        assert read_all(pickle.loads(pickle.dumps(src))) == read_all(src)
    assert len(pickle.dumps(saved)) < 4096  # the memory-mapped Dataset travels by its files' paths


@pytest.mark.multiprocess
def test_spawned_dataloader_workers_read_a_saved_dataset_every_token_once(tmp_path):
    from torch.utils.data import DataLoader

    from packloader.loader.dataset import PackedDataset
    from tests.helpers.ledger import TokenLedger

    texts = texts_of(90, seed=13)
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(tmp_path / "w"))
    ds = PackedDataset(str(tmp_path / "w"), tokenizer="bytes", config=small_config(900))
    steps = list(DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="spawn"))
    ledger = TokenLedger(ds._p.stream)
    for mbs in steps:
        ledger.add(mbs)
    assert ledger.check_epoch(0) == sum(len(bytes_tokens(t)) for t in texts)


def test_open_source_takes_the_same_objects_as_the_loader(tmp_path):
    texts = texts_of(6, seed=14)
    assert read_all(open_source(datasets.Dataset.from_dict({"text": texts}))) == texts
    assert read_all(open_source(texts)) == texts
    (tmp_path / "a.jsonl").write_text('{"text": "from a file"}\n')
    assert read_all(open_source(p for p in [tmp_path / "a.jsonl"])) == ["from a file"]  # a generator of paths
    with pytest.raises(ValueError, match="at least one path"):
        open_source([])


def test_a_mistyped_path_is_never_trained_as_text(tmp_path):
    for typo in (["corpus"], [str(tmp_path / "missing")], ["shards-*.parquet"], ["ftp://b/x.parquet"]):
        with pytest.raises((FileNotFoundError, UnsupportedSourceError)):
            open_any(typo)
    assert read_all(open_any([{"text": "one-word"}])) == ["one-word"]  # one-word texts go as dicts


def _rank_segments(rank, world, n, seed):
    from packloader.contracts import ParallelConfig, PlanConfig

    cfg = PlanConfig(strategy="fixed", max_tokens=256, context=256, tokens_per_step=500 * world,
                     parallel=ParallelConfig(dp=world))
    ds = datasets.Dataset.from_dict({"text": texts_of(n, seed)})  # built in each rank: the ranks must agree on it
    loader = PackedLoader(ds, tokenizer="bytes", config=cfg, lengths="gather", num_threads=1, timeout=60)
    assert loader.dp_rank == rank and loader.lengths_mode == "gather"
    out = [[(s.doc, s.start, s.end) for s in b.segments] for b in loader]
    loader.close()
    return out


@pytest.mark.multiprocess
def test_gloo_ranks_share_tokenizing_a_dataset_and_cover_every_token_once():
    from helpers.distributed import run_ranks

    from packloader.sources.stream import DocumentStream
    from tests.helpers.ledger import TokenLedger

    texts = texts_of(60, 15)
    per_rank = run_ranks(_rank_segments, 2, 60, 15)
    assert all(per_rank)
    stream = DocumentStream(open_any(datasets.Dataset.from_dict({"text": texts})), tokenizer="bytes", seed=0)
    ledger = TokenLedger(stream)
    for segs in (s for rank in per_rank for s in rank):
        ledger.add([{"segments": [tuple(x) for x in segs]}])
    assert ledger.check_epoch(0) == sum(len(bytes_tokens(t)) for t in texts)


def test_the_arrow_reader_takes_a_file_object_as_well_as_a_path():
    """The seam for other storage: an Arrow stream read from a file object, errors naming the name given."""
    import io

    from packloader.sources.arrow_table import read_arrow_file

    table = pa.table({"tokens": pa.array([[1, 2], [3]], pa.list_(pa.int32()))})
    sink = io.BytesIO()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    assert read_arrow_file("mem://t.arrow", io.BytesIO(sink.getvalue())).equals(table)
    with pytest.raises(SourceError, match=r"mem://x\.arrow: not a readable Arrow IPC"):
        read_arrow_file("mem://x.arrow", io.BytesIO(b"garbage" * 20))
