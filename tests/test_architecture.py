"""The package's shape, checked from the source (scripts/code_measures.py reads the imports with `ast`, lazy
ones included): no import cycles, data flowing one way between the layers, and inside balancers/ cost below
planners and simulation."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("code_measures", ROOT / "scripts" / "code_measures.py")
cm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cm)

# What each layer may import besides itself (sources -> balancers -> collate -> runtime; the loader, report,
# CLI and integrations sit on top).
ALLOWED = {
    "contracts": set(),
    "sources": {"contracts"},
    "balancers": {"contracts"},
    "collate": {"contracts"},
    "runtime": {"contracts", "balancers", "collate"},
    "loader": {"contracts", "sources", "balancers", "collate"},
    "report": {"contracts", "sources", "balancers"},
    "cli": {"contracts", "sources", "balancers", "collate", "loader", "report", "runtime"},
    "integrations": {"contracts", "collate", "runtime", "loader", "balancers"},
    "packloader": None,  # the package's lazy re-exports
    "renamed_modules": set(),  # old import paths, served by name only (issue 34)
}
# Inside balancers/: which wing may import which.
# The factory (PlanConfig -> planner) sits above the planners: none of them imports it.
WINGS = {"cost": set(), "sim": {"cost"}, "planners": {"cost", "sim"}, "factory": {"planners", "cost"},
         "offline": {"planners", "cost", "draw", "factory"}, "draw": {"planners"}, "warm_up": {"offline", "planners"}}


def _layer(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "packloader_integrations":
        return "integrations"
    return parts[1] if len(parts) > 1 else "packloader"


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return cm.import_graph()


def test_no_import_cycles(graph):
    assert cm.cycles(graph) == []


def test_cycle_finder_finds_a_planted_cycle():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cm.cycles(g) == [["a", "b", "c"]]


def test_import_graph_follows_import_module(tmp_path):
    """A lazy `importlib.import_module` closed the registry -> per-document CP -> registry cycle (issue 34) that
    the graph of `import` statements alone did not show: on a package of the same shape, the graph has it."""
    pkg = tmp_path / "pkg"
    (pkg / "planners").mkdir(parents=True)
    for init in (pkg / "__init__.py", pkg / "planners" / "__init__.py"):
        init.write_text("")
    (pkg / "planners" / "registry.py").write_text(
        "import importlib\n\n\ndef make_planner():\n    return importlib.import_module('pkg.planners.choice')\n")
    (pkg / "planners" / "choice.py").write_text("from pkg.planners.registry import make_planner\n")
    (pkg / "planners" / "plugins.py").write_text(
        "from importlib import import_module\n\n\ndef load(m, n):\n    import_module(f'pkg.planners.{m}')\n"
        "    import_module(n)\n")
    graph = cm.import_graph({"pkg": pkg})
    assert cm.cycles(graph) == [["pkg.planners.choice", "pkg.planners.registry"]]
    # an f-string name imports at least its package; a name in a variable cannot be read
    assert graph["pkg.planners.plugins"] == {"pkg.planners"}
    (pkg / "planners" / "registry.py").write_text("def make_planner():\n    return None\n")
    assert cm.cycles(cm.import_graph({"pkg": pkg})) == []


def test_planners_never_import_the_factory(graph):
    assert sorted(a for a, t in graph.items() if a.startswith("packloader.balancers.planners")
                  and "packloader.balancers.factory" in t) == []


def test_layers_import_only_downstream(graph):
    bad = []
    for a, targets in graph.items():
        la = _layer(a)
        allowed = ALLOWED[la]
        if allowed is None:
            continue
        bad += [f"{a} -> {b}" for b in targets if _layer(b) != la and _layer(b) not in allowed]
    assert bad == []


def test_balancers_wings(graph):
    bad = []
    for a, targets in graph.items():
        if not a.startswith("packloader.balancers."):
            continue
        wa = a.split(".")[2]
        for b in targets:
            if b.startswith("packloader.balancers.") and b.split(".")[2] != wa and b.split(".")[2] not in WINGS.get(wa, set()):
                bad.append(f"{a} -> {b}")
    assert bad == []


def test_no_module_over_450_lines():
    assert [(n, p) for n, p in cm.module_lines() if n > 450] == []


def test_no_function_over_80_lines():
    """Numba kernels included: a long kernel is split into its passes, each a kernel of its own."""
    assert cm.long_functions(80) == []


def test_no_script_shadows_an_installed_package():
    """A script's own folder comes first on sys.path, so benchmarks/tokenizers.py once hid Hugging Face's
    `tokenizers` from everything the benchmarks (and any test that put benchmarks/ on the path) imported."""
    from importlib.metadata import packages_distributions

    installed = set(packages_distributions())
    stems = {p.stem: p for d in ("benchmarks", "scripts", "examples", "tests") for p in (ROOT / d).rglob("*.py")}
    assert sorted(str(stems[s].relative_to(ROOT)) for s in set(stems) & installed) == []


def test_every_package_folder_is_in_the_wheel():
    """pyproject lists packages by hand (two trees under their own names): a new folder missing there is left
    out of a wheel, and only an installed user would notice."""
    import tomllib

    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    roots = {name: ROOT / path for name, path in setup["package-dir"].items()}
    found = set()
    for name, path in roots.items():
        for f in path.rglob("*"):
            if f.is_file() and "__pycache__" not in f.parts and f.suffix in (".py", ".json", ".csv"):
                rel = f.parent.relative_to(path)
                found.add(".".join((name, *rel.parts)))
    assert sorted(found - set(setup["packages"])) == []
    data = setup.get("package-data", {})
    for pkg in found:
        folder = roots[pkg.split(".")[0]].joinpath(*pkg.split(".")[1:])
        kinds = {f.suffix for f in folder.iterdir() if f.is_file() and f.suffix in (".json", ".csv")}
        assert all(f"*{k}" in data.get(pkg, []) for k in kinds), (pkg, kinds, data.get(pkg))


def _test_modules_imported(source: str) -> set[str]:
    """The test modules (test_*) a file's code imports; what it shares belongs in tests/helpers."""
    tree = ast.parse(source)
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    return {m for m in names if m.split(".")[-1].startswith("test_") or m.startswith("tests.test_")}


def test_no_test_module_imports_another():
    tests = Path(__file__).parent
    found = {p.name: sorted(_test_modules_imported(p.read_text())) for p in sorted(tests.glob("test_*.py"))}
    found.update({f"helpers/{p.name}": sorted(_test_modules_imported(p.read_text()))
                  for p in sorted((tests / "helpers").glob("*.py"))})
    assert {k: v for k, v in found.items() if v} == {}
    # the check can fail
    assert _test_modules_imported("from test_sources_s3 import s3\nimport tests.test_x\n") == {"test_sources_s3",
                                                                                             "tests.test_x"}
