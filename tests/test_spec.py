"""tkjit.spec: spec validation, shapes, configs and buckets; source_hash_of (a spec's key covers its own module
and the modules of its package that it imports, so editing a family's shared blocks recompiles every spec
built from them, and nothing else); fuzzed shapes and configs never escape as anything but a tkjit error."""

import hashlib
import importlib
import inspect
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).parent / "helpers"))

from common import SINK  # noqa: E402
from common import toy_spec as _toy_spec  # noqa: E402

import tkjit  # noqa: E402
from tkjit.errors import TkjitError  # noqa: E402
from tkjit.registry import all_specs, get_spec  # noqa: E402
from tkjit.spec import Runtime, TensorArg, _imported_sources, source_hash_of, validate  # noqa: E402

SPEC = get_spec("sinkhorn_fwd")
FULL = SPEC.canonical_shape({"num_tokens": 64})

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
        assert "tkjit_kernels.mhc._common" in deps
        assert spec.source_hash == source_hash_of(spec.build)


# -- spec model -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "over, match",
    [
        (dict(name="Bad-Name"), "spec name"),
        (dict(space={}), "empty tunable space"),
        (dict(space={"block": [32, 64]}), "non-empty tuple"),
        (dict(default=lambda s: {"block": 128}), "default config is invalid"),
        (dict(params=(Runtime("n"), Runtime("n"))), "duplicate"),
        (dict(inputs=(TensorArg("x", "float32", ("n", "nope")),)), "unknown dim"),
        (dict(examples=()), "example"),
    ],
)
def test_spec_validation_errors(over, match):
    with pytest.raises(tkjit.SpecError, match=match):
        validate(_toy_spec(**over))


def test_shape_and_config_errors_list_what_is_allowed():
    spec = tkjit.get_spec("sinkhorn_fwd")
    with pytest.raises(tkjit.ShapeError, match="unknown shape params.*expected: num_tokens"):
        spec.canonical_shape({"num_tokens": 4, "hidden": 3})
    with pytest.raises(tkjit.ShapeError, match="missing shape params: num_tokens"):
        spec.canonical_shape({"n": 4})
    with pytest.raises(tkjit.ShapeError, match="above its maximum 16"):
        spec.canonical_shape({"num_tokens": 4, "n": 17})
    with pytest.raises(tkjit.ShapeError, match="must be an int"):
        spec.canonical_shape({"num_tokens": "many"})
    full = spec.canonical_shape(SINK)
    with pytest.raises(tkjit.ConfigError, match="not in the space; allowed"):
        spec.check_config(full, {**spec.default_config(full), "threads": 99})
    with pytest.raises(tkjit.ConfigError, match="missing"):
        spec.check_config(full, {"layout": "thread"})
    with pytest.raises(tkjit.ConfigError, match="multiple of threads"):
        spec.check_config(full, {**spec.default_config(full), "block_tokens": 64, "threads": 128})
    with pytest.raises(tkjit.ConfigError, match="not in the space"):  # True must not pass for 1
        spec.check_config(full, {**spec.default_config(full), "fast_math": 1})
    with pytest.raises(tkjit.UnknownKernelError, match="known kernels"):
        tkjit.get("no_such_kernel", {})


def test_runtime_sizes_bucket_to_powers_of_two():
    spec = tkjit.get_spec("sinkhorn_fwd")
    assert spec.bucket({"num_tokens": 4001}) == {"num_tokens": 4096}
    assert spec.bucket({"num_tokens": 4096}) == {"num_tokens": 4096}
    assert spec.bucket({"num_tokens": 1}) == {"num_tokens": 1}


def test_space_holds_several_layouts_and_constraints_prune():
    spec = tkjit.get_spec("sinkhorn_fwd")
    full = spec.canonical_shape(SINK)
    cfgs = spec.configs(full)
    assert {c["layout"] for c in cfgs} == {"thread", "smem", "fragment"}
    assert 100 < len(cfgs) < 10 * 4 * 2 * 2 * 3
    assert all(c["layout"] == "thread" and not c["fast_math"] for c in spec.configs(full, "cpu"))


# -- fuzzing ----------------------------------------------------------------------------------
VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(-10, 300), st.floats(allow_nan=True),
    st.text(max_size=12), st.sampled_from(["4", " 4 ", "1e3", "0x10", "4.0", "١٢", "1_0", "9" * 5000]),
    st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    st.binary(max_size=4), st.complex_numbers(),
)


PARAM_NAMES = st.sampled_from([p.name for s in all_specs() for p in s.params] + ["x", "", "n\n"])


CFG_NAMES = st.sampled_from([k for s in all_specs() for k in s.space] + ["x", ""])


EXAMPLES = {"shape": 0, "config": 0}


@settings(max_examples=1500, deadline=None)
@given(shape=st.dictionaries(st.one_of(PARAM_NAMES, st.text(max_size=8)), VALUES, max_size=6),
       need_runtime=st.booleans())
def test_fuzz_canonical_shape(shape, need_runtime):
    EXAMPLES["shape"] += 1
    for spec in all_specs():
        try:
            out = spec.canonical_shape(shape, need_runtime=need_runtime)
        except TkjitError:
            continue
        assert set(out) <= {p.name for p in spec.params}
        for p in spec.params:
            if p.name in out:
                assert p.check(out[p.name]) == out[p.name]


@settings(max_examples=1500, deadline=None)
@given(
    shape=st.fixed_dictionaries({}, optional={p.name: VALUES for p in SPEC.params}),
    config=st.one_of(
        st.dictionaries(st.one_of(CFG_NAMES, st.text(max_size=6)), VALUES, max_size=6),
        st.fixed_dictionaries({k: st.one_of(st.sampled_from(v), VALUES) for k, v in SPEC.space.items()}),
    ),
    arch=st.sampled_from([None, "cpu", "sm_90a", "sm_100a"]),
)
def test_fuzz_check_config(shape, config, arch):
    """The path get() takes: canonical shape first, then the config against it."""
    EXAMPLES["config"] += 1
    for spec in all_specs():
        try:
            full = spec.canonical_shape({"num_tokens": 64, **shape})
            cfg = spec.check_config(full, config, arch)
        except TkjitError:
            continue
        assert cfg == {k: config[k] for k in spec.space}
        assert spec.static_shape(full)


def test_fuzz_example_counts():
    print(f"\nfuzz examples: canonical_shape {EXAMPLES['shape']}, check_config {EXAMPLES['config']}")


@pytest.mark.parametrize("where", ["shape", "config"])
def test_mixed_type_keys(where):
    with pytest.raises(TkjitError):
        if where == "shape":
            SPEC.canonical_shape({1: 2, "a": 3})
        else:
            SPEC.check_config(FULL, {1: 2, "a": 3})


def test_tolerance_compares_integer_outputs_exactly_even_with_an_rtol():
    """A wrong index hides in a relative error (1 of 10000 large indices off by one is ~1e-6 relative);
    integer outputs must match exactly whatever the float tolerance."""
    import torch

    from tkjit.spec import Tolerance

    ref = torch.arange(100_000, 110_000, dtype=torch.int64)
    out = ref.clone()
    out[5] += 1
    assert "1 of 10000 elements differ" in Tolerance(rtol=1e-5).check("idx", out, ref)
    assert Tolerance(rtol=1e-5).check("idx", ref.clone(), ref) is None
    w = torch.rand(1000, dtype=torch.float32)
    assert Tolerance(rtol=1e-5).check("w", w * (1 + 1e-7), w) is None  # floats keep their tolerance
