"""`tokenize --part i/N` and `tokenize --ray`: the parts' files, read as one directory, hold the same tokens in the
same order, with the same lengths from their length indexes, as one machine's tokenize of the same input; a split
that is not one whole is refused, naming the part."""

from __future__ import annotations

import json
import random
import shutil

import numpy as np
import pytest

from packloader.cli.main import main
from packloader.sources.errors import SourceError
from packloader.sources.open import open_source
from packloader.sources.pretokenize import tokenize_to_parquet
from packloader.sources.tokenize_input import open_input
from packloader.sources.tokenize_parts import tokenize_part
from packloader.sources.tokenizers import get_tokenizer

WORDS = ["alpha", "beta", "gamma", "delta", "é", "日本"]
OPTIONS = {"shard_tokens": 3000, "row_group_tokens": 700}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    d = tmp_path_factory.mktemp("text")
    rng = random.Random(0)
    for f in range(3):
        with open(d / f"in{f}.jsonl", "w") as fh:
            for _ in range(41 + f):
                fh.write(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 90)))}) + "\n")
    return sorted(str(p) for p in d.glob("*.jsonl"))


@pytest.fixture(scope="module")
def whole(inputs, tmp_path_factory):
    """One machine's tokenize of the inputs: the reference."""
    out = tmp_path_factory.mktemp("whole")
    tokenize_to_parquet(open_source(inputs), get_tokenizer("bytes"), out, progress=False, **OPTIONS)
    return read(out)


def read(directory) -> tuple[list[list[int]], list[int]]:
    src = open_source(str(directory))
    docs = [d.tolist() for s, info in enumerate(src.shards) for d in src.read(s, np.arange(info.num_rows))]
    lengths = [int(n) for s in range(len(src.shards)) for n in src.lengths(s)]
    return docs, lengths


def split(inputs, out, parts: int, tokenizer: str = "bytes", only=None) -> None:
    for i in only if only is not None else range(parts):
        tokenize_part(open_input(inputs, {}), get_tokenizer(tokenizer), out, i, parts, progress=False, **OPTIONS)


@pytest.mark.parametrize("parts", [1, 2, 3])
def test_parts_equal_one_machine(inputs, whole, tmp_path, parts):
    split(inputs, tmp_path, parts)
    docs, lengths = read(tmp_path)
    assert docs == whole[0] and lengths == whole[1] == [len(d) for d in whole[0]]
    assert len(whole[0]) == 41 + 42 + 43


def test_cli_parts_in_any_order(inputs, whole, tmp_path, capsys):
    for i in (2, 0, 1):
        assert main(["tokenize", *inputs, "--out", str(tmp_path), "--tokenizer", "bytes", "--shard-tokens", "3000",
                     "--row-group-tokens", "700", "--part", f"{i}/3", "--no-progress"]) == 0
    assert "part 1/3: documents 42..83 of 126" in capsys.readouterr().out
    assert read(tmp_path) == whole
    assert main(["tokenize", *inputs, "--out", str(tmp_path), "--tokenizer", "bytes", "--part", "3/3"]) == 2
    assert "--part '3/3': expected i/N with 0 <= i < N" in capsys.readouterr().err


def test_a_missing_part_is_refused(inputs, tmp_path):
    split(inputs, tmp_path, 3, only=[0, 2])
    with pytest.raises(SourceError, match=r"part 1/3 is missing \(2 of 3 parts written\); run `packloader tokenize "
                                          r"\.\.\. --part 1/3`"):
        open_source(str(tmp_path))


def test_parts_of_two_splits_are_refused(inputs, tmp_path):
    split(inputs, tmp_path, 2, only=[0])
    split(inputs, tmp_path, 3, only=[1, 2])
    with pytest.raises(SourceError, match=r"parts of splits into \[2, 3\] parts"):
        open_source(str(tmp_path))


def test_a_part_with_another_tokenizer_is_refused(inputs, tmp_path):
    split(inputs, tmp_path, 2, only=[0])
    split(inputs, tmp_path, 2, tokenizer="cl100k", only=[1])
    with pytest.raises(SourceError, match=r"_part-00001-of-00002\.record: tokenizer 'cl100k'.*part 0 has 'bytes'"):
        open_source(str(tmp_path))


def test_a_stray_token_file_is_refused(inputs, tmp_path):
    split(inputs, tmp_path, 2)
    shutil.copy(next(tmp_path.glob("part-00000-of-00002-*.parquet")), tmp_path / "part-00000.parquet")
    with pytest.raises(SourceError, match=r"token file part-00000\.parquet belongs to no part record"):
        open_source(str(tmp_path))


@pytest.fixture(scope="module")
def local_ray():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.mark.multiprocess
@pytest.mark.parametrize("workers", [1, 2])
def test_ray_pipeline_equals_one_machine(inputs, whole, tmp_path, local_ray, workers):
    from packloader.sources.tokenize_ray import tokenize_on_ray

    records = tokenize_on_ray(inputs, "bytes", tmp_path, workers=workers, options=OPTIONS)
    assert [(r.part, r.parts) for r in records] == [(i, workers) for i in range(workers)]
    assert read(tmp_path) == whole


@pytest.mark.multiprocess
def test_ray_part_error_names_the_file(tmp_path, local_ray):
    from packloader.sources.tokenize_ray import tokenize_on_ray

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": 5}\n')
    with pytest.raises(SourceError, match=r"bad\.jsonl, line 2"):
        tokenize_on_ray([str(bad)], "bytes", tmp_path / "out", workers=1)
