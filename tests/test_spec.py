"""source_hash_of: a spec's key covers its own module and the modules of its package that it imports,
so editing a family's shared blocks recompiles every spec built from them, and nothing else."""

import hashlib
import importlib
import inspect
import sys
import textwrap
import uuid

import pytest

import tkjit
from tkjit.spec import _imported_sources, source_hash_of

FILES = {
    "__init__.py": "",
    "_shared.py": "WARP = 32\n",
    "fam/__init__.py": '"""A family."""\n',
    "fam/_common.py": """
        from {pkg}._shared import (  # a parenthesised list, with a comment
            WARP,  # lanes
        )

        SCALE = 2
        """,
    "fam/spec_a.py": """
        from {pkg}.fam._common import SCALE

        def build(shape, c):
            return SCALE
        """,
    "fam/spec_b.py": """
        from ._common import SCALE

        def build(shape, c):
            return SCALE
        """,
    "fam/spec_c.py": """
        def build(shape, c):
            from . import spec_a  # a lazy import of a sibling spec

            return spec_a.build(shape, c)
        """,
    "fam/spec_d.py": """
        import math

        def build(shape, c):
            return math.pi
        """,
    "fam/unrelated.py": "X = 1\n",
}
SPECS = ("spec_a", "spec_b", "spec_c", "spec_d")


@pytest.fixture
def pkg(tmp_path, monkeypatch):
    """A package on disk, {name}/fam/ a family of four spec modules; yields (name, root dir)."""
    name = f"hashpkg_{uuid.uuid4().hex[:12]}"
    root = tmp_path / name
    for rel, text in FILES.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).format(pkg=name))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name, root
    for mod in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        del sys.modules[mod]


def hashes(name):
    return {s: source_hash_of(importlib.import_module(f"{name}.fam.{s}").build) for s in SPECS}


def edit(path, line):
    # Longer than before: inspect's line cache notices a change of size even within one mtime tick.
    path.write_text(path.read_text() + line)


def changed(before, after):
    return {s for s in SPECS if before[s] != after[s]}


def test_editing_a_shared_block_changes_the_hash_of_every_spec_importing_it(pkg):
    name, root = pkg
    before = hashes(name)
    edit(root / "fam" / "_common.py", "OFFSET = 1\n")
    assert changed(before, hashes(name)) == {"spec_a", "spec_b", "spec_c"}  # spec_c through spec_a


def test_imports_are_followed_across_the_package_and_through_modules(pkg):
    name, root = pkg
    before = hashes(name)
    edit(root / "_shared.py", "HALF_WARP = 16\n")  # imported by fam/_common.py only
    assert changed(before, hashes(name)) == {"spec_a", "spec_b", "spec_c"}


def test_editing_one_spec_changes_only_itself_and_what_imports_it(pkg):
    name, root = pkg
    before = hashes(name)
    edit(root / "fam" / "spec_a.py", "# a comment\n")
    assert changed(before, hashes(name)) == {"spec_a", "spec_c"}
    before = hashes(name)
    edit(root / "fam" / "unrelated.py", "Y = 2\n")
    assert changed(before, hashes(name)) == set()


def test_a_module_without_package_imports_hashes_as_its_source_alone(pkg):
    name, _ = pkg
    mod = importlib.import_module(f"{name}.fam.spec_d")
    assert source_hash_of(mod.build) == hashlib.sha256(inspect.getsource(mod).encode()).hexdigest()[:16]


def test_the_mhc_specs_hash_their_shared_blocks():
    for kernel in ("sinkhorn_fwd", "sinkhorn_bwd"):
        spec = tkjit.get_spec(kernel)
        module = inspect.getmodule(spec.build)
        deps = [n for n, _ in _imported_sources(module, inspect.getsource(module))]
        assert "kernel_specs.mhc._common" in deps
        assert spec.source_hash == source_hash_of(spec.build)
