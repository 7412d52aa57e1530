"""tools/baselines.py: every baseline factory is a function (a factory that forgot to return its inner
`make` left a kernel's TileKernels and torch columns silently empty in the H200 table)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import baselines  # noqa: E402

import tkjit  # noqa: E402


@pytest.mark.parametrize("table", ["TORCH", "TILE_KERNELS"])
def test_every_factory_is_callable(table):
    bad = [name for name, f in getattr(baselines, table).items() if not callable(f)]
    assert not bad, f"{table} entries that are not factories: {bad}"


def test_every_bench_shape_is_a_valid_shape_of_its_kernel():
    for name, shapes in baselines.SHAPES.items():
        spec = tkjit.get_spec(name)
        for shape in shapes:
            spec.canonical_shape(shape)  # raises on an unknown or out-of-range parameter


def test_torch_baselines_build_on_the_cpu():
    """The torch factories take a full shape and give a callable (no GPU needed to build them)."""
    for name, factory in baselines.TORCH.items():
        shape = tkjit.get_spec(name).canonical_shape(baselines.SHAPES[name][0])
        assert callable(factory(shape)), name
