"""The package's import graph: no cycles (function-level imports included), no private names
imported across modules, and serving a cached kernel imports neither TileLang nor Optuna."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "tkjit"


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, modules: set[str]) -> list[tuple[str, str | None, int]]:
    """(module imported, name imported from it or None, line) for every tkjit import in the file."""
    tree = ast.parse(path.read_text())
    me = _module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, None, node.lineno) for a in node.names if a.name.split(".")[0] == "tkjit"]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            if base.split(".")[0] != "tkjit":
                continue
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.append((sub, None, node.lineno) if sub in modules else (base, a.name, node.lineno))
    return out


def _graph() -> tuple[dict[str, set[str]], list[str]]:
    files = {_module_name(p): p for p in PKG.rglob("*.py")}
    modules = set(files)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    private = []
    for m, path in files.items():
        for target, name, line in _imports(path, modules):
            while target not in modules and "." in target:
                target = target.rpartition(".")[0]
            if target == m or target == "tkjit" and m.startswith("tkjit."):
                # the package __init__ is the public facade: modules never need it
                if target == "tkjit" and m != "tkjit":
                    graph[m].add(target)
                continue
            graph[m].add(target)
            if name is not None and name.startswith("_") and not name.startswith("__"):
                private.append(f"{m}:{line} imports {target}.{name}")
    return graph, private


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
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

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    graph, _ = _graph()
    # Only the package facade may import its submodules; a submodule importing `tkjit` closes a loop.
    assert _cycles(graph) == []


def test_no_private_names_across_modules():
    _, private = _graph()
    assert private == []


def test_serving_from_the_cache_imports_neither_tilelang_nor_optuna():
    """`import tkjit` and the loader path never pull the compiler or the tuner in (AST check of the
    module-level imports of every module `tkjit.api` reaches)."""
    files = {_module_name(p): p for p in PKG.rglob("*.py")}
    seen, todo = set(), ["tkjit.api", "tkjit"]
    heavy = []
    while todo:
        m = todo.pop()
        if m in seen or m not in files:
            continue
        seen.add(m)
        for node in ast.parse(files[m].read_text()).body:  # module level only: lazy imports are the point
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            for n in names:
                if n.split(".")[0] in ("tilelang", "tvm", "optuna"):
                    heavy.append(f"{m} imports {n}")
                if n in files:
                    todo.append(n)
    assert "tkjit.compiler" not in seen and "tkjit.tuning.tuner" not in seen
    assert heavy == []


def test_import_tkjit_creates_one_dataclass():
    """Python 3.12 spends ~0.6 ms creating each frozen dataclass, a third of a bare `import tkjit`: the value
    types on the import path are NamedTuples; KernelSpec (mutable, the spec authors' API) is the one left."""
    code = (
        "import dataclasses\n"
        "made = []\n"
        "orig = dataclasses._process_class\n"
        "def counted(cls, *a, **k):\n"
        "    made.append(cls.__module__ + '.' + cls.__qualname__)\n"
        "    return orig(cls, *a, **k)\n"
        "dataclasses._process_class = counted\n"
        "import tkjit\n"
        "print(made)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split("\n")[-2] == "['tkjit.spec.KernelSpec']"
