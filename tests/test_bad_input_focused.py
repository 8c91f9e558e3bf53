"""Issue 35's crashes and misleading errors where one catalogue case is not enough: every coefficient of a cost
profile, an IterableDataset handed over after a pass, config-file values read as the flags read them, sizes
with units, Storage's bounds and null token ids in every list type. The references are hand-worked numbers, the
flags' own output, and the rows as a plain pass over the dataset yields them."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import msgspec
import numpy as np
import pyarrow as pa
import pytest
from helpers.source_resume import check_exact_resume, check_exactly_once, small_config

from packloader.balancers.cost.measured import base_profile
from packloader.balancers.cost.profile_io import load_profile, save_profile
from packloader.balancers.cost.resolve import load_cost_model
from packloader.cli.main import main
from packloader.contracts import Poly
from packloader.loader.loader import PackedLoader
from packloader.sources.errors import SourceError
from packloader.sources.open import open_source
from packloader.sources.storage import Storage, default_storage
from packloader.sources.storage_options import parse_bytes

# --- cost profiles: every coefficient checked when the profile is loaded ------------------------------------------

POLYS = ("attn_fwd", "attn_bwd", "lin_fwd", "lin_bwd")


def _edited(tmp_path: Path, edit) -> Path:
    path = tmp_path / "p.json"
    save_profile(base_profile(), path)
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize("field", [f"{p}[{i}]" for p in POLYS for i in range(3)]
                         + ["lin_table.fwd[0]", "lin_table.bwd[3]", "max_tokens"])
def test_every_coefficient_of_a_profile_file_is_checked_at_load(tmp_path, field):
    """Each coefficient set negative alone is refused naming the file and that coefficient."""
    def edit(data):
        if field == "max_tokens":
            data["max_tokens"] = 0
            return
        name, index = field[:-3], int(field[-2])
        parent, _, key = name.rpartition(".")
        (data[parent] if parent else data)[key][index] = -1e-7

    path = _edited(tmp_path, edit)
    want = "$.max_tokens" if field == "max_tokens" else f"$.{field}"
    with pytest.raises(ValueError, match=rf"{path.name}: not a cost profile: .* - at `{__import__('re').escape(want)}`"):
        load_profile(path)


def test_the_shipped_profile_loads_and_an_in_code_profile_is_held_to_the_same_rules():
    load_cost_model(base_profile())
    bad = msgspec.structs.replace(base_profile(), lin_fwd=Poly(0.0, 1e-6, -1e-4))
    with pytest.raises(ValueError, match=r"cost profile 'h100-llama2-7b-layer': .* at `\$\.lin_fwd\[2\]`"):
        load_cost_model(bad)
    with pytest.raises(ValueError, match="expected finite coefficients"):
        Poly(float("inf"), 0.0, 0.0)


# --- an IterableDataset iterated before it is handed over ---------------------------------------------------------

datasets = pytest.importorskip("datasets")
TEXTS = [f"#{i} " + "word " * (i % 17 + 1) for i in range(45)]


def bytes_tokens(text: str) -> list[int]:
    """The bytes tokenizer by hand: UTF-8 bytes, then EOS 256."""
    return list(text.encode("utf-8")) + [256]


def _rows(n: int):
    yield from ({"text": t} for t in TEXTS[:n])


@pytest.mark.parametrize("kind", ["arrow", "generator"])
@pytest.mark.parametrize("looked", ["whole pass", "first 12 rows"])
def test_an_iterable_dataset_iterated_before_is_read_from_where_a_pass_starts(kind, looked):
    from packloader.sources.hf_iterable import IterableDatasetSource

    if kind == "arrow":
        ids = datasets.Dataset.from_dict({"text": TEXTS}).to_iterable_dataset(num_shards=3)
    else:
        ids = datasets.IterableDataset.from_generator(_rows, gen_kwargs={"n": len(TEXTS)})
    for i, _ in enumerate(ids):
        if looked != "whole pass" and i == 11:
            break
    reference = [x["text"] for x in copy.deepcopy(ids)]  # what a pass over the dataset as handed over yields
    assert reference == TEXTS
    src = IterableDatasetSource(ids, block_rows=10)
    blocks = {k: list(src.read(k, np.arange(s.num_rows))) for k, s in reversed(list(enumerate(src.shards)))}
    assert [x for k in sorted(blocks) for x in blocks[k]] == TEXTS
    lo = PackedLoader(IterableDatasetSource(ids, block_rows=10), config=small_config(), tokenizer="bytes",
                      num_threads=0)
    check_exactly_once(lo, [bytes_tokens(t) for t in TEXTS])
    check_exact_resume(lambda: PackedLoader(IterableDatasetSource(ids, block_rows=10), config=small_config(),
                                            tokenizer="bytes", epochs=2, num_threads=0), stop=5)


def test_an_iterable_dataset_with_a_state_loaded_starts_at_that_state():
    from packloader.sources.hf_iterable import IterableDatasetSource

    ids = datasets.Dataset.from_dict({"text": TEXTS}).to_iterable_dataset()
    for i, _ in enumerate(ids):
        if i == 19:
            state = ids.state_dict()  # after 20 rows
            break
    fresh = datasets.Dataset.from_dict({"text": TEXTS}).to_iterable_dataset()
    fresh.load_state_dict(state)
    src = IterableDatasetSource(fresh, block_rows=10)
    assert [x for k, s in enumerate(src.shards) for x in src.read(k, np.arange(s.num_rows))] == TEXTS[20:]


# --- config files: values read as the flags read them -------------------------------------------------------------


def test_plugin_and_planner_options_in_a_config_file_plan_as_the_flags_do(tmp_path):
    lengths = tmp_path / "l.npy"
    np.save(lengths, np.array([300, 5, 1200, 40, 900, 700, 64, 2000, 10, 333] * 6))
    flags = ["--strategy", "round_robin_test", "--max-tokens", "2048", "--tokens-per-step", "8192", "--quiet"]
    assert main(["plan", "--lengths", str(lengths), "--plugin", "plugins.round_robin", "--planner-options",
                 '{"round_robin_test": {"per_micro_batch": 2}}', "--out", str(tmp_path / "flags.jsonl"), *flags]) == 0
    (tmp_path / "c.yaml").write_text(f"lengths: {lengths}\nplugin: plugins.round_robin\n"
                                     "planner_options:\n  round_robin_test:\n    per_micro_batch: 2\n")
    assert main(["plan", "--config", str(tmp_path / "c.yaml"), "--out", str(tmp_path / "file.jsonl"), *flags]) == 0
    first = (tmp_path / "flags.jsonl").read_bytes()
    assert first and first == (tmp_path / "file.jsonl").read_bytes()
    # and per_micro_batch reached the planner: no micro-batch holds more than 2 pieces
    assert max(len(mb) for line in first.splitlines() for rank in json.loads(line)["ranks"] for mb in rank) == 2


@pytest.mark.parametrize("text, key", [('{"out": 2}', "out"), ('{"column": ["length"]}', "column"),
                                       ('{"strategy": 3}', "strategy"), ('{"plugin": [1]}', "plugin")])
def test_string_options_refuse_other_types(tmp_path, capsys, text, key):
    (tmp_path / "c.json").write_text(text)
    assert main(["plan", "--lengths", "x.npy", "--config", str(tmp_path / "c.json")]) == 2
    err = capsys.readouterr().err
    assert f"c.json: key '{key}'" in err and "expected" in err


# --- sizes with units, Storage's bounds ---------------------------------------------------------------------------


@pytest.mark.parametrize("text, value", [("0", 0), ("4096", 4096), ("1G", 10**9), ("1GB", 10**9), ("1Gi", 1 << 30),
                                         ("512Mi", 512 * 2**20), ("64KiB", 65536), ("64k", 64000),
                                         ("2.5G", 2_500_000_000), (" 3 Ti ", 3 << 40), ("1.5Ki", 1536)])
def test_sizes_are_read_with_units(text, value):
    assert parse_bytes(text, "X") == value


@pytest.mark.parametrize("text", ["lots", "1e9", "-1", "1.3", "1GiG", "", "G"])
def test_sizes_that_are_not_sizes_name_the_variable(text):
    with pytest.raises(ValueError, match=r"X='.*': expected a whole number of bytes|X='.*' is .* bytes, not a whole"):
        parse_bytes(text, "X")


def test_the_cache_bound_from_the_environment_takes_units(tmp_path, monkeypatch):
    from packloader.sources import storage as storage_mod

    monkeypatch.setattr(storage_mod, "_DEFAULT", {})
    monkeypatch.setenv("PACKLOADER_CACHE_DIR", str(tmp_path / "c"))
    monkeypatch.setenv("PACKLOADER_CACHE_BYTES", "2Gi")
    assert default_storage().cache.max_bytes == 2 * 2**30
    monkeypatch.setattr(storage_mod, "_DEFAULT", {})
    monkeypatch.delenv("PACKLOADER_CACHE_DIR")
    with pytest.raises(ValueError, match="PACKLOADER_CACHE_BYTES='2Gi' without PACKLOADER_CACHE_DIR"):
        default_storage()


def test_block_sizes_that_cannot_work_are_refused(tmp_path):
    for ok in (0, 512, np.int64(8192), 4 << 20):
        assert Storage(block_size=ok).block_size == int(ok)
    for bad in (1, 511, -1, True, 1.5, "4M"):
        with pytest.raises(ValueError, match=r"block_size=.*: expected 0 \(exact ranges\) or a whole number"):
            Storage(block_size=bad)
    with pytest.raises(ValueError, match="without cache_dir"):
        Storage(cache_bytes=1 << 20)
    with pytest.raises(ValueError, match="is below block_size=4,194,304"):
        Storage(cache_dir=str(tmp_path), cache_bytes=1 << 20)
    assert Storage(cache_dir=str(tmp_path), cache_bytes=4 << 20).cache.max_bytes == 4 << 20


# --- null token ids in every list type of the Arrow reader --------------------------------------------------------


@pytest.mark.parametrize("list_type", [pa.list_(pa.int32()), pa.large_list(pa.int64()), pa.list_(pa.int64(), 3)])
def test_a_null_token_id_is_named_and_rows_around_it_read_exactly(list_type):
    rows = [[1, 2, 3], [4, 5, 6], [7, None, 9], [10, 11, 12]]
    table = pa.Table.from_batches([pa.record_batch({"input_ids": pa.array(rows[:2], list_type)}),
                                   pa.record_batch({"input_ids": pa.array(rows[2:], list_type)})])
    src = open_source(table)
    assert [d.tolist() for d in src.read(0, np.array([3, 0, 1]))] == [rows[3], rows[0], rows[1]]
    with pytest.raises(SourceError, match=r"row 2, column 'input_ids': a null token id at position 1"):
        list(src.read(0, np.array([3, 2])))


def test_an_attention_backend_from_the_environment_names_the_variable(monkeypatch):
    from packloader.runtime import attention as A

    monkeypatch.setenv(A.ENV_BACKEND, "flahs")
    with pytest.raises(A.BackendUnavailable, match=r"PACKLOADER_ATTN_BACKEND='flahs': unknown attention backend"):
        A.select_backend("cpu")
    with pytest.raises(A.BackendUnavailable, match=r"^unknown attention backend 'flahs'"):
        A.select_backend("cpu", "flahs")  # passed in code: no variable to name


def test_storage_directories_must_be_paths(tmp_path):
    for kw in ({"cache_dir": 5, "cache_bytes": 1 << 30}, {"index_dir": 0}):
        with pytest.raises(ValueError, match=r"Storage\((cache|index)_dir=\d\): expected a directory path"):
            Storage(**kw)
    assert Storage(cache_dir=tmp_path, cache_bytes=1 << 30, index_dir=tmp_path).cache is not None


def test_a_null_token_id_in_python_lists_and_iterable_datasets_is_named():
    from packloader.sources.hf_iterable import IterableDatasetSource

    with pytest.raises(SourceError, match=r"row 1: a null token id at position 2, expected an id in \[0, 2\^31\)"):
        open_source([[1, 2], [3, 4, None, 5]])
    ids = datasets.IterableDataset.from_generator(_token_rows)
    with pytest.raises(SourceError, match=r"row 1, column 'input_ids': a null token id at position 0"):
        IterableDatasetSource(ids, block_rows=4)


def _token_rows():
    yield {"input_ids": [1, 2, 3]}
    yield {"input_ids": [None, 7]}
