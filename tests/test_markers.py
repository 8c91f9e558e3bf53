"""Every test that starts processes (torch.distributed ranks, subprocesses, multiprocessing pools, DataLoader
workers) carries the `multiprocess` marker, so `pytest -m "not multiprocess"` runs the single-process tests alone.

Read from the sources with ast: a test starts processes when it, a function of its module it calls, or a fixture
of its module it takes (transitively) makes one of the calls below. Processes started inside code the test module
does not show (the example's `main` with `--cp`) are outside what this sees; those tests are marked by hand."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

# calls that start processes, by the dotted name they are made through
STARTS = {
    "run_ranks",
    "subprocess.run", "subprocess.Popen", "subprocess.call", "subprocess.check_call", "subprocess.check_output",
    "multiprocessing.get_context", "multiprocessing.Pool", "multiprocessing.Process",
    "mp.get_context", "mp.spawn", "mp.start_processes", "mp.Process", "mp.Pool",
    "os.fork", "ProcessPoolExecutor", "concurrent.futures.ProcessPoolExecutor",
}
LOADERS = {"DataLoader", "StatefulDataLoader"}  # start workers unless num_workers is 0


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        inner = _dotted(node.value)
        return f"{inner}.{node.attr}" if inner else ""
    return ""


def _starts_processes(call: ast.Call) -> bool:
    name = _dotted(call.func)
    if name in STARTS:
        return True
    if name.rsplit(".", 1)[-1] in LOADERS:
        workers = next((k.value for k in call.keywords if k.arg == "num_workers"), None)
        return workers is not None and not (isinstance(workers, ast.Constant) and workers.value == 0)
    return False


def _marked(decorators: list[ast.expr]) -> bool:
    return any(ast.unparse(d) == "pytest.mark.multiprocess" or ast.unparse(d).startswith("pytest.mark.multiprocess(")
               for d in decorators)


def unmarked_process_tests(source: str) -> list[str]:
    """Names of the tests in `source` that start processes (directly, through a function or fixture of the
    module) and carry no `multiprocess` marker, neither their own nor the module's `pytestmark`."""
    tree = ast.parse(source)
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets):
            values = node.value.elts if isinstance(node.value, (ast.List, ast.Tuple)) else [node.value]
            if _marked(values):
                return []
    funcs = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    direct, uses = {}, {}
    for name, fn in funcs.items():
        nodes = list(ast.walk(fn))
        direct[name] = any(isinstance(n, ast.Call) and _starts_processes(n) for n in nodes)
        params = [a.arg for a in fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs]  # fixtures it takes
        uses[name] = ({n.id for n in nodes if isinstance(n, ast.Name)} | set(params)) & funcs.keys()
    starts = {name for name, d in direct.items() if d}
    grew = True
    while grew:
        more = {name for name in funcs if name not in starts and uses[name] & starts}
        starts |= more
        grew = bool(more)
    return sorted(name for name in starts
                  if name.startswith("test") and not _marked(funcs[name].decorator_list))


@pytest.mark.parametrize("path", sorted(TESTS.glob("test_*.py")), ids=lambda p: p.name)
def test_tests_that_start_processes_are_marked_multiprocess(path):
    assert unmarked_process_tests(path.read_text()) == [], f"{path.name}: mark these tests `multiprocess`"


PLANTED = '''
import subprocess
import multiprocessing

import pytest
from helpers.distributed import run_ranks
from torch.utils.data import DataLoader


def _in_a_child(path):
    return subprocess.run(["true", path])


@pytest.fixture
def ranks():
    return run_ranks(print, 2)


def test_through_a_helper(tmp_path):
    _in_a_child(str(tmp_path))


def test_through_a_fixture(ranks):
    assert ranks


def test_pool():
    with multiprocessing.get_context("fork").Pool(2) as pool:
        pool.map(abs, [1])


def test_workers(ds):
    list(DataLoader(ds, batch_size=None, num_workers=2))


@pytest.mark.multiprocess
def test_marked():
    run_ranks(print, 2)


def test_no_workers(ds):
    list(DataLoader(ds, batch_size=None, num_workers=0))


def test_plain():
    assert 1 + 1 == 2
'''


def test_the_check_finds_unmarked_tests_in_a_planted_module():
    """The check can fail: a planted module whose unmarked tests start processes in four ways."""
    found = unmarked_process_tests(PLANTED)
    assert found == ["test_pool", "test_through_a_fixture", "test_through_a_helper", "test_workers"]
    assert unmarked_process_tests("import pytest\npytestmark = [pytest.mark.multiprocess]\n" + PLANTED) == []
    assert unmarked_process_tests("import pytest\npytestmark = pytest.mark.multiprocess\n" + PLANTED) == []
    assert unmarked_process_tests("import pytest\npytestmark = pytest.mark.slow\n" + PLANTED) == found
