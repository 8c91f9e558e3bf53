"""Numba's compile cache is kept where a second run finds it: every kernel is compiled with cache=True, and a
second process loads what the first compiled instead of compiling again. (Numba writes the cache next to the
source, or, where that directory is not writable, as for a read-only checkout or a system-wide install, under
the user's cache directory, ~/.cache/numba; NUMBA_CACHE_DIR overrides both.)"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _jit_calls(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for d in node.decorator_list:
                target = d.func if isinstance(d, ast.Call) else d
                name = getattr(target, "id", None) or getattr(target, "attr", None)
                if name in ("njit", "jit"):
                    yield node.name, d


def test_every_kernel_is_cached():
    missing, found = [], 0
    for path in sorted((ROOT / "packloader").rglob("*.py")):
        for name, d in _jit_calls(ast.parse(path.read_text())):
            found += 1
            ok = isinstance(d, ast.Call) and any(k.arg == "cache" and getattr(k.value, "value", None) is True
                                                 for k in d.keywords)
            if not ok:
                missing.append(f"{path.relative_to(ROOT)}:{name}")
    assert found > 20 and missing == []


PROBE = """
import sys
sys.path.insert(0, sys.argv[1])
import numpy as np
from packloader.balancers.cost.coeffs import doc_time_split
from packloader.balancers.cost.resolve import load_cost_model
doc_time_split(load_cost_model("tiny").coeffs, np.arange(1, 100, dtype=np.int64))
import packloader
assert packloader.__file__.startswith(sys.argv[1]), packloader.__file__
print(sum(doc_time_split.stats.cache_hits.values()), sum(doc_time_split.stats.cache_misses.values()))
"""


def _run(pkg_root: Path, env: dict) -> tuple[int, int]:
    out = subprocess.run([sys.executable, "-c", PROBE, str(pkg_root)], capture_output=True, text=True, env=env,
                         timeout=300, check=True).stdout.split()
    return int(out[-2]), int(out[-1])


def _copy(tmp_path: Path) -> Path:
    root = tmp_path / "checkout"
    shutil.copytree(ROOT / "packloader", root / "packloader", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", root / "pyproject.toml")
    return root


@pytest.mark.multiprocess
def test_a_second_process_loads_the_compiled_kernel(tmp_path):
    root = _copy(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    assert _run(root, env) == (0, 1)  # a fresh checkout compiles
    assert _run(root, env) == (1, 0)  # the next run finds it
    assert list((root / "packloader" / "balancers" / "cost" / "__pycache__").glob("coeffs.doc_time_split-*.nbi"))


@pytest.mark.multiprocess
@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root writes into read-only directories")
def test_a_read_only_checkout_caches_in_the_users_cache_dir(tmp_path):
    root = _copy(tmp_path)
    for d, _, files in os.walk(root):
        for f in files:
            os.chmod(os.path.join(d, f), 0o444)
        os.chmod(d, 0o555)
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")
    try:
        assert _run(root, env) == (0, 1)
        assert _run(root, env) == (1, 0)
        assert list((tmp_path / "cache" / "numba").rglob("coeffs.doc_time_split-*.nbi"))
    finally:
        for d, _, _ in os.walk(root):
            os.chmod(d, 0o755)
