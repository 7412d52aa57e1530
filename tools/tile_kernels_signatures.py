"""Extract TileKernels' public API (names and signatures) from its source, without importing it.

    python tools/tile_kernels_signatures.py /path/to/tile_kernels > tests/data/tile_kernels_signatures.json
    python tools/tile_kernels_signatures.py /path/to/tile_kernels --stubs quant   # stub source for a module

Importing tile_kernels needs TileLang and a CUDA device, so its source is parsed with `ast`. A
module's public names are what its `__init__.py` imports or defines (for a package) or the names it
defines without a leading underscore (for a plain module such as `config`). Each name is followed to
the definition it re-exports and recorded as:

    {"kind": "function", "params": [{"name", "kind", "default", "annotation"}], "returns": ...}
    {"kind": "class", "bases": [...], "methods": {name: <function record>}}
    {"kind": "module"}

Defaults and annotations are their source text (`ast.unparse`). tests/test_compat_tile_kernels.py
checks `tkjit.compat.tile_kernels` against the committed output, which is what tkjit promises to
mirror; `--stubs` prints the NotImplementedError stubs of a module's names, as a starting point.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path
from typing import Any

# The modules tkjit.compat.tile_kernels mirrors ("" is the package itself).
MIRRORED = (
    "", "config", "engram", "mhc", "modeling", "modeling.engram", "modeling.mhc", "modeling.mhc.ops",
    "moe", "quant", "transpose",
)
# Public names of the package that are not kernels: torch reference implementations and test
# helpers. They are not mirrored (tkjit has its own references in each spec).
NOT_MIRRORED = {
    "torch": "TileKernels' torch reference implementations (tkjit's references live in its specs)",
    "testing": "TileKernels' test helpers",
}
_KINDS = ("positional_only", "positional_or_keyword", "var_positional", "keyword_only", "var_keyword")


def _text(node: ast.AST | None) -> str | None:
    return None if node is None else ast.unparse(node)


def function_record(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> dict[str, Any]:
    a = fn.args
    params: list[dict[str, Any]] = []

    def add(arg: ast.arg, kind: int, default: ast.AST | None = None) -> None:
        params.append({"name": arg.arg, "kind": _KINDS[kind], "default": _text(default),
                       "annotation": _text(arg.annotation)})

    positional = a.posonlyargs + a.args
    defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    for i, (arg, default) in enumerate(zip(positional, defaults)):
        add(arg, 0 if i < len(a.posonlyargs) else 1, default)
    if a.vararg:
        add(a.vararg, 2)
    for arg, default in zip(a.kwonlyargs, a.kw_defaults):
        add(arg, 3, default)
    if a.kwarg:
        add(a.kwarg, 4)
    return {"kind": "function", "params": params, "returns": _text(fn.returns)}


def class_record(cls: ast.ClassDef) -> dict[str, Any]:
    methods = {
        node.name: function_record(node)
        for node in cls.body
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not (
            node.name.startswith("_") and not node.name.startswith("__"))
        and node.name not in ("__repr__", "__str__")
    }
    return {"kind": "class", "bases": [_text(b) for b in cls.bases], "methods": methods}


class Source:
    """The package's source tree, parsed on demand."""

    def __init__(self, root: Path):
        self.root = root
        self._trees: dict[str, ast.Module] = {}

    def path(self, module: str) -> Path:
        base = self.root.joinpath(*module.split(".")) if module else self.root
        return base / "__init__.py" if (base / "__init__.py").is_file() else base.with_suffix(".py")

    def is_package(self, module: str) -> bool:
        return self.path(module).name == "__init__.py"

    def tree(self, module: str) -> ast.Module:
        if module not in self._trees:
            self._trees[module] = ast.parse(self.path(module).read_text(), str(self.path(module)))
        return self._trees[module]

    def absolute(self, module: str, node: ast.ImportFrom) -> str:
        if not node.level:  # `from tile_kernels.x import y`
            return (node.module or "").removeprefix("tile_kernels").lstrip(".")
        parts = module.split(".") if module else []
        if not self.is_package(module):
            parts = parts[:-1]
        parts = parts[: len(parts) - (node.level - 1)] if node.level > 1 else parts
        return ".".join(parts + ([node.module] if node.module else []))

    def public_names(self, module: str) -> list[str]:
        names: list[str] = []
        for node in self.tree(module).body:
            if isinstance(node, ast.ImportFrom):
                if self.is_package(module) or node.level or (node.module or "").startswith("tile_kernels"):
                    names += [a.asname or a.name for a in node.names if a.name != "*"]
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.append(node.name)
            elif isinstance(node, ast.Assign) and self.is_package(module):
                names += [t.id for t in node.targets if isinstance(t, ast.Name)]
        if not self.is_package(module):  # a plain module: its own public definitions only
            names = [
                n.name for n in self.tree(module).body
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            ]  # (not its imports, nor private module state such as config's `_num_sms`)
        return [n for n in names if not n.startswith("_")]

    def resolve(self, module: str, name: str, depth: int = 0) -> dict[str, Any]:
        """The record of `name` as seen from `module`, following re-exports."""
        if depth > 10:
            raise RuntimeError(f"re-export cycle at {module}.{name}")
        for node in self.tree(module).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                return function_record(node)
            if isinstance(node, ast.ClassDef) and node.name == name:
                return class_record(node)
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
                return {"kind": "alias", "value": _text(node.value)}  # e.g. engram_gate = EngramGateFn.apply
        for node in self.tree(module).body:
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if (alias.asname or alias.name) != name:
                        continue
                    target = self.absolute(module, node)
                    sub = f"{target}.{alias.name}" if target else alias.name
                    if self.path(sub).is_file():
                        return {"kind": "module"}
                    return self.resolve(target, alias.name, depth + 1)
        raise KeyError(f"{module or 'tile_kernels'}: cannot find {name}")


def extract(root: Path) -> dict[str, Any]:
    src = Source(root)
    version = None
    version_file = root / "_version.py"
    if version_file.is_file():  # setuptools-scm writes `__version__ = version = '1.0.0'`
        for node in ast.parse(version_file.read_text()).body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__version__" for t in node.targets):
                version = ast.literal_eval(node.value)
    modules: dict[str, dict[str, Any]] = {}
    for module in MIRRORED:
        modules[module] = {name: src.resolve(module, name) for name in src.public_names(module)}
    return {
        "package": "tile_kernels",
        "version": version,
        "generator": "tools/tile_kernels_signatures.py",
        "not_mirrored": NOT_MIRRORED,
        "modules": modules,
    }


def _param_text(p: dict[str, Any]) -> str:
    prefix = {"var_positional": "*", "var_keyword": "**"}.get(p["kind"], "")
    out = prefix + p["name"]
    if p["annotation"]:
        out += f": {p['annotation']}"
    if p["default"] is not None:
        out += f" = {p['default']}" if p["annotation"] else f"={p['default']}"
    return out


def signature_parts(rec: dict[str, Any]) -> tuple[list[str], str]:
    parts: list[str] = []
    params = rec["params"]
    kinds = [p["kind"] for p in params]
    for i, p in enumerate(params):
        if p["kind"] == "keyword_only" and "var_positional" not in kinds and (i == 0 or kinds[i - 1] != "keyword_only"):
            parts.append("*")
        parts.append(_param_text(p))
        if p["kind"] == "positional_only" and (i + 1 == len(params) or kinds[i + 1] != "positional_only"):
            parts.append("/")
    return parts, (f" -> {rec['returns']}" if rec["returns"] else "")


def signature_text(rec: dict[str, Any]) -> str:
    parts, ret = signature_parts(rec)
    return f"({', '.join(parts)}){ret}"


def stubs(data: dict[str, Any], module: str) -> str:
    """NotImplementedError stubs (120-column source) for the functions of `module`."""
    lines = []
    for name, rec in data["modules"][module].items():
        if rec["kind"] != "function":
            continue
        head = f"def {name}{signature_text(rec)}:"
        if len(head) > 120:
            parts, ret = signature_parts(rec)
            head = "\n".join([f"def {name}(", *(f"    {p}," for p in parts), f"){ret}:"])
        lines += [head, f'    raise missing("{module}.{name}", FAMILY)', "", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root", type=Path, help="the tile_kernels package directory (holding __init__.py)")
    ap.add_argument("--stubs", metavar="MODULE", help="print NotImplementedError stubs for MODULE's functions")
    args = ap.parse_args(argv)
    if not (args.root / "__init__.py").is_file():
        ap.error(f"{args.root} is not a package directory (no __init__.py)")
    data = extract(args.root)
    if args.stubs is not None:
        print(stubs(data, args.stubs))
    else:
        json.dump(data, sys.stdout, indent=1, sort_keys=False)
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
