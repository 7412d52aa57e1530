"""The loader trusts an entry's recorded ABI only when it is the one the spec and arch imply."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

import tkjit
from tkjit import loader
from tkjit.errors import LaunchError, TkjitError

SHAPE = {"num_tokens": 33, "n": 4}


def _built(tmp_path_factory, name: str, shape: dict):
    """A real cpu build in a cache of its own: the kernel and its manifest meta."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TKJIT_CACHE_DIR", str(tmp_path_factory.mktemp(name) / "cache"))
        tkjit.reset()
        try:
            k = tkjit.get(name, shape, arch="cpu")
            return k, json.loads((k.path / "manifest.json").read_text())["meta"]
        finally:
            tkjit.reset()


@pytest.fixture(scope="module")
def entry_meta(tmp_path_factory):
    """sinkhorn_fwd's manifest meta and the spec's tensor dims."""
    k, meta = _built(tmp_path_factory, "sinkhorn_fwd", SHAPE)
    return meta, [t.dims for t in (*k.spec.inputs, *k.spec.outputs)], [p.name for p in k.spec.runtime_params]


def test_the_built_abi_is_the_one_the_spec_implies(entry_meta):
    meta, dims, runtime = entry_meta
    assert meta["abi"] == {"loader": "ctypes", "dynamic": [{"name": "num_tokens", "arg": 0, "axis": 0}]}
    loader.check_abi(meta, "cpu", dims, runtime)


@pytest.mark.parametrize("flip", [
    lambda a: a["dynamic"][0].update(axis=1),
    lambda a: a["dynamic"][0].update(arg=1),
    lambda a: a["dynamic"][0].update(name="n"),
    lambda a: a["dynamic"].clear(),
    lambda a: a["dynamic"].append({"name": "num_tokens", "arg": 1, "axis": 0}),
    lambda a: a.update(dynamic="oops"),
    lambda a: a.update(loader="tvm_ffi"),
    lambda a: a.update(loader=["ctypes"]),
    lambda a: a.clear(),
], ids=["axis", "arg", "name", "none", "extra", "not-a-list", "loader-kind", "loader-type", "empty"])
def test_a_flipped_abi_value_is_refused(entry_meta, flip):
    meta, dims, runtime = entry_meta
    bad = copy.deepcopy(meta)
    flip(bad["abi"])
    with pytest.raises(LaunchError, match="wrong ABI"):
        loader.check_abi(bad, "cpu", dims, runtime)


def test_abi_must_be_an_object(entry_meta):
    meta, dims, runtime = entry_meta
    for abi in (None, "ctypes", [1]):
        with pytest.raises(LaunchError, match="records no ABI"):
            loader.check_abi({**meta, "abi": abi}, "cpu", dims, runtime)
    with pytest.raises(LaunchError, match="unknown loader"):
        loader.load(Path("/nonexistent"), {"abi": {"loader": ["ctypes"]}})


@pytest.mark.parametrize("edit", ["axis", "loader"])
def test_a_flipped_abi_on_disk_never_gives_a_wrong_answer(cache_dir, edit):
    """A flipped value in manifest.json: the entry is rebuilt or refused with a tkjit error, never
    served (it computed 4 of 33 tokens and left the rest unwritten)."""
    k = tkjit.get("sinkhorn_fwd", SHAPE, arch="cpu")
    mpath = k.path / "manifest.json"
    manifest = json.loads(mpath.read_text())
    if edit == "axis":
        manifest["meta"]["abi"]["dynamic"][0]["axis"] = 1
    else:
        manifest["meta"]["abi"]["loader"] = "tvm_ffi"
    mpath.write_text(json.dumps(manifest))
    tkjit.reset()
    x = torch.randn(33, 4, 4)
    want = k.spec.reference(k.shape, x)
    try:
        y = tkjit.get("sinkhorn_fwd", SHAPE, arch="cpu")(x)
    except TkjitError:
        return
    assert k.spec.tolerance.check("y", y, want) is None


# -- a strided input's runtime stride ------------------------------------------------------------------
T_SHAPE = {"dtype": "float32", "cols": 67, "rows": 33}


@pytest.fixture(scope="module")
def strided_meta(tmp_path_factory):
    """transpose's (x strided) manifest meta and the spec's tensors."""
    k, meta = _built(tmp_path_factory, "transpose", T_SHAPE)
    return meta, (*k.spec.inputs, *k.spec.outputs), [p.name for p in k.spec.runtime_params]


def test_the_built_abi_records_the_stride(strided_meta):
    meta, tensors, runtime = strided_meta
    assert meta["abi"] == {"loader": "ctypes", "dynamic": [
        {"name": "rows", "arg": 0, "axis": 0}, {"name": "x_stride0", "arg": 0, "stride": 0}]}
    assert loader.dynamic_args(tensors, runtime) == meta["abi"]["dynamic"]
    loader.check_abi(meta, "cpu", tensors, runtime)
    # Plain dims tuples stand for contiguous tensors: no stride entry then.
    assert loader.dynamic_args([t.dims for t in tensors], runtime) == meta["abi"]["dynamic"][:1]


@pytest.mark.parametrize("flip", [
    lambda d: d[1].update(stride=1),
    lambda d: d[1].update(arg=1),
    lambda d: d[1].update(name="x_stride1"),
    lambda d: d[1].update(axis=d[1].pop("stride")),  # read as a size, not a stride
    lambda d: d.pop(1),
    lambda d: d.reverse(),  # stride before the size
    lambda d: d.append({"name": "y_stride0", "arg": 1, "stride": 0}),
], ids=["stride-axis", "arg", "name", "as-size", "dropped", "order", "extra"])
def test_a_flipped_stride_entry_is_refused(strided_meta, flip):
    meta, tensors, runtime = strided_meta
    bad = copy.deepcopy(meta)
    flip(bad["abi"]["dynamic"])
    with pytest.raises(LaunchError, match="wrong ABI"):
        loader.check_abi(bad, "cpu", tensors, runtime)


def test_a_flipped_stride_on_disk_never_gives_a_wrong_answer(cache_dir):
    k = tkjit.get("transpose", T_SHAPE, arch="cpu")
    mpath = k.path / "manifest.json"
    manifest = json.loads(mpath.read_text())
    manifest["meta"]["abi"]["dynamic"].pop()  # the launcher would no longer pass the stride
    mpath.write_text(json.dumps(manifest))
    tkjit.reset()
    x = torch.randn(33, 80)[:, 5:72]
    try:
        y = tkjit.get("transpose", T_SHAPE, arch="cpu")(x)
    except TkjitError:
        return
    assert torch.equal(y, x.T.contiguous())
