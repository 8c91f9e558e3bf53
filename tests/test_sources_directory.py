"""DirectorySource: one document per file, sorted paths in shards of N files; the stdlib demo corpus."""

import sysconfig
from pathlib import Path

import numpy as np
import pytest

from packloader.sources.directory import DirectorySource, stdlib_corpus
from packloader.sources.errors import EmptyDocumentError, NonUtf8Error


def _tree(root: Path) -> dict[str, str]:
    files = {
        "a.py": "print('a')\n",
        "pkg/b.py": "def b():\n    return 'ü'\n",
        "pkg/sub/c.py": "x = 1\n" * 100,
        "pkg/notes.txt": "not python",
        "z.py": "# last\n",
        ".hidden/h.py": "hidden = True\n",
        "site-packages/dep.py": "dep = 1\n",
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text, encoding="utf-8")
    return files


def test_sorted_files_in_shards(tmp_path):
    files = _tree(tmp_path)
    src = DirectorySource(tmp_path, "**/*.py", files_per_shard=2, exclude_dirs=("site-packages",))
    expected = ["a.py", "pkg/b.py", "pkg/sub/c.py", "z.py"]
    assert [Path(f).relative_to(tmp_path).as_posix() for f in src.files] == expected
    assert [s.num_rows for s in src.shards] == [2, 2]
    assert not src.pretokenized and src.lengths(0) is None
    docs = [d for shard in range(2) for d in src.read(shard, np.array([1, 0]))]
    assert docs == [files["pkg/b.py"], files["a.py"], files["z.py"], files["pkg/sub/c.py"]]
    everything = DirectorySource(tmp_path, include_hidden=True)
    assert len(everything.files) == len(files)


def test_non_utf8_file_error_or_skip(tmp_path):
    _tree(tmp_path)
    (tmp_path / "pkg" / "latin1.py").write_bytes("s = 'café'\n".encode("latin-1"))
    src = DirectorySource(tmp_path, "**/*.py", files_per_shard=10)
    row = [Path(f).name for f in src.files].index("latin1.py")
    with pytest.raises(NonUtf8Error, match=r"pkg/latin1\.py: not valid UTF-8.*errors='skip'"):
        list(src.read(0, np.arange(src.shards[0].num_rows)))
    list(src.read(0, [r for r in range(src.shards[0].num_rows) if r != row]))  # the others read fine
    skipping = DirectorySource(tmp_path, "**/*.py", errors="skip")
    assert skipping.skipped["non-UTF-8 files"] == 1
    assert skipping.skipped.examples[0].endswith("latin1.py: non-UTF-8 files")
    assert "latin1.py" not in " ".join(skipping.files)


def test_empty_file_error_or_skip(tmp_path):
    _tree(tmp_path)
    (tmp_path / "pkg" / "__init__.py").write_bytes(b"")
    (tmp_path / "bom.py").write_bytes(b"\xef\xbb\xbf")
    src = DirectorySource(tmp_path, "**/*.py", files_per_shard=100)
    with pytest.raises(EmptyDocumentError, match=r"bom\.py: empty document"):
        list(src.read(0, np.arange(src.shards[0].num_rows)))
    skipping = DirectorySource(tmp_path, "**/*.py", empty="skip", files_per_shard=100)
    assert skipping.skipped["empty documents"] == 2
    docs = list(skipping.read(0, np.arange(skipping.shards[0].num_rows)))
    assert all(docs) and len(docs) == len(src.files) - 2


def test_missing_directory_and_no_match(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        DirectorySource(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match=r"no files match '\*\*/\*\.rs'"):
        DirectorySource(tmp_path, "**/*.rs")


def test_stdlib_corpus():
    src = stdlib_corpus()
    stdlib = sysconfig.get_paths()["stdlib"]
    assert all(f.startswith(stdlib) and f.endswith(".py") for f in src.files)
    assert not any("site-packages" in f for f in src.files)
    assert len(src.files) > 500
    assert src.skipped["empty documents"] > 0  # empty __init__.py files
    first = list(src.read(0, [0]))[0]
    assert isinstance(first, str) and first
