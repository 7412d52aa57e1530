"""The cudart launcher (TKJIT_LAUNCHER=cudart): TileLang's C launcher compiled beside each CUDA kernel and called
through ctypes, instead of TileLang's host function through the tvm-ffi C ABI. Cross-compiled here, without a
GPU: the key, the library and its dependencies, the launcher's C signature against the recorded ABI (the loader
places every argument by that record), and the errors on a host that cannot launch. Launches are tested on a
GPU (tests/gpu/test_gpu_abi.py and the kernel files, run with TKJIT_LAUNCHER=cudart)."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tkjit
from tkjit import envs, loader
from tkjit.errors import ConfigError, LaunchError
from tkjit.key import toolchain

sys.path.insert(0, str(Path(__file__).parent / "helpers"))
import abi_specs  # noqa: E402,F401  (registers axpy_inplace, scale_traced and bincount_scaled)

pytestmark = pytest.mark.usefixtures("module_cache")


@pytest.fixture
def cudart(monkeypatch):
    monkeypatch.setenv("TKJIT_LAUNCHER", "cudart")


def _meta(k):
    return json.loads((k.path / "manifest.json").read_text())["meta"]


def test_the_key_names_the_launcher_only_when_it_is_not_tvm_ffi(monkeypatch):
    monkeypatch.delenv("TKJIT_LAUNCHER", raising=False)
    before = toolchain("sm_90a")
    assert "launcher" not in before and "launcher" not in toolchain("cpu")  # keys made before it existed hold
    monkeypatch.setenv("TKJIT_LAUNCHER", "cudart")
    assert toolchain("sm_90a") == {**before, "launcher": "cudart"}
    assert "launcher" not in toolchain("cpu")  # the C target has one launcher
    assert loader.loader_for("sm_90a") == "cudart" and loader.loader_for("cpu") == "ctypes"


def test_an_unknown_launcher_is_an_error_naming_the_variable(monkeypatch):
    monkeypatch.setenv("TKJIT_LAUNCHER", "cuda")
    with pytest.raises(ConfigError, match="TKJIT_LAUNCHER='cuda'.*tvm_ffi, cudart"):
        envs.launcher()


def _call_params(src: str) -> list[tuple[str, str]]:
    """(C type, name) of each parameter of the launcher's `call`."""
    (params,) = re.findall(r'extern "C" TL_EXPORT int call\((.*?)\) \{', src)
    out = []
    for p in params.split(","):
        decl = p.split("=")[0].strip()
        name = re.split(r"[ *]", decl)[-1]
        out.append((decl[: -len(name)].replace("__restrict__", "").strip(), name))
    return out


@pytest.mark.parametrize("name, shape", [
    ("axpy_inplace", {"n": 64, "has_bias": True}),  # a float scalar, an inout input, an optional one
    ("bincount_scaled", {"n": 64, "num_bins": 8}),  # int and bool scalars, a zeroed output
    ("transpose", {"rows": 256, "cols": 128, "dtype": "bfloat16"}),  # a runtime size and a runtime stride
    # One expert a token: the builder's num_tokens * num_topk is num_tokens itself, and a name given to it
    # renamed that size in the launcher's signature (the compile refused it, naming both).
    ("get_fused_mapping", {"num_tokens": 64, "num_expanded_tokens": 512, "num_topk": 1, "num_experts": 4}),
    ("group_count", {"num_tokens": 64, "num_topk": 1, "num_groups": 8}),
    ("aux_fi", {"num_tokens": 64, "num_topk": 1, "num_experts": 8}),
])
def test_cross_compiled_launcher_takes_the_arguments_its_abi_records(cudart, name, shape):
    k = tkjit.get(name, shape, arch="sm_90a")
    meta = _meta(k)
    abi = meta["abi"]
    assert abi["loader"] == "cudart"
    loader.check_abi(meta, "sm_90a", k.spec.abi_tensors(k.shape), [p.name for p in k.spec.runtime_params],
                     k.spec.abi_scalars())
    # The order the loader passes: the tensors (inputs, then outputs), the scalars, the runtime sizes and strides
    # as recorded, then the stream.
    # (tensors by position: a builder may name its buffer params as it likes, e.g. a flattened view)
    params = _call_params((k.path / "launcher.cu").read_text())
    n_t = len(k.spec.abi_tensors(k.shape))
    want = [s["name"] for s in abi.get("scalars", ())] + [d["name"] for d in abi["dynamic"]] + ["stream"]
    assert [name for _, name in params[n_t:]] == want
    # The loader passes pointers, the scalars as their C types, 32-bit sizes and strides, then the stream.
    # (a bool is an int8_t there: one byte, as ctypes' c_bool passes it)
    c_scalar = {"float32": "float", "int32": "int", "bool": "int8_t", "int64": "int64_t", "float64": "double"}
    n_s = len(abi.get("scalars", ()))
    assert all(c.endswith("*") for c, _ in params[:n_t])
    assert [c for c, _ in params[n_t:n_t + n_s]] == [c_scalar[s["dtype"]] for s in abi.get("scalars", ())]
    assert [c for c, _ in params[n_t + n_s:]] == ["int"] * len(abi["dynamic"]) + ["cudaStream_t"]


@pytest.mark.skipif(not shutil.which("readelf"), reason="no readelf")
def test_the_library_links_the_shared_runtime_and_not_the_driver(cudart):
    k = tkjit.get("transpose", {"rows": 256, "cols": 128, "dtype": "bfloat16"}, arch="sm_90a")
    lib = k.path / "kernel.so"
    needed = re.findall(r"\(NEEDED\).*\[(.*)\]", subprocess.run(["readelf", "-d", str(lib)], capture_output=True,
                                                                 text=True, check=True).stdout)
    assert any(n.startswith("libcudart.so.") for n in needed), needed  # torch's runtime, by soname
    assert not any(n.startswith("libcuda.so") for n in needed), needed  # the driver only through the runtime
    syms = subprocess.run(["readelf", "--dyn-syms", "-W", str(lib)], capture_output=True, text=True).stdout
    undefined = [line.split()[-1] for line in syms.splitlines() if " UND " in line]
    assert not [s for s in undefined if re.match(r"cu[A-Z]", s)], undefined
    assert lib.stat().st_size < 512 * 1024  # not a static copy of the runtime (~1 MB)


def test_a_cudart_entry_is_refused_where_the_launcher_is_tvm_ffi(cudart, monkeypatch):
    k = tkjit.get("axpy_inplace", {"n": 64, "has_bias": True}, arch="sm_90a")
    meta = _meta(k)
    monkeypatch.setenv("TKJIT_LAUNCHER", "tvm_ffi")
    with pytest.raises(LaunchError, match="loader is 'cudart'"):
        loader.check_abi(meta, "sm_90a", k.spec.abi_tensors(k.shape), [p.name for p in k.spec.runtime_params],
                         k.spec.abi_scalars())


def test_without_cuda_the_first_launch_says_so(cudart):
    k = tkjit.get("transpose", {"rows": 256, "cols": 128, "dtype": "bfloat16"}, arch="sm_90a")  # loads lazily
    x = torch.randn(256, 128).to(torch.bfloat16)
    with pytest.raises(LaunchError, match="tensor on cpu"):
        k._launch(x, torch.empty(128, 256, dtype=torch.bfloat16))
    if not torch.cuda.is_available():
        meta = _meta(k)
        with pytest.raises(LaunchError, match="CUDA is not available"):
            loader.load(k.path / "kernel.so", meta)._open()
