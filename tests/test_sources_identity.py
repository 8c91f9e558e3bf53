"""Nothing trained that the user did not mean, on the sources side: shards known by content (a replaced shard is
refused on resume naming it, a shard rewritten while open is an error naming it), globs that never follow a symlink
loop and never read a file twice, token ids checked against the tokenizer named, shards tokenized differently or
holding text beside tokens refused. Shard truncation while reading runs in a child process (it used to be SIGBUS).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers.docs import text_docs, token_docs, write_token_shards

from packloader.contracts import PlanConfig
from packloader.loader.loader import PackedLoader
from packloader.sources.base import IterableSource
from packloader.sources.errors import SourceError
from packloader.sources.identity import ShardChanged, file_identity, parquet_identity
from packloader.sources.jsonl import JsonlSource, index_chunks, line_index
from packloader.sources.open import open_source
from packloader.sources.parquet import ParquetSource
from packloader.sources.pretokenize import tokenize_to_parquet
from packloader.sources.tokenizers import get_tokenizer

ROOT = Path(__file__).resolve().parents[1]


def _config() -> PlanConfig:
    return PlanConfig(strategy="fixed", max_tokens=256, context=256, tokens_per_step=1024)


def _read_all(src) -> list:
    return [d for shard, info in enumerate(src.shards) for d in src.read(shard, np.arange(info.num_rows))]


def _jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def _stale(path: str, docs: list[np.ndarray], seed: int) -> None:
    """Replace the shard at `path` by another with the same name and row count, other documents."""
    d = Path(path).parent / f"stale-{seed}"
    d.mkdir()
    other = token_docs(len(docs), seed=seed)
    assert [len(x) for x in other] != [len(x) for x in docs]
    os.replace(write_token_shards(d, other, shards=1)[0], path)


# --- identity ----------------------------------------------------------------------------------------------------


def test_identity_follows_content_not_name_or_directory(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    docs = token_docs(120, seed=1)
    a = write_token_shards(tmp_path / "a", docs, shards=1)[0]
    copy = shutil.copyfile(a, tmp_path / "b" / "tok-000.parquet")
    assert parquet_identity(a) == parquet_identity(copy)
    _stale(str(copy), docs, seed=2)
    assert parquet_identity(a) != parquet_identity(copy)
    j = _jsonl(tmp_path / "t.jsonl", text_docs(50))
    before = file_identity(str(j))
    data = bytearray(j.read_bytes())
    data[len(data) // 2] ^= 1  # one bit in the middle, same size
    j.write_bytes(bytes(data))
    assert file_identity(str(j)) != before


def test_large_file_identity_samples_head_tail_and_blocks(tmp_path):
    """Over 4 MiB, the identity reads the head, the tail and 16 spread blocks: a change in any of them shows, and
    so does a change of size (what the module docstring promises)."""
    p = tmp_path / "big.jsonl"
    rng = np.random.default_rng(0)
    data = bytearray(rng.integers(97, 123, size=9 << 20, dtype=np.uint8).tobytes())
    p.write_bytes(bytes(data))
    base = file_identity(str(p))
    for off in (10, len(data) - 10, (1 << 20) + ((len(data) - (2 << 20)) // 17)):  # head, tail, first block
        changed = bytearray(data)
        changed[off] ^= 1
        p.write_bytes(bytes(changed))
        assert file_identity(str(p)) != base, off
    p.write_bytes(bytes(data) + b"x")
    assert file_identity(str(p)) != base


def test_tokenize_records_a_digest_of_its_tokens(tmp_path):
    """Two tokenize runs that differ in one character of one document: every size may match, the identities differ;
    the same input twice gives the same identity (nothing time-dependent in the footer)."""
    texts = text_docs(40, seed=3)
    changed = list(texts)
    changed[17] = changed[17].replace("a", "b", 1)
    assert changed[17] != texts[17]
    tok = get_tokenizer("bytes")
    ids = []
    for name, t in (("x", texts), ("y", texts), ("z", changed)):
        summary = tokenize_to_parquet(IterableSource(t), tok, tmp_path / name, progress=False)
        ids.append(parquet_identity(summary.files[0]))
        meta = pq.ParquetFile(summary.files[0]).metadata.metadata
        assert len(meta[b"packloader.tokens_blake2b"]) == 32
    assert ids[0] == ids[1] != ids[2]


# --- resume after a shard changed ----------------------------------------------------------------------------------


def _saved_state(paths) -> dict:
    loader = PackedLoader(paths, tokenizer="bytes", config=_config(), num_threads=0)
    it = iter(loader)
    next(it)
    next(it)
    return loader.state_dict()


def test_resume_refuses_a_replaced_shard_naming_it(tmp_path):
    docs = token_docs(200, seed=4)
    paths = write_token_shards(tmp_path, docs, shards=2)
    state = _saved_state(paths)
    _stale(paths[1], docs[100:], seed=5)
    loader = PackedLoader(paths, tokenizer="bytes", config=_config(), num_threads=0)
    with pytest.raises(ValueError) as info:
        loader.load_state_dict(state)
    msg = str(info.value)
    assert "source.tok-001.parquet: saved '100 rows, " in msg and "tok-000" not in msg, msg


@pytest.mark.parametrize("how", ["deleted", "renamed"])
def test_resume_refuses_a_deleted_or_renamed_shard_naming_it(tmp_path, how):
    paths = write_token_shards(tmp_path, token_docs(200, seed=6), shards=3)
    state = _saved_state(str(tmp_path / "*.parquet"))
    if how == "deleted":
        os.unlink(paths[1])
    else:
        os.rename(paths[1], tmp_path / "tok-009.parquet")
    loader = PackedLoader(str(tmp_path / "*.parquet"), tokenizer="bytes", config=_config(), num_threads=0)
    with pytest.raises(ValueError) as info:
        loader.load_state_dict(state)
    msg = str(info.value)
    assert "source.tok-001.parquet: saved '67 rows, " in msg and "now None" in msg, msg
    if how == "renamed":
        assert "source.tok-009.parquet: saved None, now '67 rows, " in msg, msg


def test_a_copy_in_another_directory_resumes(tmp_path):
    (tmp_path / "b").mkdir()
    paths = write_token_shards(tmp_path, token_docs(200, seed=7), shards=2)
    state = _saved_state(paths)
    moved = [shutil.copy(p, tmp_path / "b") for p in paths]
    loader = PackedLoader(moved, tokenizer="bytes", config=_config(), num_threads=0)
    loader.load_state_dict(state)  # the same bytes elsewhere are the same shards


# --- a shard changed while the source has it open -----------------------------------------------------------------


def test_a_parquet_shard_replaced_while_open_is_an_error_naming_it(tmp_path):
    docs = token_docs(120, seed=8)
    path = write_token_shards(tmp_path, docs, shards=1)[0]
    src = ParquetSource(path)
    first = list(src.read(0, np.arange(5)))
    assert all(np.array_equal(a, b) for a, b in zip(first, docs[:5]))
    _stale(path, docs, seed=9)
    _assert_refused_as_changed(src, "tok-000.parquet")


def _open_jsonl(tmp_path, n: int, seed: int):
    """n texts written to a.jsonl, and a JsonlSource that has it open."""
    texts = text_docs(n, seed=seed)
    path = _jsonl(tmp_path / "a.jsonl", texts)
    return texts, path, JsonlSource(path)


def _assert_refused_as_changed(src, name: str) -> None:
    with pytest.raises(ShardChanged) as info:
        _read_all(src)
    assert f"{name}: the file changed since the source opened it" in str(info.value)


def test_a_jsonl_shard_rewritten_while_open_is_an_error_naming_it(tmp_path):
    texts, path, src = _open_jsonl(tmp_path, 60, seed=1)
    assert list(src.read(0, np.arange(3))) == texts[:3]
    _jsonl(path, [t.upper() for t in texts])  # in place, same size
    _assert_refused_as_changed(src, "a.jsonl")


def test_touching_a_shard_is_not_a_change(tmp_path):
    texts, path, src = _open_jsonl(tmp_path, 30, seed=2)
    os.utime(path, ns=(1, 1))
    assert _read_all(src) == texts


TRUNCATE = textwrap.dedent("""
    import sys
    import numpy as np
    from packloader.sources.open import open_source
    path = sys.argv[1]
    src = open_source(path)
    n = src.shards[0].num_rows
    list(src.read(0, np.arange(2)))            # handles open, as in training
    with open(path, "r+b") as f:               # another process cuts the file in place
        f.truncate(0)
    try:
        for row in range(n):                   # row by row: this thread's own handle reads every row group
            list(src.read(0, np.array([row])))
    except Exception as e:
        print(type(e).__name__ + ": " + str(e))
""")


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_a_shard_truncated_while_read_is_an_error_not_a_signal(tmp_path, kind):
    """A memory-mapped shard cut short killed the reader with SIGBUS (exit 135); in a child process, so a crash
    fails this test instead of the suite."""
    if kind == "jsonl":
        path = _jsonl(tmp_path / "big.jsonl", text_docs(3000, seed=3))
    else:
        path = Path(write_token_shards(tmp_path, token_docs(3000, seed=3), shards=1)[0])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", TRUNCATE, str(path)], capture_output=True, text=True, timeout=120,
                          env=env)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert proc.stdout.startswith("ShardChanged: ") and f"{path.name}: the file changed" in proc.stdout, proc.stdout


# --- paths: symlink loops, aliases, a file named twice ------------------------------------------------------------


def _tree(tmp_path) -> tuple[Path, list[str]]:
    d = tmp_path / "data"
    (d / "sub").mkdir(parents=True)
    texts = [f"document {i}" for i in range(4)]
    for i, t in enumerate(texts):
        _jsonl(d / ("sub" if i % 2 else ".") / f"p{i}.jsonl", [t])
    return d, texts


def test_a_glob_through_a_symlink_loop_lists_each_file_once(tmp_path):
    d, texts = _tree(tmp_path)
    os.symlink("..", d / "sub" / "loop")
    os.symlink(".", d / "self")
    for spec in (str(d / "**" / "*.jsonl"), str(d)):
        src = open_source(spec)
        assert sorted(_read_all(src)) == sorted(texts), spec


def test_a_directory_of_text_files_with_a_symlink_loop_reads_each_file_once(tmp_path):
    d = tmp_path / "txt"
    (d / "a").mkdir(parents=True)
    for i in range(3):
        (d / "a" / f"f{i}.txt").write_text(f"text {i}")
    os.symlink("..", d / "a" / "up")
    assert sorted(_read_all(open_source(d))) == [f"text {i}" for i in range(3)]


@pytest.mark.parametrize("how", ["listed twice", "symlinked alias", "hard link", "alias directory"])
def test_a_file_reached_twice_is_refused_naming_both_paths(tmp_path, how):
    d, _ = _tree(tmp_path)
    a = str(d / "p0.jsonl")
    if how == "listed twice":
        spec, other = [a, a], a
    elif how == "symlinked alias":
        os.symlink(a, d / "alias.jsonl")
        spec, other = str(d / "*.jsonl"), str(d / "alias.jsonl")
    elif how == "hard link":
        os.link(a, d / "linked.jsonl")
        spec, other = str(d / "*.jsonl"), str(d / "linked.jsonl")
    else:
        os.symlink("sub", d / "sub2")
        spec, other, a = str(d), str(d / "sub2" / "p1.jsonl"), str(d / "sub" / "p1.jsonl")
    with pytest.raises(SourceError) as info:
        open_source(spec)
    msg = str(info.value)
    assert a in msg and other in msg and "are the same file" in msg, msg


def test_sources_given_paths_directly_refuse_duplicates(tmp_path):
    d, _ = _tree(tmp_path)
    for cls in (JsonlSource,):
        with pytest.raises(SourceError, match="are the same file"):
            cls([d / "p0.jsonl", d / "sub" / ".." / "p0.jsonl"])
    p = write_token_shards(tmp_path, token_docs(10), shards=1)[0]
    with pytest.raises(SourceError, match="are the same file"):
        ParquetSource([p, p])


# --- tokenizers: mixed shards, ids against the tokenizer named -------------------------------------------------------


@pytest.mark.parametrize("bytes_first", [True, False])
def test_shards_tokenized_differently_are_refused_naming_both(tmp_path, bytes_first):
    texts = text_docs(20, seed=4)
    out = []
    for name in ("bytes", "tekken"):
        summary = tokenize_to_parquet(IterableSource(texts), get_tokenizer(name, num_threads=1), tmp_path / name,
                                      progress=False)
        first = (name == "bytes") == bytes_first
        out.append(shutil.move(summary.files[0], tmp_path / f"{'a' if first else 'b'}-{name}.parquet"))
    with pytest.raises(SourceError) as info:
        ParquetSource(out)
    msg = str(info.value)
    for p, name in zip(out, ("bytes", "tekken")):
        assert str(p) in msg and f"tokenizer {name!r}" in msg, msg
    assert "were tokenized differently" in msg


def test_token_rows_without_a_vocabulary_are_checked_against_the_tokenizer_named(tmp_path):
    rows = [[1, 2, 3], [4, 5], [6, 300, 7], [8]]
    pq.write_table(pa.table({"tokens": pa.array(rows, pa.list_(pa.int32()))}), tmp_path / "ids.parquet")
    path = str(tmp_path / "ids.parquet")
    with pytest.raises(SourceError) as info:
        list(PackedLoader(path, tokenizer="bytes", config=_config(), num_threads=0, shuffle=False))
    msg = str(info.value)
    assert "ids.parquet, row 2: token id 300 at position 1" in msg and "[0, 257)" in msg and "'bytes'" in msg, msg
    with pytest.raises(ValueError, match="unknown tokenizer 'nope'"):
        PackedLoader(path, tokenizer="nope", config=_config(), num_threads=0)
    for tok in ("tekken", None):  # inside Tekken's vocabulary; None reads ids unchecked
        got = list(PackedLoader(path, tokenizer=tok, config=_config(), num_threads=0, shuffle=False,
                                append_eos=False))
        ids = np.concatenate([b.input_ids.reshape(-1).numpy() for b in got])
        assert sorted(ids.tolist()) == sorted(sum(rows, []))


def test_jsonl_token_rows_are_checked_naming_the_line(tmp_path):
    p = tmp_path / "ids.jsonl"
    p.write_text('{"tokens": [1, 2]}\n\n{"tokens": [3, 999]}\n')
    with pytest.raises(SourceError, match=r"ids.jsonl, line 3: token id 999 at position 1"):
        list(PackedLoader(str(p), tokenizer="bytes", config=_config(), num_threads=0, shuffle=False))


# --- text beside tokens -----------------------------------------------------------------------------------------


def test_text_beside_tokens_asks_for_the_column(tmp_path):
    texts = ["hello world", "more text here"]
    tokens = [[5, 6, 7, 8], [9, 10]]
    pq.write_table(pa.table({"text": texts, "input_ids": pa.array(tokens, pa.list_(pa.int32()))}),
                   tmp_path / "both.parquet")
    (tmp_path / "both.jsonl").write_text("".join(json.dumps({"text": t, "tokens": k}) + "\n"
                                                 for t, k in zip(texts, tokens)))
    for name, col in (("both.parquet", "input_ids"), ("both.jsonl", "tokens")):
        path = str(tmp_path / name)
        with pytest.raises(SourceError) as info:
            open_source(path)
        assert name in str(info.value) and f"={col!r}" in str(info.value) and "text" in str(info.value)
        assert [d.tolist() for d in _read_all(open_source(path, column=col))] == tokens
        assert _read_all(open_source(path, column="text")) == texts
        batches = list(PackedLoader(path, column=col, tokenizer="bytes", config=_config(), num_threads=0,
                                    shuffle=False, append_eos=False))
        assert sorted(np.concatenate([b.input_ids.reshape(-1).numpy() for b in batches]).tolist()) == \
            sorted(sum(tokens, []))


# --- the line index read in chunks --------------------------------------------------------------------------------


def test_the_chunked_line_index_matches_a_plain_split():
    """Lines, blank lines, CRLF, a BOM and a last line without newline, cut into chunks of every small size: the
    same non-blank lines as splitting the bytes in Python."""
    rng = np.random.default_rng(5)
    for trial in range(60):
        alphabet = np.frombuffer(b"ab \t\r\n\n", np.uint8)
        data = alphabet[rng.integers(0, len(alphabet), size=int(rng.integers(0, 80)))].tobytes()
        if trial % 5 == 0:
            data = b"\xef\xbb\xbf" + data
        body, base = (data[3:], 3) if data.startswith(b"\xef\xbb\xbf") else (data, 0)
        want, pos = [], base
        for number, line in enumerate(body.split(b"\n"), 1):
            if line.strip(b" \t\r"):
                want.append((pos, pos + len(line), number))
            pos += len(line) + 1
        for chunk in (1, 2, 3, 7, 1 << 20):
            got = line_index(data, chunk=chunk)
            assert list(zip(*(x.tolist() for x in got))) == want, (data, chunk)
    assert [x.tolist() for x in index_chunks(iter([]))] == [[], [], []]


def test_directory_shards_are_known_by_their_files_names_and_sizes(tmp_path):
    d = tmp_path / "txt"
    d.mkdir()
    for i in range(3):
        (d / f"f{i}.txt").write_text(f"text {i}")
    before = open_source(d).identities
    (d / "f1.txt").write_text("a longer text")
    assert open_source(d).identities != before
    (d / "f1.txt").write_text("text 1")
    assert open_source(d).identities == before
    (d / "f3.txt").write_text("one more")
    assert open_source(d).identities != before
