"""tools/baselines.py: every baseline factory is a function (a factory that forgot to return its inner
`make` left a kernel's TileKernels and torch columns silently empty in the H200 table)."""

import sys
from pathlib import Path

import pytest
import torch

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


@pytest.mark.parametrize("name, pos_arg", [("per_channel_cast_fused", 5), ("swiglu_forward_and_per_token_cast", 3)])
def test_tile_kernels_get_only_map_entries_it_can_read(monkeypatch, name, pos_arg):
    """The benchmark's odd seed puts out-of-range map entries in (zero rows in tkjit); TileKernels reads them
    out of bounds (per_channel_cast_fused's benchmark process died of an illegal address on an H100), so its
    baseline gets them as -1. A stand-in TileKernels records the map it was given."""
    import types

    seen = {}

    def record(*args, **kw):
        seen["pos"] = args[pos_arg]

    fake = types.ModuleType("tile_kernels")
    fake.quant = types.SimpleNamespace(per_channel_cast_fused=record, swiglu_forward_and_per_token_cast=record)
    monkeypatch.setitem(sys.modules, "tile_kernels", fake)
    monkeypatch.setitem(sys.modules, "tile_kernels.quant", fake.quant)
    monkeypatch.setattr(baselines, "_tile_kernels", lambda: fake)
    spec = tkjit.get_spec(name)
    shape = next(s for s in baselines.SHAPES[name] if s.get("has_pos") or s.get("has_weights"))
    small = {"num_tokens": 512, "num_tokens_out": 512} if name == "per_channel_cast_fused" else \
        {"num_tokens": 512, "num_weights": 512}  # a bench shape, fewer rows
    full = spec.canonical_shape({**shape, **small})
    inputs = spec.make_inputs(full, seed=1)
    limit = inputs[0].shape[0] if name == "per_channel_cast_fused" else inputs[2].numel()
    raw = inputs[-1] if name == "per_channel_cast_fused" else inputs[1]
    assert ((raw < -1) | (raw >= limit)).any()  # the seed does put such entries in
    baselines.TILE_KERNELS[name](full, inputs)()
    pos = seen["pos"]
    assert ((pos >= -1) & (pos < limit)).all()
    assert torch.equal(pos[(raw >= 0) & (raw < limit)], raw[(raw >= 0) & (raw < limit)])


def test_the_default_manifest_tunes_every_benchmark_shape():
    """`tkjit tune --manifest tools/manifest.toml` must tune every shape the benchmark table compares with
    TileKernels (its static shape and bucket): a shape left out runs the default there, however slow."""
    from tkjit.canon import canonical_json
    from tkjit.tuning.pretune import load_manifest, resolve_studies

    root = Path(__file__).resolve().parents[1]
    tuned = {(spec.name, canonical_json(spec.static_shape(full)), canonical_json(spec.bucket(full)))
             for _, spec, full in resolve_studies(load_manifest(root / "tools" / "manifest.toml"))}
    missing = []
    for name, shapes in baselines.SHAPES.items():
        spec = tkjit.get_spec(name)
        for shape in shapes:
            full = spec.canonical_shape(shape)
            if (name, canonical_json(spec.static_shape(full)), canonical_json(spec.bucket(full))) not in tuned:
                missing.append((name, shape))
    assert not missing, f"benchmark shapes without a study in tools/manifest.toml: {missing}"
