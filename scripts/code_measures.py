"""The code measures issue 13 asks for, from the source alone: import cycles between packloader's modules,
the largest modules, and functions over 80 lines.

    python scripts/code_measures.py            # a short report
    python scripts/code_measures.py --json     # the same as JSON

Imports are read with `ast` (module level and inside functions alike, `importlib.import_module` calls with a
literal or f-string-prefixed name included), so a lazy import does not hide a cycle.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"packloader": ROOT / "packloader", "packloader_integrations": ROOT / "integrations"}
LONG_FUNCTION = 80


def modules(packages: dict[str, Path] | None = None) -> dict[str, Path]:
    """Dotted module name -> file, for packloader and its integrations (or the `packages` given)."""
    out = {}
    for pkg, root in (packages or PACKAGES).items():
        for path in sorted(root.rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([pkg, *parts])] = path
    return out


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The known modules `name` imports (a `from pkg import sub` counts as importing pkg.sub)."""
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_pkg else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            subs = [f"{base}.{a.name}" for a in node.names]
            # `from pkg import sub` runs pkg's __init__ on the way to sub in any case: count sub only
            targets = subs if all(t in known for t in subs) else [base] + subs
        elif (name_arg := _import_module_arg(node)) is not None:
            targets = [name_arg]
        else:
            continue
        for t in targets:
            if t in known and t != name:
                found.add(t)
    return found


def _import_module_arg(node: ast.AST) -> str | None:
    """The module an `importlib.import_module(...)` / `import_module(...)` call names: a literal name in full; an
    f-string up to its first placeholder, whose package (the prefix without its trailing dot) the call imports
    in any case. None for anything else (a name held in a variable cannot be read from the source)."""
    if not isinstance(node, ast.Call) or not node.args:
        return None
    f = node.func
    if not ((isinstance(f, ast.Attribute) and f.attr == "import_module") or (isinstance(f, ast.Name) and f.id == "import_module")):
        return None
    arg = node.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    if isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
        return str(arg.values[0].value).rstrip(".") or None
    return None


def import_graph(packages: dict[str, Path] | None = None) -> dict[str, set[str]]:
    mods = modules(packages)
    known = set(mods)
    return {m: imports_of(m, p, known) for m, p in mods.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def module_lines() -> list[tuple[int, str]]:
    """(lines, path) of every module, largest first."""
    return sorted(((len(p.read_text().splitlines()), str(p.relative_to(ROOT))) for p in modules().values()), reverse=True)


def long_functions(limit: int = LONG_FUNCTION) -> list[tuple[int, str]]:
    """(lines, path:function) of every function or method longer than `limit` lines, longest first."""
    out = []
    for path in modules().values():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > limit:
                    out.append((n, f"{path.relative_to(ROOT)}:{node.name}"))
    return sorted(out, reverse=True)


def measures() -> dict:
    lines = module_lines()
    return {
        "import_cycles": cycles(import_graph()),
        "modules": len(lines),
        "largest_modules": [{"lines": n, "path": p} for n, p in lines[:5]],
        "functions_over_80_lines": [{"lines": n, "function": f} for n, f in long_functions()],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    m = measures()
    if args.json:
        print(json.dumps(m, indent=2))
        return 0
    print(f"import cycles: {len(m['import_cycles'])}")
    for c in m["import_cycles"]:
        print("  " + " <-> ".join(c))
    print(f"modules: {m['modules']}; largest:")
    for e in m["largest_modules"]:
        print(f"  {e['lines']:5d}  {e['path']}")
    print(f"functions over {LONG_FUNCTION} lines: {len(m['functions_over_80_lines'])}")
    for e in m["functions_over_80_lines"]:
        print(f"  {e['lines']:5d}  {e['function']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
